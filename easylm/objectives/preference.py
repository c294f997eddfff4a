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
by tokens. `build_objective` is what the trainer asks for `--objective`: the loss, the
batches, the frozen reference and the work per step. Formulas, papers and metrics:
docs/preference.md.
"""

import hashlib
import io
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P
from ml_collections import ConfigDict

from easylm.errors import UserError
from easylm.objectives.next_token import chunked_next_token_loss, next_token_loss

ROW_KEYS = ("input_tokens", "target_tokens", "loss_masks")
REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")


class Pair(NamedTuple):
    chosen: jax.Array  # (B,)
    rejected: jax.Array  # (B,)


class PreferenceSums(NamedTuple):
    loss: jax.Array  # sum over pairs of each pair's loss, fp32 scalar
    pairs: jax.Array  # pairs counted: the denominator of every entry
    metrics: dict  # name -> sum over pairs (rewards/chosen, ...)

    COUNT = "pairs"  # the trainer's generic denominator (losses.LossSums counts tokens)

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


# -------------------------------------------------------------- the trainer's loss_fn


def pair_rows(batch) -> dict:
    """chosen_* and rejected_* (B, T) -> rows (2B, T), pair i in rows 2i (chosen) and
    2i+1 (rejected): one forward pass for both, and a (B, 2, T) reshape keeps a pair on
    the device that holds its batch row."""
    return {k: jnp.stack([batch[f"chosen_{k}"], batch[f"rejected_{k}"]], axis=1)
            .reshape(-1, *batch[f"chosen_{k}"].shape[1:]) for k in ROW_KEYS}


def _as_pair(x) -> Pair:  # (2B,) interleaved -> Pair of (B,)
    return Pair(*x.reshape(-1, 2).T)


def make_loss_fn(objective: str, config, row_logps: Callable, reference: Callable | None = None):
    """The trainer-style `loss_fn(params, batch, rng) -> PreferenceSums`.

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
        logps, lengths = row_logps(params, rows)
        ref = None
        if stored:
            ref = Pair(*(batch[k] for k in REFERENCE_KEYS))
        elif objective in NEEDS_REFERENCE:
            ref = _as_pair(jax.lax.stop_gradient(reference(params, rows)[0]))
        return preference_sums(objective, _as_pair(logps), ref, _as_pair(lengths), config)

    return loss_fn


def reference_logps(row_logps: Callable, params, batch) -> dict:
    """REFERENCE_KEYS -> (B,) arrays: the reference's logps of a batch, to store with it
    so that training holds one model (what make_loss_fn reads when reference=None)."""
    logps, _ = row_logps(params, pair_rows(batch))
    return dict(zip(REFERENCE_KEYS, _as_pair(logps)))


# -------------------------------------------------------------- the trainer's objective

NEXT_TOKEN = "next_token"
OBJECTIVE_HELP = ("what to train: next_token (language modelling on text), or on preference "
                  "pairs dpo, simpo or orpo (docs/preference.md)")
REFERENCE_FILE = "reference_logps.npz"
_SECTIONS = ("train_dataset", "eval_dataset")


def dataset_defaults(config) -> dict:
    """A derived default (trainer.run_defaults): a preference objective reads pairs."""
    if config.objective == NEXT_TOKEN:
        return {}
    return {f"{section}.preference.enabled": True for section in _SECTIONS}


def unused_flags(config) -> tuple:
    """Prefixes of the flags that do not change what `config` trains: the options of the
    other objectives (all of them, and --objective itself, for next-token training), left
    out of the run directory's name so that runs keep theirs."""
    if config.objective == NEXT_TOKEN:
        return ("objective", *(f"{name}." for name in OBJECTIVES))
    return tuple(f"{name}." for name in OBJECTIVES if name != config.objective)


def check_config(config) -> None:
    """--objective and the datasets agree: pairs for a preference objective, text else."""
    objective = config.objective
    if objective not in (NEXT_TOKEN, *OBJECTIVES):
        raise UserError(f"--objective={objective!r} is not one of {NEXT_TOKEN}, "
                        f"{', '.join(OBJECTIVES)}")
    for section in _SECTIONS if config.eval_freq else _SECTIONS[:1]:
        enabled = config[section].preference.enabled
        if enabled and objective == NEXT_TOKEN:
            raise UserError(f"--{section}.preference.enabled=True makes batches of preference "
                            f"pairs, which train with --objective={', '.join(OBJECTIVES)}, not "
                            f"the default --objective={NEXT_TOKEN}")
        if not enabled and objective != NEXT_TOKEN:
            raise UserError(f"--objective={objective} trains on preference pairs, but "
                            f"--{section}.preference.enabled=False")
    if objective != NEXT_TOKEN:
        options = config[objective]
        for name, ok, expected in (("beta", lambda x: x > 0, "> 0"),
                                   ("label_smoothing", lambda x: 0 <= x < 0.5, "in [0, 0.5)"),
                                   ("gamma", lambda x: x >= 0, ">= 0"),
                                   ("lambda", lambda x: x >= 0, ">= 0")):
            if name in options and not ok(options[name]):
                raise UserError(f"--{objective}.{name} must be {expected}, got {options[name]}")
    data = config.train_dataset
    if objective != NEXT_TOKEN and data.type == "json" and data.json_dataset.path == "embedded":
        raise UserError(f"--objective={objective} trains on preference pairs: set "
                        f"--train_dataset.json_dataset.path to JSON lines with prompt, chosen "
                        f"and rejected (docs/preference.md)")


