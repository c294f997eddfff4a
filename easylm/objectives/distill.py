"""On-policy distillation (`--objective=distill`): the student learns a frozen teacher's
next-token distributions on the student's own samples, TRL's GKDTrainer (Agarwal et al.
2024, "On-Policy Distillation of Language Models"); formulas, options and numbers in
docs/rl.md.

The teacher (`--distill.teacher=hf::DIR|params::PATH`) is any registered family whose
vocabulary is the student's: read once per run, frozen in `TrainState.frozen["teacher"]`,
sharded by its own partition rules on the trainer's mesh, in its own dtype
(`--distill.teacher_dtype`). Each step's batch is B prompts from the data pipeline, each
with one completion: at a step drawn on-policy (probability lmbda, a coin from the seed
and the step) the student's sample from the serving engine on the live parameters (as
GRPO's rollouts), otherwise the dataset's `completion` field. The loss is the
generalized Jensen-Shannon divergence between the two models' distributions at every
completion token, averaged over completion tokens (TRL's `generalized_jsd_loss`,
reduction batchmean over the unmasked tokens). With the student's `loss_chunk_size` both
models' logits are made a chunk of positions at a time (chunked_logps.map_chunks): at
most (N, chunk, V) logits of each model live, forward and backward.

Shape letters: N rows (one prompt, one completion), T positions, V vocabulary.
"""

import dataclasses
import math
import time
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm import model_flags
from easylm.data.options import loader_block
from easylm.errors import UserError
from easylm.models import registry
from easylm.models.family import abstract_params, load_params
from easylm.objectives.base import Objective
from easylm.objectives.chunked_logps import map_chunks
from easylm.objectives.next_token import head_logits
from easylm.objectives.rollouts import (
    gather_prompts,
    generate,
    sampling_keys,
    token_rows,
)
from easylm.objectives.router_loss import fed_tokens, with_router_loss
from easylm.runtime.checkpoint import absolute_path
from easylm.runtime.dtypes import dtype_from_flag
from easylm.serving import engine as engine_lib

TEACHER_PREFIXES = ("hf", "params")
_TRAIN, _EVAL, _COIN = 2, 3, 4  # salts of the sampling keys and of the on-policy coin

HELP = {
    "distill.teacher": "the frozen teacher: hf::DIR (a Hugging Face directory) or "
                       "params::PATH (an easylm checkpoint), of any family whose vocabulary "
                       "is the student's",
    "distill.teacher_dtype": "the teacher's parameters and compute: '' (the run's --dtype "
                             "and --param_dtype), bf16 or fp32",
    "distill.lmbda": "the share of steps that train on the student's own samples (TRL's "
                     "lmbda; a coin per step from --seed); the others on the dataset's "
                     "`completion` field",
    "distill.beta": "the generalized JSD's interpolation (TRL's beta): 0 the forward KL "
                    "KL(teacher || student), 1 the reverse KL KL(student || teacher)",
    "distill.temperature": "sampling temperature of the student's samples (TRL's); the loss "
                           "compares the distributions at temperature 1, as TRL's does",
    "distill.max_new_tokens": "the longest completion, sampled or from the dataset, in "
                              "tokens (TRL's max_new_tokens)",
}


def get_default_config(updates=None) -> ConfigDict:
    """TRL's GKDConfig defaults where the option is the same."""
    config = ConfigDict({"teacher": "", "teacher_dtype": "", "lmbda": 0.5, "beta": 0.5,
                         "temperature": 0.9, "max_new_tokens": 128})
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


# -------------------------------------------------------------- the loss (device)


def token_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """(N, T) the generalized JSD of each position's two distributions, summed over the
    vocabulary, in fp32: beta 0 is KL(teacher || student), 1 KL(student || teacher), in
    between beta KL(teacher || m) + (1 - beta) KL(student || m) with m = beta teacher +
    (1 - beta) student. logits (N, T, V); the teacher's get no gradient."""
    return _token_jsd(student_logits, teacher_logits, float(beta), float(temperature))


def _log_probs(student_logits, teacher_logits, beta, temperature):
    """(student's, teacher's, the divergence's other side) log-probabilities, fp32."""
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    if beta == 0 or beta == 1:
        return s, t, t
    return s, t, jnp.logaddexp(s + math.log1p(-beta), t + math.log(beta))


