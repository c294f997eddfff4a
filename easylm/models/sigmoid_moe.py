"""DeepSeek-V3's mixture of experts (also GLM-4.5's, Kimi K2's), as transformers'
`DeepseekV3MoE` computes it: routed experts chosen on sigmoid scores, and shared experts
every token goes through.

    y = routed_scaling_factor * sum over the k chosen e of  w_e * expert_e(x)  +  shared(x)

Routing (`sigmoid_route`): scores s = sigmoid(logits) (N, E). The choice is made on
s + b, b the correction bias (aux-loss-free balancing moves it between steps, never by
gradient): experts fall into n_group groups of E / n_group, each group is worth the sum
of its two best s + b, only the topk_group best groups stay, and the k best of their
experts are chosen. The weights are the chosen experts' s, without b (divided by their
sum with `norm_topk_prob`). Mistral Small 4 routes the same way on softmax scores, without
a correction bias (router "softmax"). The router's kernel and the bias stay fp32 whatever
the parameters' dtype, as transformers keeps them (`_keep_in_fp32_modules_strict`).

The routed experts are moe.py's (the same stacked parameters, LoRA adapters, grouped
matmul, capacity and expert parallelism); the shared experts are one gated MLP of width
n_shared_experts * F.

The bias is not a parameter (an optimizer's weight decay would pull it to zero): it lives
in its own variable collection, `BIAS`, zeros at init.

Shape letters as moe.py's: N tokens, D width, F expert MLP width, E experts, K chosen per
token, G groups.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from easylm.models import moe
from easylm.models.moe import REPLAY, Experts, MoEConfig, Router, RouterStats, SparseMoE

BIAS = "router_bias"  # the collection holding e_score_correction_bias
ROUTER = "sigmoid"
# How the router's logits become scores: DeepSeek-V3's sigmoid (with the correction bias
# that picks), or Mistral 4's softmax over all experts (no bias).
ROUTERS = (ROUTER, "softmax")
# moe.py's, and the shared experts split as a dense MLP is (D over fsdp, F over mp).
PARTITION_RULES = moe.PARTITION_RULES + (
    (r"shared_experts/(gate_proj|up_proj)/kernel$", P("fsdp", "mp")),
    (r"shared_experts/down_proj/kernel$", P("mp", "fsdp")),
    (r"e_score_correction_bias$", P()),
)


@dataclasses.dataclass(frozen=True)
class SigmoidMoEConfig(MoEConfig):
    """moe.py's config (experts, capacity) with DeepSeek's routing and shared experts."""

    router: str = ROUTER
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    def __post_init__(self):
        E, G, K = self.num_experts, self.n_group, self.num_experts_per_tok
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r}: this block routes by "
                             f"{' or '.join(ROUTERS)}")
        if E % G or E // G < 2:
            raise ValueError(f"{E} experts cannot form n_group={G} groups of two or more")
        if not 0 < self.topk_group <= G:
            raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={G}")
        if not 0 < K <= self.topk_group * E // G:
            raise ValueError(f"num_experts_per_tok={K} must be in 1..{self.topk_group * E // G}"
                             f" (the experts of topk_group groups)")


def sigmoid_route(logits, bias, config: SigmoidMoEConfig, experts=None):
    """(weights (N, K) fp32, experts (N, K) int32) from router logits (N, E) and the
    correction bias (E,). `experts` given (routing replay), those are used and only their
    weights come from `logits`; rows of -1 are routed as usual (as moe.route). A softmax
    router has no bias (None)."""
    logits = logits.astype(jnp.float32)
    if config.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)  # (N, E)
        own = _choose(scores, config)
    else:
        scores = jax.nn.sigmoid(logits)
        own = _choose(scores + bias.astype(jnp.float32), config)
    if experts is None:
        experts = own
    else:
        experts = jnp.asarray(experts, jnp.int32)
        experts = jnp.where(experts[:, :1] >= 0, experts, own)
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # the bias picks, never weighs
    if config.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)  # transformers' 1e-20
    return weights * config.routed_scaling_factor, experts


def _choose(choice, config: SigmoidMoEConfig):
    """The K experts (N, K) with the best `choice` (N, E) within the topk_group groups
    whose two best experts sum highest."""
    N, E = choice.shape
    G = config.n_group
    grouped = choice.reshape(N, G, E // G)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)  # (N, G)
    _, best_groups = jax.lax.top_k(group_scores, config.topk_group)  # (N, topk_group)
    kept = jax.nn.one_hot(best_groups, G, dtype=jnp.bool_).any(axis=1)  # (N, G)
    choice = jnp.where(jnp.repeat(kept, E // G, axis=1), choice, -jnp.inf)
    return jax.lax.top_k(choice, config.num_experts_per_tok)[1].astype(jnp.int32)


def update_bias(params, load, rate: float):
    """Aux-loss-free load balancing (DeepSeek-V3, section 2.1.2; MaxText's
    `routed_bias_update_rate`): each layer's correction bias moves by
    rate * sign(mean load - load), raising the bias of the experts that got fewer than
    their share of the step's (token, expert) pairs and lowering the others'. `load`
    (L, E) is the step's `RouterStats.load`, its layers in the order the forward sowed them:
    jax's sorted-key order, the order the bias leaves flatten in too (as
    moe.replay_collection relies on); a scanned stack's leaf (R, E) takes R rows."""
    load = load.astype(jnp.float32)
    step = rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)  # (L, E)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out, start = [], 0
    for path, leaf in leaves:
        if getattr(path[-1], "key", None) != "e_score_correction_bias":
            out.append(leaf)
            continue
        rows = leaf.shape[0] if leaf.ndim == 2 else 1
        delta = step[start:start + rows].reshape(leaf.shape)
        out.append((leaf.astype(jnp.float32) + delta).astype(leaf.dtype))
        start += rows
    if start != load.shape[0]:
        raise ValueError(f"{load.shape[0]} layers of expert load for {start} correction biases")
    return jax.tree_util.tree_unflatten(treedef, out)


