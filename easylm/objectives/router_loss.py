"""A mixture of experts' router losses added to an objective's sums.

    loss = objective + aux_coef * load_balancing + z_coef * z

in every objective (next-token, DPO/SimPO/ORPO, GRPO), as transformers'
Qwen3MoeForCausalLM and MixtralForCausalLM add it (`outputs.loss` with
labels and `output_router_logits=True`; aux_coef is 0 without it). The sums stay sums:
each term is carried times the batch's count (tokens for next-token training, pairs for
a preference objective, completions or tokens for GRPO), so that
the step's one division by the count gives the mean loss plus the terms, and micro-batches
add up (a micro-batched step's terms are then the count-weighted mean of its
micro-batches'). Padding (segment id 0) is left out of the load-balancing loss, as
transformers leaves out what its attention mask masks. Logged: `loss` is the total the
gradient sees (the objective plus the weighted router terms: transformers' `outputs.loss`,
TRL's logged `loss`), beside it the objective's own mean under its sums' `PART` name
(`ce_loss` for next-token training) and its other means, the unweighted `aux_loss` (as
TRL logs it) and `z_loss`, the most and fewest pairs an expert got in any layer, and the
pairs dropped past a capacity.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from easylm.models import moe


class RouterSums(NamedTuple):
    sums: Any  # the objective's own sums (LossSums, ...)
    router_loss: jax.Array  # (aux_coef * aux + z_coef * z) * count: what the loss adds
    aux_loss: jax.Array  # load-balancing loss * count
    z_loss: jax.Array  # z-loss * count
    load: jax.Array  # (L, E) pairs each expert got, summed over micro-batches
    dropped: jax.Array  # pairs dropped past an expert's capacity

    @property
    def loss(self):
        return self.sums.loss + self.router_loss

    @property
    def count(self):
        return self.sums.count

    @property
    def COUNT(self):  # noqa: N802 (the sums types' class attribute)
        return self.sums.COUNT

    @property
    def PART(self):  # noqa: N802 (the sums types' class attribute)
        return self.sums.PART

    def means(self) -> dict:
        count = jnp.maximum(self.count, 1.0)
        own = self.sums.means()
        return {**own, "loss": own["loss"] + self.router_loss / count,
                self.PART: own["loss"], "aux_loss": self.aux_loss / count,
                "z_loss": self.z_loss / count, "moe_load_max": self.load.max(),
                "moe_load_min": self.load.min(), "moe_dropped": self.dropped}

    def total_mean(self):
        """The objective's mean plus the router terms: transformers' `outputs.loss`."""
        return self.loss / jnp.maximum(self.count, 1.0)


def fed_tokens(loss_masks):
    """(N, T) 1.0 at the positions a right-padded row feeds, up to its last scored target
    (prompt and response of a preference pair or a rollout), 0.0 on the padding after:
    what the load-balancing loss counts for objectives whose rows carry no segment ids."""
    return (jnp.cumsum(loss_masks[:, ::-1], axis=1)[:, ::-1] > 0).astype(jnp.float32)


def with_router_loss(sums, stats: moe.RouterStats, loss: moe.RouterLoss,
                     segment_ids=None) -> RouterSums:
    """`sums` with the router terms of one forward pass's `stats` (stacked over layers);
    `segment_ids` (or a 0/1 mask, `fed_tokens`): the tokens the aux loss counts (> 0)."""
    L, N, _ = stats.logits.shape
    mask = None if segment_ids is None else (segment_ids.reshape(N) > 0)
    metrics = moe.load_metrics([jax.tree.map(lambda x, i=i: x[i], stats) for i in range(L)],
                               loss.top_k, mask)
    count = jax.lax.stop_gradient(sums.count).astype(jnp.float32)
    aux, z = metrics["moe_aux_loss"], metrics["moe_z_loss"]
    return RouterSums(sums, (loss.aux_coef * aux + loss.z_coef * z) * count, aux * count,
                      z * count, stats.load.astype(jnp.float32),
                      jnp.sum(stats.dropped).astype(jnp.float32))
