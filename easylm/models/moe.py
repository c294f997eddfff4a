"""A sparse mixture-of-experts block a family's layer can use in place of its MLP.

    y = sum over the k chosen experts e of  w_e(x) * expert_e(x)

Routing (`route`), as the released models do it:
    softmax_topk   probabilities over all experts, the k largest kept, optionally divided
                   by their sum (Mixtral always; Qwen3-MoE when `norm_topk_prob`)
    topk_softmax   the k largest logits (with the router's bias, gpt-oss), softmax over them
    topk_sigmoid   the k largest logits, each through a sigmoid (Llama 4)
Experts are gated MLPs, down(act(gate(x)) * up(x)); `swiglu_limit` gives gpt-oss's
clamped variant, (clip(up) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit), and
`expert_bias` its per-expert biases.

Dispatch is dropless: the N*k (token, expert) pairs are sorted by expert, each expert's
rows multiplied by its weights in one grouped matmul (given how many rows each expert
has), and the results put back in token order and weighted. Both moves are gathers by a
permutation and its inverse, forward and backward (`_permute`): autodiff would write a
gather's gradient as a scatter-add, which on a v5e cost the small MoE ~6 ms a layer.
The grouped matmul is `MoEConfig.matmul` (a family's `--<family>.moe_matmul`):
`jax.lax.ragged_dot`, or JAX's Pallas TPU kernel megablox (`gmm` forward, `gmm` with the
weights transposed for the rows' gradient, `tgmm` for the weights'; its ops.gmm custom
VJP), on rows padded to a tile multiple; `auto` is ragged_dot (faster on a v5e than
megablox at the tiles tried: `matmul_kind`). Off a TPU megablox runs in Pallas interpret
mode (the same numbers, slowly: its CPU tests). With
`capacity_factor` > 0 an expert takes at most ceil(capacity_factor * N * k / E) pairs of
each batch shard, first choices before second choices, earlier tokens first; the pairs
past that add nothing (the token keeps its residual) and are counted in `dropped`.

Under a mesh the block runs per batch shard inside `shard_map`, so nothing sorts across
devices. With ep > 1 the experts are split over 'ep' (E/ep per device): each device sends
every pair to the device owning its expert with one `all_to_all`, runs its experts, and
an `all_to_all` brings the results back. The buffers are sized for the worst case (all
of a shard's pairs to one device) unless a capacity factor bounds them.

The load-balancing loss is transformers' `load_balancing_loss_func`; the z-loss is
ST-MoE's mean squared log-sum-exp of the router logits.

LoRA (easylm/variants/lora.py) adds per-expert adapters beside the stacks, the way PEFT's
`target_parameters` adapts transformers' fused `gate_up_proj` and `down_proj`: one A_e
(D, r) shared by gate and up with B_e (r, 2F) (gate's columns, then up's), and A_e (F, r),
B_e (r, D) on down, each applied inside the grouped matmul as x A_e then B_e (two more
ragged_dots; no (E, D, F) delta is formed). B arrives scaled by alpha / r. A frozen stack
may arrive quantized (QLoRA's nf4): it is dequantized here, one layer at a time.

Shape letters: N tokens, D width, F expert MLP width, E experts, K chosen per token,
M sorted (token, expert) rows, R LoRA rank; lower-case for one device's share.
"""

import dataclasses
import math
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import PartitionSpec as P

from easylm.errors import UserError
from easylm.models.config import field
from easylm.runtime.sharding import BATCH_AXES

ROUTERS = ("softmax_topk", "topk_softmax", "topk_sigmoid")
EP = "ep"
REPLAY = "routing"  # the variable collection that carries choices to replay
ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": partial(nn.gelu, approximate=True)}
MATMULS = ("auto", "ragged_dot", "megablox")
# megablox's largest tiles (rows, contraction, output columns), MaxText's v5e defaults
# for rows (wi_tile_fwd_batch_seq=512); the other two are one tile t dividing both D and F
# (`_tiling`), so that the backward pass's transposed gmm and tgmm tile exactly too.
MEGABLOX_TILE = (512, 1024)