class SigmoidMoE(SparseMoE):
    """x (B, T, D) -> (y (B, T, D), RouterStats). Parameters: router/kernel (D, E) fp32,
    experts/... as `SparseMoE`'s, shared_experts/{gate_proj, up_proj, down_proj}/kernel;
    and router_bias/e_score_correction_bias (E,) fp32 in the `BIAS` collection (none with
    a softmax router)."""

    config: SigmoidMoEConfig
    # Where e_score_correction_bias lives: its own collection (`BIAS`), or "params" for a
    # family whose checkpoint loader carries it with the weights (it gets no gradient:
    # it only picks experts).
    bias_collection: str = BIAS

    @nn.compact
    def __call__(self, x, experts=None):
        c = self.config
        B, T, D = x.shape
        E = c.num_experts
        tokens = x.reshape(B * T, D)
        logits = Router(E, False, c.initializer_range, jnp.float32, name="router")(tokens)
        bias = None
        if c.router == ROUTER:
            bias = self.variable(self.bias_collection, "e_score_correction_bias",
                                 lambda: jnp.zeros((E,), jnp.float32)).value
        if experts is None and self.has_variable(REPLAY, "experts"):
            experts = self.get_variable(REPLAY, "experts")
        if experts is not None:
            experts = experts.reshape(B * T, c.num_experts_per_tok)
        weights, experts = sigmoid_route(logits, bias, c, experts)
        params = Experts(c, D, self.param_dtype, name="experts")()
        out, dropped = self._dispatch(tokens, weights, experts, params)
        out = out.reshape(B, T, D).astype(self.dtype)
        if c.n_shared_experts:
            out = out + _SharedExperts(c.n_shared_experts * c.intermediate_size,
                                       c.initializer_range, self.dtype, self.param_dtype,
                                       name="shared_experts")(x)
        stats = RouterStats(logits, experts, jnp.bincount(experts.reshape(-1), length=E),
                            dropped)
        return out, stats


class _SharedExperts(nn.Module):
    """down(silu(gate(x)) * up(x)): the experts every token takes, as one MLP."""

    width: int
    initializer_range: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            return nn.Dense(features, use_bias=False, dtype=self.dtype,
                            param_dtype=self.param_dtype,
                            kernel_init=nn.initializers.normal(self.initializer_range), name=name)

        gate, up = dense(self.width, "gate_proj")(x), dense(self.width, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(nn.silu(gate) * up)
