"""Preference objectives (DPO, SimPO, ORPO) as pure functions of sequence log-probabilities.

A preference batch (easylm/data/pairs.py) holds pair i in row i of chosen_* and of
rejected_* (B, T): input_tokens, target_tokens, and loss_masks on the response tokens
only; with a precomputed reference also reference_chosen_logps, reference_rejected_logps
(B,). The steps:

  per-sequence summed log-probabilities of the response tokens: `sequence_logps` from
      logits, `chunked_sequence_logps` from hidden states without the (B, T, V) logits;
  an objective (`OBJECTIVES`): (policy, reference or None, lengths, config) ->
      (per-pair losses (B,), per-pair rewards, extra per-pair metrics);
  `preference_sums`: sums over the pairs that have tokens on both sides.

`make_loss_fn` composes them into the trainer's `(params, batch, rng) -> sums`. Like
LossSums these are sums, so micro-batches and hosts add up exactly; the step divides by
`pairs` once after adding them (a mean over pairs), where the language-model loss divides
by tokens. `PreferenceObjective` and its subclasses `DPO`, `SimPO`, `ORPO` are the
trainer's `Objective`s (objectives/base.py) for them: flags, checks, the loss, the
reference, the work per step. Formulas, papers and metrics: docs/preference.md.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from etils import epath
from ml_collections import ConfigDict

from easylm.data import DatasetFactory
from easylm.errors import UserError
from easylm.models import vision
from easylm.objectives.base import BASE, COPY, NO_REFERENCE, PRECOMPUTED, Objective
from easylm.objectives.next_token import chunked_next_token_loss, next_token_loss
from easylm.objectives.reference_table import (
    REFERENCE_FILE,
    REFERENCE_KEYS,
    ROW_KEYS,
    ReferenceTable,
    compute,
)
from easylm.objectives.router_loss import fed_tokens, with_router_loss


class Pair(NamedTuple):
    chosen: jax.Array  # (B,)
    rejected: jax.Array  # (B,)


class PreferenceSums(NamedTuple):
    loss: jax.Array  # sum over pairs of each pair's loss, fp32 scalar
    pairs: jax.Array  # pairs counted: the denominator of every entry
    metrics: dict  # name -> sum over pairs (rewards/chosen, ...)

    COUNT = "pairs"  # the trainer's generic denominator (losses.LossSums counts tokens)
    PART = "preference_loss"  # the DPO/SimPO/ORPO loss, logged beside a total `loss`

    @property
    def count(self):
        return self.pairs

    def means(self) -> dict:
        """What a log step shows: every sum divided by the pairs counted."""
        pairs = jnp.maximum(self.pairs, 1.0)
        return {"loss": self.loss / pairs, **{k: v / pairs for k, v in self.metrics.items()}}


HELP = {
    "dpo.beta": "DPO's beta: the strength of the implicit KL penalty against the reference",
    "dpo.label_smoothing": "DPO's label smoothing: the assumed share of flipped labels "
                           "(conservative DPO); 0 is the paper's loss",
    "dpo.precompute_reference": "before training, one pass over the train and eval pairs "
                                "stores the reference's log-probabilities in RUN_DIR/"
                                "reference_logps.npz, so that training holds one model "
                                "(False: a frozen copy of the starting parameters)",
    "simpo.beta": "SimPO's beta: the scale of the length-normalised reward",
    "simpo.gamma": "SimPO's gamma: the target reward margin between chosen and rejected",
    "orpo.lambda": "ORPO's lambda: the weight of the odds-ratio term beside the NLL of chosen",
}


def get_default_config(updates=None) -> ConfigDict:
    """Each objective's options; the defaults are the papers' usual values."""
    config = ConfigDict()
    config.dpo = ConfigDict(dict(beta=0.1, label_smoothing=0.0, precompute_reference=False))
    config.simpo = ConfigDict(dict(beta=2.0, gamma=1.0))
    config.orpo = ConfigDict({"lambda": 0.1})
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


# -------------------------------------------------------------- log-probabilities


def sequence_logps(logits, target_tokens, loss_masks):
    """(sum of log p(target) over each row's masked tokens (N,), their count (N,)), fp32.
    logits (N, T, V). The row-wise next_token_loss: the same numbers as the LM loss."""
    sums = jax.vmap(lambda l, t, m: next_token_loss(l[None], t[None], m[None]))(
        logits, target_tokens, loss_masks)
    return -sums.loss, sums.tokens


def chunked_sequence_logps(hidden, head_weight, target_tokens, loss_masks, chunk_size):
    """`sequence_logps(hidden @ head_weight, ...)` with at most (1, chunk_size, V) logits
    per row live (chunked_next_token_loss, row by row). hidden (N, T, D)."""
    sums = jax.vmap(lambda h, t, m: chunked_next_token_loss(
        h[None], head_weight, t[None], m[None], chunk_size))(hidden, target_tokens, loss_masks)
    return -sums.loss, sums.tokens


# -------------------------------------------------------------- the objectives


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below (Maechler 2012)."""
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def dpo(policy: Pair, reference: Pair, lengths: Pair, config):
    """Rafailov et al. 2023, with label smoothing eps (Mitchell 2023, conservative DPO):
    h = beta * ((pi_c - ref_c) - (pi_r - ref_r)), loss = -(1-eps) log s(h) - eps log s(-h)."""
    del lengths
    rewards = Pair(config.beta * (policy.chosen - reference.chosen),
                   config.beta * (policy.rejected - reference.rejected))
    h = rewards.chosen - rewards.rejected
    eps = config.label_smoothing
    losses = -(1 - eps) * jax.nn.log_sigmoid(h) - eps * jax.nn.log_sigmoid(-h)
    return losses, rewards, {}


def simpo(policy: Pair, reference, lengths: Pair, config):
    """Meng et al. 2024: rewards beta * (mean log-prob per response token), no reference;
    loss = -log s(r_c - r_r - gamma)."""
    del reference
    rewards = Pair(config.beta * policy.chosen / lengths.chosen,
                   config.beta * policy.rejected / lengths.rejected)
    losses = -jax.nn.log_sigmoid(rewards.chosen - rewards.rejected - config.gamma)
    return losses, rewards, {}


def orpo(policy: Pair, reference, lengths: Pair, config):
    """Hong et al. 2024: with P = exp(mean log-prob per token) and odds = P / (1 - P),
    loss = NLL(chosen) - lambda * log s(log odds_c - log odds_r); the NLL is the mean over
    the chosen response's tokens. Rewards are lambda * mean log-prob (as TRL logs them)."""
    del reference
    lam = config["lambda"]
    mean = Pair(policy.chosen / lengths.chosen, policy.rejected / lengths.rejected)
    log_odds = (mean.chosen - mean.rejected) - (_log1mexp(mean.chosen) - _log1mexp(mean.rejected))
    nll = -mean.chosen
    losses = nll - lam * jax.nn.log_sigmoid(log_odds)
    return losses, Pair(lam * mean.chosen, lam * mean.rejected), {
        "nll": nll, "log_odds_ratio": log_odds}


OBJECTIVES: dict[str, Callable] = {"dpo": dpo, "simpo": simpo, "orpo": orpo}
NEEDS_REFERENCE = ("dpo",)


def preference_sums(objective: str, policy: Pair, reference: Pair | None, lengths: Pair,
                    config) -> PreferenceSums:
    """The objective's sums over pairs. A pair without tokens on both sides (the padding
    of an eval batch) counts nowhere, its inputs replaced so no NaN reaches a gradient."""
    valid = (lengths.chosen > 0) & (lengths.rejected > 0)
    weight = valid.astype(jnp.float32)

    def safe(pair, fill):
        return Pair(*(jnp.where(valid, x, fill) for x in pair))

    policy, lengths = safe(policy, -1.0), safe(lengths, 1.0)
    reference = None if reference is None else safe(reference, -1.0)
    losses, rewards, extra = OBJECTIVES[objective](policy, reference, lengths,
                                                   config[objective])
    # A tie counts one half: rewards that are all 0 (a policy against an identical
    # reference) give accuracy 0.5, not 0.
    correct = (rewards.chosen > rewards.rejected) + 0.5 * (rewards.chosen == rewards.rejected)
    metrics = {
        "rewards/chosen": rewards.chosen, "rewards/rejected": rewards.rejected,
        "rewards/margin": rewards.chosen - rewards.rejected, "rewards/accuracy": correct,
        "logps/chosen": policy.chosen, "logps/rejected": policy.rejected, **extra}
    return PreferenceSums(loss=jnp.sum(losses * weight), pairs=jnp.sum(weight),
                          metrics={k: jnp.sum(v * weight) for k, v in metrics.items()})


def row_logps(model, params, rows: dict, base=None, rng=None, router_stats=False):
    """(summed log-probabilities of each row's masked targets (N,), their count (N,)) under
    `model` (its forward pass and head; `base`: a variant's frozen parameters), one sequence
    per row, not packed; with the model's `loss_chunk_size` never the (N, T, V) logits.
    `positions` (N, T), where rows has them: the places of tokens in another order (zig-zag
    under sp, training/step.py); an image pair's rows carry their image inputs. `router_stats` (a mixture of experts): the forward's
    `moe.RouterStats` third."""
    out = model.forward(params, rows["input_tokens"], rows.get("positions"), base=base, rng=rng,
                        return_hidden=bool(model.loss_chunk_size), router_stats=router_stats,
                        images=vision.image_inputs_of(rows))
    if not model.loss_chunk_size:
        logps = sequence_logps(out.logits, rows["target_tokens"], rows["loss_masks"])
    else:
        logps = chunked_sequence_logps(out.hidden, model.head(params, base),
                                       rows["target_tokens"], rows["loss_masks"],
                                       model.loss_chunk_size)
    return logps if out.router_stats is None else (*logps, out.router_stats)


# -------------------------------------------------------------- the trainer's loss_fn


def pair_rows(batch) -> dict:
    """chosen_* and rejected_* (B, T) -> rows (2B, T), pair i in rows 2i (chosen) and
    2i+1 (rejected): one forward pass for both, and a (B, 2, T) reshape keeps a pair on
    the device that holds its batch row. Positions and image inputs too, where the batch
    has them (all (B, ...) arrays whose rows go together: images of pair i in rows 2i and
    2i+1)."""
    keys = ROW_KEYS + tuple(k for k in ("positions", *vision.IMAGE_KEYS)
                            if f"chosen_{k}" in batch)
    return {k: jnp.stack([batch[f"chosen_{k}"], batch[f"rejected_{k}"]], axis=1)
            .reshape(-1, *batch[f"chosen_{k}"].shape[1:]) for k in keys}


def _as_pair(x) -> Pair:  # (2B,) interleaved -> Pair of (B,)
    return Pair(*x.reshape(-1, 2).T)


def make_loss_fn(objective: str, config, row_logps: Callable, reference: Callable | None = None,
                 router_loss=None):
    """The trainer-style `loss_fn(params, batch, rng) -> PreferenceSums` (with a `router_loss`,
    a mixture of experts', `router_loss.RouterSums` around them: row_logps then returns the
    forward's `moe.RouterStats` third, and the loss adds the router terms per pair).

    row_logps(params, rows) -> (logps (N,), lengths (N,)) for rows of input_tokens,
    target_tokens, loss_masks (N, T): e.g. sequence_logps of the model's logits.
    reference: for DPO, the same kind of function giving the reference model's logps
    (LoRA: the base with adapters off; a frozen copy); None reads them precomputed from
    the batch (REFERENCE_KEYS, see `reference_logps`). The reference gets no gradient.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown preference objective {objective!r}; expected "
                         f"{', '.join(OBJECTIVES)}")
    config = get_default_config(config)

    def loss_fn(params, batch, rng) -> PreferenceSums:
        del rng  # row_logps binds its own (adapter dropout)
        stored = objective in NEEDS_REFERENCE and reference is None
        missing = [k for k in REFERENCE_KEYS if k not in batch] if stored else []
        if missing:
            raise ValueError(f"{objective} needs a reference: pass `reference`, or batches "
                             f"with {', '.join(missing)}")
        rows = pair_rows(batch)
        # A live reference is the policy's own computation: at step 1 (the same weights)
        # every reward must be exactly 0. Differentiated, the policy's forward keeps what
        # its backward reads, and XLA fuses it otherwise than the reference's (rewards of
        # 1e-7, step-1 accuracies of 0.56 in a trainer step); rematerialised, its forward
        # saves nothing and is compiled as the reference's is. It costs a second forward
        # of the policy in the backward pass (docs/preference.md).
        live = objective in NEEDS_REFERENCE and not stored
        logps, lengths, *stats = (jax.checkpoint(row_logps) if live else row_logps)(params, rows)
        ref = None
        if stored:
            ref = Pair(*(batch[k] for k in REFERENCE_KEYS))
        elif objective in NEEDS_REFERENCE:
            ref = _as_pair(jax.lax.stop_gradient(reference(params, rows)[0]))
        sums = preference_sums(objective, _as_pair(logps), ref, _as_pair(lengths), config)
        if router_loss is None:
            return sums
        return with_router_loss(sums, stats[0], router_loss, fed_tokens(rows["loss_masks"]))

    return loss_fn


def reference_logps(row_logps: Callable, params, batch) -> dict:
    """REFERENCE_KEYS -> (B,) arrays: the reference's logps of a batch, to store with it
    so that training holds one model (what make_loss_fn reads when reference=None)."""
    logps, _ = row_logps(params, pair_rows(batch))
    return dict(zip(REFERENCE_KEYS, _as_pair(logps)))


# -------------------------------------------------------------- the trainer's objective


def check_options(objective: str, options) -> None:
    for name, ok, expected in (("beta", lambda x: x > 0, "> 0"),
                               ("label_smoothing", lambda x: 0 <= x < 0.5, "in [0, 0.5)"),
                               ("gamma", lambda x: x >= 0, ">= 0"),
                               ("lambda", lambda x: x >= 0, ">= 0")):
        if name in options and not ok(options[name]):
            raise UserError(f"--{objective}.{name} must be {expected}, got {options[name]}")


class PreferenceObjective(Objective):
    """A preference objective on batches of pairs: DPO, SimPO or ORPO (the subclasses
    below), its options the block --NAME.* and its loss `OBJECTIVES[NAME]`."""

    rows = "pairs"
    takes_images = True  # image pairs' rows carry their image inputs (pair_rows)
    rows_per_example = 2  # a pair is a chosen and a rejected row

    @classmethod
    def get_default_config(cls) -> ConfigDict:
        return get_default_config()[cls.name]

    @classmethod
    def check_config(cls, config) -> None:
        check_options(cls.name, config[cls.name])
        data = config.train_dataset
        if data.type == "json" and data.json_dataset.path == "embedded":
            raise UserError(f"--objective={cls.name} trains on preference pairs: set "
                            f"--train_dataset.json_dataset.path to JSON lines with prompt, "
                            f"chosen and rejected (docs/preference.md)")

    @classmethod
    def dataset_defaults(cls, config) -> dict:
        """Its rows are pairs: the datasets read them."""
        return {f"{section}.preference.enabled": True
                for section in ("train_dataset", "eval_dataset")}

    def __init__(self, model, config, tokenizer):
        super().__init__(model, config, tokenizer)
        self.options = get_default_config({self.name: config[self.name].to_dict()})
        self.reference = self._reference()
        self._table = None

    def _reference(self) -> str:
        """What its loss compares the policy with (base.py): nothing, but for DPO."""
        return NO_REFERENCE

    def _reference_logps(self, frozen: dict) -> Callable:
        """(params, rows) -> the reference's (logps, lengths): the base under the policy's
        adapters turned off, or the frozen copy."""
        model, base = self.model, frozen.get("base")
        if model.frozen is not None:
            return lambda params, rows: row_logps(model, model.frozen.adapters_off(params),
                                                  rows, base)
        return lambda _, rows: row_logps(model, frozen["reference"], rows)

    def loss_fn(self, params, batch, rng, frozen):
        base = frozen.get("base")
        live = self.reference in (BASE, COPY)
        reference = self._reference_logps(frozen) if live else None
        router_loss = self.model.router_loss  # a mixture of experts: its router terms too
        policy = lambda p, rows: row_logps(self.model, p, rows, base, rng,  # noqa: E731
                                           router_loss is not None)
        return make_loss_fn(self.name, self.options, policy, reference, router_loss)(
            params, batch, rng)

    def describe(self) -> str:
        reference = {BASE: " (live reference: the base, adapters off)",
                     COPY: " (live reference)", PRECOMPUTED: " (precomputed reference)",
                     NO_REFERENCE: ""}[self.reference]
        return f" | objective {self.name}{reference}"

    def plan_rows(self) -> str:
        return " pairs x 2"

    def flops_per_token(self, seq_length: int) -> float:
        """The policy's forward and backward passes (6N; LoRA's skip the base's weight
        gradients), and a live reference's forward pass (2N)."""
        live = self.reference in (BASE, COPY)
        reference = self.model.forward_flops(seq_length) if live else 0.0
        return self.model.flops_per_token(seq_length) + reference

    def prepare_run(self, run_dir, starting_params, state, place, print_fn) -> None:
        """With a precomputed reference: its log-probabilities of the train and eval pairs,
        read from RUN_DIR/reference_logps.npz, or computed (one pass) and written there."""
        if self.reference != PRECOMPUTED:
            return
        source = self.config.load_checkpoint or f"init(seed={self.config.seed})"
        path = f"{run_dir}/{REFERENCE_FILE}"
        if epath.Path(path).exists():
            self._table = ReferenceTable.load(path, source)
            print_fn(f"reference log-probabilities: {path} ({len(self._table)} pairs)")
            return
        print_fn(f"computing the reference log-probabilities of the train and eval pairs "
                 f"(one pass) into {path}")
        if self.model.frozen is not None:
            params, frozen = state.params, state.frozen
        else:
            params = starting_params()
            frozen = {"reference": params}
        sections = ("train_dataset", "eval_dataset") if self.config.eval_freq else \
            ("train_dataset",)
        datasets = (DatasetFactory.load_dataset(self.config[section], self.tokenizer,
                                                for_eval=True, pairs=True, section=section,
                                                images=self.images)
                    for section in sections)
        reference = self._reference_logps(frozen)
        self._table = compute(lambda p, batch: reference_logps(reference, p, batch), params,
                              datasets, place, path)
        if jax.process_index() == 0:
            self._table.save(source)
        print_fn(f"reference log-probabilities: {len(self._table)} pairs")

    def prepare(self, batch: dict) -> dict:
        """With a precomputed reference, the batch's pairs' (b,) log-probabilities added."""
        return batch if self._table is None else dict(batch, **self._table.lookup(batch))


def _help(name: str) -> dict:
    return {k: v for k, v in HELP.items() if k.startswith(f"{name}.")}


class DPO(PreferenceObjective):
    """DPO's reference is the base with the adapters off under LoRA, else a frozen copy of
    the starting parameters, or (with --dpo.precompute_reference) log-probabilities
    computed before training and carried by the batches."""

    name = "dpo"
    HELP = _help(name)

    def _reference(self) -> str:
        if self.options.dpo.precompute_reference:
            return PRECOMPUTED
        return BASE if self.model.frozen is not None else COPY


class SimPO(PreferenceObjective):
    name = "simpo"
    HELP = _help(name)


class ORPO(PreferenceObjective):
    name = "orpo"
    HELP = _help(name)