# Expert weights are stacked with a leading E axis, split over 'ep'; the rest as the dense
# MLP's (D over fsdp, F over mp). The router is small and replicated.
PARTITION_RULES = (
    (r"experts/(gate_proj|up_proj)$", P(EP, "fsdp", "mp")),
    (r"experts/down_proj$", P(EP, "mp", "fsdp")),
    (r"experts/(gate_proj|up_proj)_bias$", P(EP, "mp")),
    (r"experts/down_proj_bias$", P(EP, None)),
    (r"router/(kernel|bias)$", P()),
)
# The LoRA adapters an expert module may carry, by the stacks they adapt (transformers'
# fused names: PEFT's target_parameters).
EXPERT_ADAPTERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # F: one expert's MLP width
    router: str = "softmax_topk"
    norm_topk_prob: bool = True  # softmax_topk only
    router_bias: bool = False  # gpt-oss
    expert_bias: bool = False  # gpt-oss
    swiglu_limit: float = 0.0  # > 0: gpt-oss's clamped SwiGLU
    swiglu_alpha: float = 1.702
    clamp_limit: float = 0.0  # > 0: DeepSeek-V4's act(min(gate, l)) * clip(up, -l, l)
    capacity_factor: float = 0.0  # 0: dropless
    initializer_range: float = 0.02
    activation: str = "silu"  # of act(gate) * up: silu, or gelu_tanh (Gemma 4)
    matmul: str = "auto"  # the grouped matmul: one of MATMULS

    def __post_init__(self):
        if self.matmul not in MATMULS:
            raise ValueError(f"moe_matmul={self.matmul!r} is not one of {', '.join(MATMULS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}; expected one of "
                             f"{', '.join(ACTIVATIONS)}")
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r}; expected one of {', '.join(ROUTERS)}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """The field a family whose layers may have experts adds to its config, a base listed
    before `ModelConfig` (`class LLaMAConfig(ExpertMatmulConfig, ModelConfig)`); the family
    passes it on as `MoEConfig.matmul`."""

    moe_matmul: str = field("auto", "the experts' grouped matmul: ragged_dot "
                                    "(jax.lax.ragged_dot), megablox (JAX's Pallas TPU kernel; "
                                    "off a TPU in interpret mode: slow, for tests) or auto "
                                    "(ragged_dot: the faster on a v5e so far, docs/moe.md); "
                                    "the same numbers")

    def __post_init__(self):
        super().__post_init__()
        if self.moe_matmul not in MATMULS:
            raise UserError(f"--{self.section}.moe_matmul={self.moe_matmul!r} is not one of "
                            f"{', '.join(MATMULS)}")


class RouterStats(NamedTuple):
    logits: jax.Array  # (N, E) fp32: what the load-balancing and z losses read
    experts: jax.Array  # (N, K) the chosen experts (what routing replay would record)
    load: jax.Array  # (E,) pairs each expert was given (before any capacity drop)
    dropped: jax.Array  # () pairs past an expert's capacity


# ------------------------------------------------------------------ routing


def route(logits, config: MoEConfig, experts=None):
    """(weights (N, K) fp32, experts (N, K) int32) from router logits (N, E).

    `experts` given (routing replay: the choices a sampler recorded), those experts are
    used and only their weights come from `logits`, by the same rule, so the router
    still learns from the loss; a token whose recorded row is -1 (none recorded: padding
    past a rollout's end) is routed as usual."""
    logits = logits.astype(jnp.float32)
    k = config.num_experts_per_tok
    scores = logits if config.router.startswith("topk_") else jax.nn.softmax(logits, axis=-1)
    top, own = jax.lax.top_k(scores, k)
    if experts is None:
        experts = own
    else:
        experts = jnp.asarray(experts, jnp.int32)
        experts = jnp.where(experts[:, :1] >= 0, experts, own)
        top = jnp.take_along_axis(scores, experts, axis=-1)
    if config.router == "topk_softmax":
        return jax.nn.softmax(top, axis=-1), experts
    if config.router == "topk_sigmoid":
        return jax.nn.sigmoid(top), experts
    if config.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return top, experts


