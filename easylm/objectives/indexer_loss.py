"""The sparse attention indexers' KL loss added to an objective's sums (DeepSeek-V3.2's
report; easylm/models/sparse_attention.py computes it per layer):

    loss = objective + indexer_loss_coef * mean over layers of the mean KL a query

As the router losses (router_loss.py), the term is carried times the batch's count so
that the step's one division by the count gives the mean loss plus the term and
micro-batches add up (their count-weighted mean). Logged: `loss` the total the gradient
sees, the objective's own mean under its `PART` name (`ce_loss`) and `indexer_loss`, the
unweighted KL. The indexer's inputs are detached in the model, so the term trains only
the indexer and the objective none of it.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from easylm.objectives.router_loss import RouterSums


class IndexerSums(NamedTuple):
    sums: Any  # the objective's sums (LossSums, RouterSums, ...)
    weighted: jax.Array  # coef * mean KL * count: what the loss adds
    indexer_loss: jax.Array  # mean KL * count

    @property
    def loss(self):
        return self.sums.loss + self.weighted

    # The sums types' interface, as the router terms' wrapper gives it (router_loss.py).
    count, COUNT, PART = RouterSums.count, RouterSums.COUNT, RouterSums.PART

    def __getattr__(self, name):  # what the inner sums carry besides (RouterSums' load)
        return getattr(self.sums, name)

    def means(self) -> dict:
        count = jnp.maximum(self.count, 1.0)
        own = self.sums.means()
        kl = self.indexer_loss / count
        return {**own, "loss": own["loss"] + self.weighted / count,
                self.PART: own.get(self.PART, own["loss"]), "indexer_loss": kl}

    total_mean = RouterSums.total_mean


def with_indexer_loss(sums, kl, coef: float) -> IndexerSums:
    """`sums` with coef x the forward pass's indexer KL `kl` (the mean over layers)."""
    count = jax.lax.stop_gradient(sums.count).astype(jnp.float32)
    return IndexerSums(sums, coef * kl * count, kl * count)