def build_objective(config, model, tokenizer) -> "Objective":
    return Objective(config, model, tokenizer)


class Objective:
    """What the trainer asks of `--objective`: the loss of a step (`loss_fn(params, batch,
    rng, *frozen)`), whether batches are pairs, the arrays the step takes beside the state
    (`frozen`: a frozen reference model), the work of a step, and what a host batch gets
    before it is placed (`prepare`: precomputed reference log-probabilities)."""

    def __init__(self, config, model, tokenizer):
        self.name = config.objective
        self.pairs = self.name != NEXT_TOKEN
        self.rows_per_example = 2 if self.pairs else 1   # a pair is a chosen and a rejected row
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.options = get_default_config({name: config[name].to_dict() for name in OBJECTIVES})
        needs_reference = self.name in NEEDS_REFERENCE
        self.precompute = needs_reference and self.options.dpo.precompute_reference
        self.live_reference = needs_reference and not self.precompute
        self.loss_fn = self._preference_loss if self.pairs else model.loss_fn
        self._table = None
        # LoRA: the reference is the base with the adapters off, no second copy of it.
        self.reference_is_base = model.adapters_off is not None
        if self.pairs and model.row_logps is None:
            raise UserError(f"the {model.name} model has no per-sequence log-probabilities, "
                            f"which --objective={self.name} trains on")
        if needs_reference and model.init_frozen is not None and not self.reference_is_base:
            raise UserError(f"--objective={self.name} cannot train this {model.name} model: "
                            f"it has frozen parameters but no way to turn its own off for "
                            f"the reference")

    def _reference(self, frozen) -> Callable:
        """(params, rows) -> the reference's (logps, lengths): the base under the policy's
        adapters turned off (`frozen`: the base), or the live copy `frozen[0]`."""
        row_logps, adapters_off = self.model.row_logps, self.model.adapters_off
        if self.reference_is_base:
            return lambda params, rows: row_logps(adapters_off(params), rows, frozen=frozen)
        (reference_params,) = frozen
        return lambda _, rows: row_logps(reference_params, rows)

    def _preference_loss(self, params, batch, rng, *extra, frozen=None):
        """extra: a live copy's parameters (a jit argument); frozen: the model's own frozen
        parameters (TrainState.frozen: LoRA's base)."""
        reference = None
        if self.live_reference:
            reference = self._reference(frozen if self.reference_is_base else extra)
        policy = lambda p, rows: self.model.row_logps(p, rows, frozen=frozen, rng=rng)  # noqa: E731
        return make_loss_fn(self.name, self.options, policy, reference)(params, batch, rng)

    def describe(self) -> str:
        """For the run's header line: '' for next-token training."""
        if not self.pairs:
            return ""
        reference = (" (live reference: the base, adapters off)"
                     if self.live_reference and self.reference_is_base else
                     " (live reference)" if self.live_reference else
                     " (precomputed reference)" if self.precompute else "")
        return f" | objective {self.name}{reference}"

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: the policy's forward and backward passes (6N; LoRA's
        skip the base's weight gradients), and a live reference's forward pass (2N)."""
        reference = self.model.forward_flops(seq_length) if self.live_reference else 0.0
        return self.model.flops_per_token(seq_length) + reference

    def frozen(self, run_dir: str, starting_params: Callable, place: Callable,
               print_fn: Callable, state=None) -> tuple:
        """Once per run, before the first step: the reference's parameters for a live
        copy (starting_params(): the run's starting point, also after a resume), or ()
        for the base with adapters off (of `state`, the train state) and after loading or
        computing the precomputed reference log-probabilities."""
        if self.live_reference:
            return () if self.reference_is_base else (starting_params(),)
        if self.precompute:
            source = self.config.load_checkpoint or f"init(seed={self.config.seed})"
            path = f"{run_dir}/{REFERENCE_FILE}"
            if epath.Path(path).exists():
                self._table = ReferenceTable.load(path, source)
                print_fn(f"reference log-probabilities: {path} ({len(self._table)} pairs)")
            else:
                print_fn(f"computing the reference log-probabilities of the train and eval "
                         f"pairs (one pass) into {path}")
                if self.reference_is_base:
                    reference, params = self._reference(state.frozen), state.params
                else:
                    params = starting_params()
                    reference = self._reference((params,))
                self._table = self._precompute(reference, params, place, path)
                if jax.process_index() == 0:
                    self._table.save(source)
                print_fn(f"reference log-probabilities: {len(self._table)} pairs")
        return ()

    def _precompute(self, reference: Callable, params, place, path) -> "ReferenceTable":
        """One pass over every pair of the train (and eval) data, in source order: the
        log-probabilities by pair of `reference(params, rows)`. Every process gets all."""
        from easylm.data import DatasetFactory

        mesh = jax.sharding.get_abstract_mesh()
        logps = jax.jit(lambda p, b: reference_logps(reference, p, b),
                        out_shardings=NamedSharding(mesh, P()))
        sections = _SECTIONS if self.config.eval_freq else _SECTIONS[:1]
        keys, values = [], []
        for section in sections:
            dataset = DatasetFactory.load_dataset(self.config[section], self.tokenizer,
                                                  for_eval=True, pairs=True)
            try:
                for batch, _ in dataset.iterate():
                    out = jax.device_get(logps(params, place(batch)))   # (B,) each
                    local = np.stack([pair_keys(batch), has_pair(batch)], 1)
                    gathered = _gather_rows(local.view(np.uint32)).view(np.uint64)
                    rows = gathered[:, 1] > 0   # padding rows at the end of the pass
                    keys.append(gathered[rows, 0])
                    values.append(np.stack([out[k] for k in REFERENCE_KEYS], 1)[rows])
            finally:
                dataset.close()
        return ReferenceTable(np.concatenate(keys), np.concatenate(values), path)

    def prepare(self, batch: dict) -> dict:
        """A host batch as the step takes it: with precomputed reference log-probabilities,
        its pairs' (b,) ones added."""
        return batch if self._table is None else dict(batch, **self._table.lookup(batch))


def pair_keys(batch) -> np.ndarray:
    """(b,) uint64: a hash of each pair's rows (both sides' tokens and masks), so that a
    pair's reference log-probabilities are found whatever its slot, epoch or host."""
    arrays = [np.ascontiguousarray(batch[f"{side}_{k}"]) for side in ("chosen", "rejected")
              for k in ROW_KEYS]
    keys = np.empty(len(arrays[0]), np.uint64)
    for r in range(len(keys)):
        digest = hashlib.blake2b(digest_size=8)
        for array in arrays:
            digest.update(array[r].tobytes())
        keys[r] = int.from_bytes(digest.digest(), "little")
    return keys


def has_pair(batch) -> np.ndarray:
    """(b,) uint64 1 where the row holds a pair, 0 for a padding row."""
    return ((batch["chosen_loss_masks"].sum(1) > 0) &
            (batch["rejected_loss_masks"].sum(1) > 0)).astype(np.uint64)


def _gather_rows(local: np.ndarray) -> np.ndarray:
    """This process's rows -> every process's, in global row order."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


class ReferenceTable:
    """Reference log-probabilities of pairs by `pair_keys`: keys (n,) uint64, values
    (n, 2) float32 (chosen, rejected). Stored as .npz (no pickle) with the reference it
    came from (--load_checkpoint, or the seed of the initialisation)."""

    def __init__(self, keys, values, path):
        keys, first = np.unique(keys, return_index=True)   # sorted; a repeated pair once
        self.keys, self.values = keys, np.asarray(values, np.float32)[first]
        self.path = path   # where it is stored, for the messages

    def __len__(self):
        return len(self.keys)

    def lookup(self, batch) -> dict:
        keys = pair_keys(batch)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        found = self.keys[at] == keys
        missing = ~found & (has_pair(batch) > 0)
        if missing.any():
            raise UserError(f"{missing.sum()} pair(s) of a batch have no precomputed reference "
                            f"log-probabilities in {self.path}: the data changed since they "
                            f"were computed; delete that file to compute them again")
        values = np.where(found[:, None], self.values[at], 0.0).astype(np.float32)
        return dict(zip(REFERENCE_KEYS, values.T))

    def save(self, source: str) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, keys=self.keys, values=self.values, source=np.array(source))
        path = epath.Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / (path.name + ".tmp")   # a killed save leaves no half file
        tmp.write_bytes(buffer.getvalue())
        tmp.rename(path)

    @classmethod
    def load(cls, path: str, source: str) -> "ReferenceTable":
        try:
            with np.load(io.BytesIO(epath.Path(path).read_bytes()), allow_pickle=False) as f:
                keys, values, stored = f["keys"], f["values"], str(f["source"])
        except (OSError, ValueError, KeyError):
            raise UserError(f"{path} is not the .npz of reference log-probabilities this "
                            f"command writes (keys, values, source); delete it to compute "
                            f"them again") from None
        if stored != source:
            raise UserError(f"{path} holds the log-probabilities of the reference {stored}, "
                            f"but this run's reference is {source}; delete it to compute "
                            f"them again")
        return cls(keys, values, path)