def load_balancing_loss(router_logits, top_k: int, mask=None):
    """transformers' `load_balancing_loss_func`: E * sum_e f_e * p_e over all layers'
    tokens, f_e the share of top-k choices given to e, p_e its mean probability.
    `router_logits`: (L, N, E) or a list of (N, E); `mask` (N,) leaves out padding."""
    logits = jnp.stack([jnp.asarray(x, jnp.float32) for x in router_logits])  # (L, N, E)
    E = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    weight = jnp.ones(logits.shape[1]) if mask is None else jnp.asarray(mask, jnp.float32)
    counts = jnp.einsum("LNKE,N->E", jax.nn.one_hot(chosen, E), weight)
    prob_sums = jnp.einsum("LNE,N->E", probs, weight)
    # no token counted (a GRPO step whose every completion was masked as truncated): 0,
    # not 0/0
    rows = jnp.maximum(logits.shape[0] * weight.sum(), 1.0)
    return E * jnp.sum((counts / rows) * (prob_sums / rows))


def router_z_loss(router_logits):
    """ST-MoE's z-loss: the mean over tokens (and layers) of logsumexp(logits)^2."""
    logits = jnp.asarray(router_logits, jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def load_metrics(stats: list[RouterStats], top_k: int, mask=None) -> dict:
    """What a step logs from its MoE layers' stats: the load-balancing and z losses, the
    most and fewest pairs any expert got in any layer, and the pairs dropped."""
    loads = jnp.stack([s.load for s in stats])  # (L, E)
    return {"moe_aux_loss": load_balancing_loss([s.logits for s in stats], top_k, mask),
            "moe_z_loss": router_z_loss(jnp.stack([s.logits for s in stats])),
            "moe_load_max": loads.max(), "moe_load_min": loads.min(),
            "moe_dropped": sum(s.dropped for s in stats)}


@dataclasses.dataclass(frozen=True)
class RouterLoss:
    """What a training loss adds for a model's routers: aux_coef x the load-balancing loss
    (0: logged only, as transformers without output_router_logits) and z_coef x the
    z-loss, over the layers' `RouterStats` a forward pass sowed."""

    top_k: int
    aux_coef: float
    z_coef: float = 0.0
    # Aux-loss-free balancing: after each optimizer step the correction biases move by
    # this times sign(mean load - load) (sigmoid_moe.update_bias); 0: they stay.
    bias_update_rate: float = 0.0


def router_stats(collection) -> RouterStats:
    """The `RouterStats` a forward pass sowed into its "router" collection (each MoE layer
    `self.sow("router", "stats", stats)`), stacked over the layers: logits (L, N, E),
    experts (L, N, K), load (L, E), dropped (L,). Scanned layers come stacked already."""
    found = jax.tree.leaves(collection, is_leaf=lambda x: isinstance(x, RouterStats))
    found = [s if s.logits.ndim == 3 else jax.tree.map(lambda x: x[None], s) for s in found]
    if not found:
        raise ValueError("the forward pass sowed no router statistics (no MoE layer)")
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *found)


def replay_collection(params, experts):
    """The `REPLAY` variable collection that makes a forward pass over `params` replay
    `experts` (L, N, K): each `SparseMoE` (a module with router/kernel) gets its layers'
    rows as routing/.../experts, N = B*T of the forward's tokens, -1 rows routed as usual.
    The layers are in `router_stats`' order: both walk the tree in jax's sorted-key order,
    the sown stats at <layer>/stats and the block at <layer>/mlp, so that what a sampler
    recorded with `router_stats` replays as it was (tests/test_routing_replay.py)."""
    blocks = [(keys[:-2], kernel) for keys, kernel in
              ((tuple(getattr(k, "key", k) for k in path), kernel) for path, kernel in
               jax.tree_util.tree_flatten_with_path(params)[0])
              if keys[-2:] == ("router", "kernel")]
    sizes = [kernel.shape[0] if kernel.ndim == 3 else 1 for _, kernel in blocks]  # scanned
    if sum(sizes) != experts.shape[0]:
        raise ValueError(f"routing to replay has {experts.shape[0]} layers, the model "
                         f"{sum(sizes)} mixture-of-experts layers")
    out, start = {}, 0
    for (path, kernel), size in zip(blocks, sizes):
        node = out
        for key in path:
            node = node.setdefault(key, {})
        chosen = experts[start:start + size]
        node["experts"] = chosen if kernel.ndim == 3 else chosen[0]
        start += size
    return out