def _kl(p, q):  # KL(p || q) of log-probabilities over the last axis
    return jnp.sum(jnp.exp(p) * (p - q), axis=-1)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _token_jsd(student_logits, teacher_logits, beta, temperature):
    s, t, m = _log_probs(student_logits, teacher_logits, beta, temperature)
    if beta == 0:
        return _kl(t, s)
    if beta == 1:
        return _kl(s, t)
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m)


def _token_jsd_fwd(student_logits, teacher_logits, beta, temperature):
    return _token_jsd(student_logits, teacher_logits, beta, temperature), \
        (student_logits, teacher_logits)


def _token_jsd_bwd(beta, temperature, residuals, g):
    """The gradient in the student's logits in closed form, one elementwise pass over
    (N, T, V): autodiff kept ~5 such fp32 buffers live per chunk (the log-softmaxes, the
    mixture, their exponentials), 1.7x GRPO's step at a 152k vocabulary. With p = e^s and
    d the log-ratio of the divergence's student side, the gradient in s is (1 - beta) p d
    (beta < 1; the mixture's own terms cancel, since beta e^t + (1 - beta) e^s = e^m),
    and through the log-softmax p (d - KL); beta 0: p - e^t."""
    student_logits, teacher_logits = residuals
    s, t, m = _log_probs(student_logits, teacher_logits, beta, temperature)
    p = jnp.exp(s)
    if beta == 0:
        grad = p - jnp.exp(t)
    else:
        d = s - m
        grad = (1 - beta if beta < 1 else 1.0) * p * (d - jnp.sum(p * d, axis=-1, keepdims=True))
    grad = grad * (g / temperature)[..., None]
    return grad.astype(student_logits.dtype), jnp.zeros_like(teacher_logits)


_token_jsd.defvjp(_token_jsd_fwd, _token_jsd_bwd)


def chunked_token_jsd(hidden, head, teacher_hidden, teacher_head, beta: float,
                      chunk_size: int, temperature: float = 1.0):
    """`token_jsd` of the logits hidden @ head and teacher_hidden @ teacher_head with at
    most (N, chunk_size, V) logits of each live; the teacher's get no gradient. hidden
    (N, T, D), teacher_hidden (N, T, Dt), head (D, V), teacher_head (Dt, V)."""
    teacher_head = jax.lax.stop_gradient(teacher_head)
    return map_chunks(
        lambda logits, h: token_jsd(logits, head_logits(h, teacher_head), beta, temperature),
        hidden, head, (jax.lax.stop_gradient(teacher_hidden),), chunk_size)


class DistillSums(NamedTuple):
    loss: jax.Array  # sum over completion tokens of the generalized JSD, fp32 scalar
    tokens: jax.Array  # completion tokens counted

    COUNT = "tokens"
    PART = "distill_loss"  # logged under this name beside a total `loss` (a MoE student)

    @property
    def count(self):
        return self.tokens

    def means(self) -> dict:
        return {"loss": self.loss / jnp.maximum(self.tokens, 1.0)}


# -------------------------------------------------------------- the teacher


@dataclasses.dataclass(frozen=True)
class Teacher:
    spec: str
    model: object  # a family's Model
    load: Callable  # mesh -> its parameters in their shards


def teacher(spec: str, dtype_flag: str, run_dtype, run_param_dtype, vocab_size: int) -> Teacher:
    """The teacher --distill.teacher names, its config read and checked against the
    student's vocabulary; its parameters read later (`load`)."""
    prefix, sep, path = spec.partition("::")
    if not sep or prefix not in TEACHER_PREFIXES or not path:
        raise UserError(f"--distill.teacher={spec!r}: expected hf::DIR or params::PATH")
    name = registry.family_of(f"{prefix}::{absolute_path(path)}")
    if name is None:
        what = "config.json" if prefix == "hf" else "metadata naming its model"
        raise UserError(f"--distill.teacher={spec}: no {what} there")
    family = registry.get(name)
    config = model_flags.recorded_config(family, f"{prefix}::{absolute_path(path)}")
    if config is None:
        raise UserError(f"--distill.teacher={spec}: its metadata records no {name} config")
    if dtype_flag:
        dtype = param_dtype = dtype_from_flag("distill.teacher_dtype", dtype_flag)
    else:
        dtype, param_dtype = run_dtype, run_param_dtype
    model = family.bind(config, dtype, param_dtype)
    if model.vocab_size != vocab_size:
        raise UserError(f"--distill.teacher={spec}: its vocabulary has {model.vocab_size} "
                        f"tokens, the student's {vocab_size}; distillation compares "
                        f"distributions over one vocabulary")

    def load(mesh):
        target = abstract_params(model, mesh, param_dtype)
        return load_params(family, f"{prefix}::{path}", config, target, model.partition_rules)

    return Teacher(spec, model, load)


