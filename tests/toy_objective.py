"""A second kind of objective, for tests only: what a new objective writes (one class in
one file), and proof that the objective boundary is real, as tests/toy_family.py proves
the family's. Nothing outside this file knows it; the trainer and the planner reach it
through `--objective=toy_objective:LabelSmoothed`.

Label-smoothed next-token prediction (Szegedy et al. 2016): the target distribution puts
1 - epsilon on the next token and epsilon spread evenly over the vocabulary, so that
    loss = (1 - epsilon) * -log p(target) + epsilon * mean over the vocabulary of -log p.
With epsilon 0 it is the next-token loss.

Shape letters: B batch, T positions, V vocabulary.
"""

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.objectives.base import Objective
from easylm.objectives.next_token import LossSums


class LabelSmoothed(Objective):
    name = "label_smoothing"  # its flags: --label_smoothing.*
    HELP = {"label_smoothing.epsilon": "the share of the target spread over the vocabulary"}

    @classmethod
    def get_default_config(cls) -> ConfigDict:
        return ConfigDict(dict(epsilon=0.1))

    @classmethod
    def check_config(cls, config) -> None:
        epsilon = config.label_smoothing.epsilon
        if not 0 <= epsilon < 1:
            raise UserError(f"--label_smoothing.epsilon must be in [0, 1), got {epsilon}")

    def __init__(self, model, config, tokenizer):
        super().__init__(model, config, tokenizer)
        if model.loss_chunk_size:  # it reads every position's whole distribution
            raise UserError(f"--objective={config.objective} reads the full logits: set "
                            f"--{model.name}.loss_chunk_size=0")
        self.epsilon = config.label_smoothing.epsilon

    def loss_fn(self, params, batch, rng, frozen):
        logits = self.model.forward(
            params, batch["input_tokens"], positions=batch.get("positions"),
            segment_ids=batch.get("segment_ids"), base=frozen.get("base"), rng=rng).logits
        logps = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (B, T, V)
        targets = batch["target_tokens"]
        target = jnp.take_along_axis(logps, targets[..., None], axis=-1)[..., 0]  # (B, T)
        losses = -(1 - self.epsilon) * target - self.epsilon * logps.mean(axis=-1)
        masks = batch["loss_masks"].astype(jnp.float32)
        correct = (jnp.argmax(logps, axis=-1) == targets).astype(jnp.float32)
        return LossSums(loss=jnp.sum(losses * masks), correct=jnp.sum(correct * masks),
                        tokens=jnp.sum(masks))

    def describe(self) -> str:
        return f" | objective label-smoothed next token (epsilon {self.epsilon:g})"

    def plan_rows(self) -> str:
        return f" documents (label smoothing {self.epsilon:g})"