# ------------------------------------------------------------------ grouped experts


def expert_mlp(x, params, group_sizes, config: MoEConfig, dtype):
    """Rows x (M, D), sorted so that expert e's group_sizes[e] rows are consecutive, through
    their experts; rows past sum(group_sizes) come out as zeros. params: (E, ...) stacks,
    and the LoRA adapters of some (`EXPERT_ADAPTERS`)."""
    M, D = x.shape
    ragged = partial(jax.lax.ragged_dot, group_sizes=group_sizes,
                     preferred_element_type=dtype)
    grouped = ragged
    if matmul_kind(config.matmul) == "megablox":
        tiling = _tiling(M, D, config.intermediate_size)
        x = jnp.pad(x, ((0, -M % tiling[0]), (0, 0)))  # rows: a multiple of the row tile
        grouped = partial(gmm, group_sizes=group_sizes, dtype=dtype, tiling=tiling)
    x = x.astype(dtype)
    F = config.intermediate_size
    # Gate and up stay two grouped matmuls: one over their concatenated (E, D, 2F) stacks
    # made the small MoE's step 5% slower on a v5e (docs/benchmarks.md, 2026-12-06).
    gate = grouped(x, params["gate_proj"].astype(dtype))  # (M, F)
    up = grouped(x, params["up_proj"].astype(dtype))  # (M, F)
    # LoRA's rank-R products stay on ragged_dot: a megablox tile of R columns is mostly
    # padding.
    if "gate_up_proj_lora_a" in params:
        gate_up = _low_rank(ragged, x, params, "gate_up_proj", dtype)  # (M, 2F)
        gate, up = gate + gate_up[:, :F], up + gate_up[:, F:]
    if config.expert_bias:
        expert = _row_expert(group_sizes, x.shape[0])
        gate = gate + params["gate_proj_bias"].astype(dtype)[expert]
        up = up + params["up_proj_bias"].astype(dtype)[expert]
    if config.swiglu_limit > 0:
        limit = config.swiglu_limit
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        h = (up + 1) * gate * jax.nn.sigmoid(gate * config.swiglu_alpha)
    else:
        if config.clamp_limit > 0:
            gate = jnp.minimum(gate, config.clamp_limit)
            up = jnp.clip(up, -config.clamp_limit, config.clamp_limit)
        h = ACTIVATIONS[config.activation](gate) * up
    out = grouped(h, params["down_proj"].astype(dtype))  # (M, D)
    if "down_proj_lora_a" in params:
        out = out + _low_rank(ragged, h, params, "down_proj", dtype)
    if config.expert_bias:
        out = out + params["down_proj_bias"].astype(dtype)[expert]
    valid = jnp.arange(x.shape[0]) < group_sizes.sum()
    return jnp.where(valid[:, None], out, 0)[:M]


def matmul_kind(matmul: str) -> str:
    """The grouped matmul `MoEConfig.matmul` runs: auto is ragged_dot on every backend.
    Measured on one v5e (2026-12-05, docs/benchmarks.md#experts-and-memory), forward and
    backward in bf16: at the small MoE's shape (131k rows, D 1024, F 768, 32 experts)
    ragged_dot 114.6 TFLOP/s, megablox with `_tiling`'s tiles 64.7; at 128 experts, D 2048,
    68.4 against 44.3. auto picks megablox on a TPU once a tiling beats ragged_dot
    (scripts/kernel_bench.py sweeps them)."""
    return "ragged_dot" if matmul == "auto" else matmul