# -------------------------------------------------------------- the trainer's objective


class Distill(Objective):
    """On-policy distillation from a frozen teacher (module docstring)."""

    name = "distill"
    rows = "prompts"
    HELP = HELP

    @classmethod
    def get_default_config(cls) -> ConfigDict:
        return get_default_config()

    @classmethod
    def check_config(cls, config) -> None:
        data = config.train_dataset
        if data.type == "json" and data.json_dataset.path == "embedded":
            raise UserError("--objective=distill samples from prompts: set --train_dataset."
                            "json_dataset.path to JSON lines with a prompt (and a completion "
                            "for the off-policy steps; docs/rl.md)")
        o, seq_length = config.distill, data[loader_block(data)].seq_length
        checks = (("teacher", bool(o.teacher), "hf::DIR or params::PATH"),
                  ("lmbda", 0 <= o.lmbda <= 1, "in [0, 1]"),
                  ("beta", 0 <= o.beta <= 1, "in [0, 1]"),
                  ("temperature", o.temperature > 0, "> 0"),
                  ("max_new_tokens", 1 <= o.max_new_tokens < seq_length,
                   (f">= 1 and below the row's seq_length={seq_length}, leaving room for "
                    f"a prompt")))
        for name, ok, expected in checks:
            if not ok:
                raise UserError(f"--distill.{name} must be {expected}, got {o[name]!r}")

    def __init__(self, model, config, tokenizer):
        super().__init__(model, config, tokenizer)
        self.options = o = get_default_config(config.distill.to_dict())
        self.completion_tokens = o.max_new_tokens
        if model.init_cache is None and o.lmbda > 0:
            raise UserError(f"--objective=distill: the {model.name} model has no serving "
                            f"engine to sample with (--distill.lmbda=0 trains on the "
                            f"dataset's completions only)")
        param_dtype = config.get("param_dtype", config.dtype)
        self.teacher = teacher(o.teacher, o.teacher_dtype, dtype_from_flag("dtype", config.dtype),
                               dtype_from_flag("param_dtype", param_dtype), model.vocab_size)
        self.engines = {}  # (rows, seq_length) -> Engine

    def frozen_params(self, mesh) -> dict:
        return {"teacher": self.teacher.load(mesh)}

    def loss_fn(self, params, batch, rng, frozen):
        model, teacher_model = self.model, self.teacher.model
        tokens, masks = batch["input_tokens"], batch["loss_masks"]
        positions, base = batch.get("positions"), frozen.get("base")
        chunk = model.loss_chunk_size
        out = model.forward(params, tokens, positions, base=base, rng=rng,
                            return_hidden=bool(chunk),
                            router_stats=model.router_loss is not None)
        taught = teacher_model.forward(frozen["teacher"], tokens, positions,
                                       return_hidden=bool(chunk))
        beta = self.options.beta
        if chunk:
            per_token = chunked_token_jsd(out.hidden, model.head(params, base), taught.hidden,
                                          teacher_model.head(frozen["teacher"]), beta, chunk)
        else:
            per_token = token_jsd(out.logits, jax.lax.stop_gradient(taught.logits), beta)
        sums = DistillSums(loss=jnp.sum(per_token * masks), tokens=jnp.sum(masks))
        if out.router_stats is None:
            return sums
        return with_router_loss(sums, out.router_stats, model.router_loss, fed_tokens(masks))

    def flops_per_token(self, seq_length: int) -> float:
        """The student's forward and backward passes and the teacher's forward; sampling
        is not counted (logged apart: data/rollout/seconds)."""
        return self.model.flops_per_token(seq_length) + \
            self.teacher.model.forward_flops(seq_length)

    def describe(self) -> str:
        o = self.options
        return (f" | objective distill (teacher {o.teacher}, {self.teacher.model.name}, "
                f"{self.teacher.model.num_parameters:,} parameters; beta {o.beta:g}, lmbda "
                f"{o.lmbda:g}, completions of <= {o.max_new_tokens} tokens)")

    def rollout_cache(self, batch_size: int, seq_length: int):
        if not self.options.lmbda:
            return None
        return jax.eval_shape(lambda: self.model.init_cache(batch_size, seq_length))

    # ------------------------------------------------------------ its batches

    def on_policy(self, step: int) -> bool:
        """Whether step `step` trains on the student's samples: a coin of probability
        lmbda from the seed and the step, so that a resumed run draws the same."""
        coin = np.random.default_rng([self.config.seed, _COIN, step]).random()
        return bool(coin < self.options.lmbda)

    def batches(self, dataset, place: Callable, live_state: Callable | None = None):
        """(device batch, metrics) per step. An evaluation scores the dataset's completions
        where its examples have them (the same tokens at every evaluation), else the
        student's samples."""
        evaluating = dataset.for_eval
        for index, (prompts, data_metrics) in enumerate(dataset.iterate()):
            prompts, rows_here = gather_prompts(prompts)
            state = live_state()
            step = int(state.step)
            now = time.perf_counter()
            if evaluating:
                sample = not all("completion" in e for e, n in
                                 zip(prompts["examples"], prompts["prompt_lengths"]) if n)
                where = (_EVAL, step, index)
            else:
                sample, where = self.on_policy(step), (_TRAIN, step, 0)
            batch, metrics = self.make_rows(state, prompts, dataset.seq_length, sample, where)
            metrics["rollout/seconds"] = time.perf_counter() - now
            yield place({k: v[rows_here] for k, v in batch.items()}), {**data_metrics, **metrics}

    def make_rows(self, state, prompts: dict, T: int, sample: bool, where: tuple):
        """(host batch, metrics): each prompt with its completion, sampled or the dataset's."""
        lengths = prompts["prompt_lengths"]
        pad = self.tokenizer.pad_token_id or 0
        prompt_ids = [prompts["prompt_tokens"][b, :n].tolist() if n else [pad]
                      for b, n in enumerate(lengths)]
        if sample:
            completions = self.sample(state, prompt_ids, T, where)
        else:
            completions = [self.dataset_completion(e) if n else []
                           for e, n in zip(prompts["examples"], lengths)]
        batch = token_rows(prompt_ids, completions, 1, T, pad, lengths > 0)
        real = [len(c) for c, n in zip(completions, lengths) if n]
        return batch, {"distill/on_policy": float(sample),
                       "completions/mean_length": float(np.mean(real)) if real else 0.0}

    def dataset_completion(self, example) -> list:
        text = example.get("completion")
        if not isinstance(text, str):
            raise UserError(f"--distill.lmbda={self.options.lmbda:g} trains some steps on the "
                            f"dataset's completions: an example has no text field "
                            f"'completion' (its fields: {', '.join(map(str, example))})")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.model.eos_token_id
        return (ids + ([] if eos is None else [eos]))[:self.options.max_new_tokens]

    def sample(self, state, prompt_ids: list, T: int, where: tuple) -> list:
        """The student's completion of each prompt, sampled by the serving engine on the
        live parameters (as GRPO's rollouts, rollouts.py)."""
        o, n = self.options, len(prompt_ids)
        sampling = engine_lib.Sampling.empty(n)
        sampling.keys[:] = sampling_keys(self.config.seed, *where, n)
        sampling.temperature[:], sampling.top_p[:] = o.temperature, 1.0
        key = (n, T)
        fresh = key not in self.engines
        if fresh:
            mesh = jax.tree.leaves(state.params)[0].sharding.mesh
            config = engine_lib.get_default_config({"batch_size": n, "seq_length": T,
                                                    "min_bucket": T - o.max_new_tokens})
            self.engines[key] = engine_lib.Engine(config, self.model, None, mesh)
        engine = self.engines[key]
        engine.params, engine.base = state.params, state.frozen.get("base")
        engine.reset()
        if fresh:  # every decode window now: no program at a later step
            engine.compile_decode(sampling.pad(n))
            engine.reset()
        try:
            completions, _ = generate(engine, prompt_ids, sampling, o.max_new_tokens,
                                      self.model.eos_token_id)
        finally:
            engine.params = engine.base = None  # the next train step donates these buffers
            engine.release()
        return completions