def _tiling(M: int, D: int, F: int) -> tuple[int, int, int]:
    """megablox's tiles (rows, contraction, columns) for rows (M, D) through (D, F) and
    (F, D) stacks: rows up to MEGABLOX_TILE[0] (M is padded to a multiple), and one tile
    t for D and F alike, the largest multiple of 128 up to MEGABLOX_TILE[1] dividing both
    (the backward pass swaps their roles). Off a TPU (interpret mode) any t dividing both."""
    rows = min(MEGABLOX_TILE[0], -(-M // 16) * 16)
    common = math.gcd(D, F)
    if jax.default_backend() != "tpu":
        return rows, common, common
    fits = [t for t in range(128, MEGABLOX_TILE[1] + 1, 128) if common % t == 0]
    if not fits:
        raise UserError(f"moe_matmul=megablox tiles the width ({D}) and the expert width "
                        f"({F}) by multiples of 128, which these are not: use "
                        f"moe_matmul=ragged_dot")
    return rows, fits[-1], fits[-1]


def gmm(lhs, rhs, group_sizes, dtype, tiling):
    """megablox's grouped matmul (its custom VJP: gmm, transposed gmm, tgmm): lhs (M, in)
    through rhs (E, in, out), M a multiple of the row tile. Rows past sum(group_sizes)
    belong to no group: the kernel leaves them (and their gradient) unwritten, so they
    are zeroed on the way in and out."""
    valid = (jnp.arange(lhs.shape[0]) < group_sizes.sum())[:, None]
    out = megablox.gmm(jnp.where(valid, lhs, 0), rhs, group_sizes, dtype, tiling,
                       interpret=jax.default_backend() != "tpu")
    return jnp.where(valid, out, 0)


def _low_rank(ragged, x, params, name: str, dtype):
    """Each row through its expert's adapters: (x A_e) B_e, (M, in) -> (M, out)."""
    xa = ragged(x, params[name + "_lora_a"].astype(dtype))  # (M, R)
    return ragged(xa, params[name + "_lora_b"].astype(dtype))


def _row_expert(group_sizes, rows):
    """(rows,) the expert of each sorted row (the last one for rows past the groups)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.minimum(jnp.searchsorted(ends, jnp.arange(rows), side="right"),
                       group_sizes.shape[0] - 1)


def capacity(config: MoEConfig, tokens: int) -> int:
    """Pairs one expert takes from `tokens` tokens (a batch shard's); 0: no limit."""
    if config.capacity_factor <= 0:
        return 0
    return math.ceil(config.capacity_factor * tokens * config.num_experts_per_tok
                     / config.num_experts)


def _kept(experts, E, cap):
    """(N, K) bool: which pairs fit their expert's capacity, first choices first
    (the pairs taken in slot-major order, tokens in order within a slot)."""
    if cap <= 0:
        return jnp.ones(experts.shape, bool)
    flat = experts.T.reshape(-1)  # (K*N,) slot-major
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E)
    starts = jnp.cumsum(sizes) - sizes
    rank_sorted = jnp.arange(flat.shape[0]) - starts[flat[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return (rank < cap).reshape(experts.shape[::-1]).T


def _sort_pairs(experts, kept, E):
    """The (token, expert) pairs sorted by expert, dropped ones last: (order (n*K,), its
    inverse (n*K,), group sizes (E,)). order[i] is the flat (token * K + slot) index of
    sorted row i; inverse[j] the sorted row of flat pair j."""
    key = jnp.where(kept, experts, E).reshape(-1)
    order = jnp.argsort(key, stable=True)
    return order, jnp.argsort(order), jnp.bincount(key, length=E + 1)[:E]


@jax.custom_vjp
def _permute(rows, index, inverse):
    """rows[index] for a permutation `index` whose inverse is `inverse`. Its gradient is
    the inverse gather g[inverse] rather than the scatter-add that autodiff of a gather
    writes: on a TPU a scatter of (n*K, D) rows costs several times the gather."""
    return rows.at[index].get(mode="promise_in_bounds")


def _permute_fwd(rows, index, inverse):
    return _permute(rows, index, inverse), (index, inverse)


def _permute_bwd(residuals, g):
    index, inverse = residuals
    return g.at[inverse].get(mode="promise_in_bounds"), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _gather_pairs(x, order, inverse, K):
    """Each sorted row's token: x (n, D) -> (n*K, D), x[order // K], as the K copies of
    every token permuted (so that the gradient gathers and sums over K, no scatter)."""
    n, D = x.shape
    copies = jnp.broadcast_to(x[:, None], (n, K, D)).reshape(n * K, D)
    return _permute(copies, order, inverse)


def _combine(rows, order, inverse, weights):
    """Sorted rows (n*K, D) back in token order, weighted and summed over K: (n, D)."""
    n, K = weights.shape
    unsorted = _permute(rows, inverse, order).reshape(n, K, -1)
    return jnp.einsum("nK,nKD->nD", weights.astype(rows.dtype), unsorted)


def moe_local(x, weights, experts, params, config: MoEConfig, dtype):
    """One batch shard on one device holding all experts: x (n, D) -> (n, D), dropped."""
    E, K = config.num_experts, config.num_experts_per_tok
    kept = _kept(experts, E, capacity(config, x.shape[0]))
    order, inverse, sizes = _sort_pairs(experts, kept, E)
    rows = expert_mlp(_gather_pairs(x.astype(dtype), order, inverse, K), params, sizes,
                      config, dtype)
    out = _combine(rows, order, inverse, jnp.where(kept, weights, 0))
    return out, jnp.sum(~kept)


def moe_expert_parallel(x, weights, experts, params, config: MoEConfig, dtype, ep: int):
    """Inside shard_map over 'ep' (and the batch axes): x (n, D) of this batch shard, params
    this device's E/ep experts. Pairs travel to their expert's device and back."""
    E, K = config.num_experts, config.num_experts_per_tok
    local = E // ep
    n = x.shape[0]
    cap = capacity(config, n)
    kept = _kept(experts, E, cap)
    order, inverse, sizes = _sort_pairs(experts, kept, E)  # sorted by expert, so by device
    per_device = sizes.reshape(ep, local).sum(axis=1)  # (ep,) pairs sent to each device
    slots = n * K if cap <= 0 else min(n * K, local * cap)  # buffer rows per device
    # Sorted row i goes to device d = its expert // local, at d's slot i - start[d].
    starts = jnp.cumsum(per_device) - per_device
    key = jnp.where(kept, experts, E).reshape(-1)[order]
    device = jnp.minimum(key // local, ep)  # ep: dropped (sorted last)
    slot = jnp.arange(n * K) - starts[jnp.minimum(device, ep - 1)]
    send_index = jnp.where(device < ep, device * slots + slot, ep * slots)  # past the end
    send = jnp.zeros((ep * slots, x.shape[1]), dtype).at[send_index].set(
        x[order // K].astype(dtype), mode="drop")
    send_expert = jnp.full((ep * slots,), local, jnp.int32).at[send_index].set(
        key % local, mode="drop")  # local expert id; `local` marks an empty slot
    # (ep, slots, ...): row d goes to device d; what arrives, row s came from device s.
    recv = jax.lax.all_to_all(send.reshape(ep, slots, -1), EP, 0, 0, tiled=False)
    recv_expert = jax.lax.all_to_all(send_expert.reshape(ep, slots), EP, 0, 0, tiled=False)
    recv, recv_expert = recv.reshape(ep * slots, -1), recv_expert.reshape(-1)
    local_order = jnp.argsort(recv_expert, stable=True)
    local_sizes = jnp.bincount(recv_expert, length=local + 1)[:local]
    done = expert_mlp(recv[local_order], params, local_sizes, config, dtype)
    done = jnp.zeros_like(done).at[local_order].set(done)
    back = jax.lax.all_to_all(done.reshape(ep, slots, -1), EP, 0, 0, tiled=False)
    rows = back.reshape(ep * slots, -1).at[send_index].get(mode="fill", fill_value=0)
    out = _combine(rows, order, inverse, jnp.where(kept, weights, 0))
    return out, jnp.sum(~kept)


# ------------------------------------------------------------------ the block


class SparseMoE(nn.Module):
    """x (B, T, D) -> (y (B, T, D), RouterStats). Parameters: router/kernel (D, E)
    (router/bias (E,)), experts/{gate_proj, up_proj} (E, D, F), experts/down_proj
    (E, F, D) (and their biases with `expert_bias`)."""

    config: MoEConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, experts=None):
        """`experts` (B, T, K): replay these choices instead of routing (see `route`)."""
        c = self.config
        B, T, D = x.shape
        E = c.num_experts
        x = x.reshape(B * T, D)
        logits = Router(E, c.router_bias, c.initializer_range, self.param_dtype,
                        name="router")(x)  # (N, E) fp32
        if experts is None and self.has_variable(REPLAY, "experts"):
            experts = self.get_variable(REPLAY, "experts")  # see `replay_collection`
        if experts is not None:
            experts = experts.reshape(B * T, c.num_experts_per_tok)
        weights, experts = route(logits, c, experts)
        params = Experts(c, D, self.param_dtype, name="experts")()
        out, dropped = self._dispatch(x, weights, experts, params)
        stats = RouterStats(logits, experts, jnp.bincount(experts.reshape(-1), length=E),
                            dropped)
        return out.reshape(B, T, D).astype(self.dtype), stats

    def _dispatch(self, x, weights, experts, params):
        return dispatch(x, weights, experts, params, self.config, self.dtype)


def dispatch(x, weights, experts, params, c: MoEConfig, dtype):
    """Tokens x (N, D) through their chosen `experts` (N, K) weighted by `weights`, the
    expert stacks `params` (`Experts`): (out (N, D), pairs dropped), per batch shard under
    a mesh (split over 'ep' there), on one device otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EP not in mesh.axis_names:
        return moe_local(x, weights, experts, params, c, dtype)
    ep = mesh.shape[EP]
    if c.num_experts % ep:
        raise ValueError(f"{c.num_experts} experts cannot be split over ep={ep}")
    # Rows are (B, T) flattened: B split over the batch axes, T over 'sp' (context
    # parallelism), so each device routes the tokens it holds.
    batch = tuple(a for a in (*BATCH_AXES, "sp") if a in mesh.axis_names)
    if x.shape[0] % math.prod(mesh.shape[a] for a in batch):
        # Fewer rows than batch shards (decoding one sequence): XLA places it.
        return moe_local(x, weights, experts, params, c, dtype)
    if ep == 1:
        local = partial(moe_local, config=c, dtype=dtype)
    else:
        local = partial(moe_expert_parallel, config=c, dtype=dtype, ep=ep)

    def shard(x, weights, experts, params):
        out, dropped = local(x, weights, experts, params)
        return out, jax.lax.psum(dropped, batch)

    rows = P(batch, None)
    expert_specs = jax.tree.map(lambda _: P(EP), params)
    return jax.shard_map(shard, mesh=mesh, in_specs=(rows, rows, rows, expert_specs),
                         out_specs=(rows, P()), check_vma=False)(x, weights, experts,
                                                                  params)


class Router(nn.Module):
    num_experts: int
    bias: bool
    initializer_range: float
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        """(N, D) -> logits (N, E) in fp32: the routing decision is made in full precision."""
        kernel = self.param("kernel", nn.initializers.normal(self.initializer_range),
                            (x.shape[-1], self.num_experts), self.param_dtype)
        logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), kernel.astype(jnp.float32))
        if self.bias:
            logits = logits + self.param("bias", nn.initializers.zeros, (self.num_experts,),
                                         self.param_dtype).astype(jnp.float32)
        return logits


class Experts(nn.Module):
    config: MoEConfig
    hidden_size: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        c, D = self.config, self.hidden_size
        E, F = c.num_experts, c.intermediate_size
        init = nn.initializers.normal(c.initializer_range)
        shapes = {"gate_proj": (E, D, F), "up_proj": (E, D, F), "down_proj": (E, F, D)}
        if c.expert_bias:
            shapes |= {"gate_proj_bias": (E, F), "up_proj_bias": (E, F),
                       "down_proj_bias": (E, D)}
        params = {name: _dense(self.param(name, nn.initializers.zeros if name.endswith("bias")
                                          else init, shape, self.param_dtype))
                  for name, shape in shapes.items()}
        # LoRA's adapters, where the variant put them (nothing creates them here)
        for name in EXPERT_ADAPTERS:
            for leaf in (f"{name}_lora_a", f"{name}_lora_b"):
                if self.has_variable("params", leaf):
                    params[leaf] = self.get_variable("params", leaf)
        return params


def _dense(w):
    """A stack as an array: a quantized one (QLoRA's frozen base, qwix's WithAux(QArray))
    dequantized to its scales' dtype (the compute dtype)."""
    return qwix.dequantize(w.array) if isinstance(getattr(w, "array", None), qwix.QArray) else w
