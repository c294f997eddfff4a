"""On-policy distillation (easylm/objectives/distill.py): the loss against TRL's
generalized JSD in float64, the chunked loss against the full logits, the step's memory
against GRPO's, and the command: a student distilled from a teacher pre-trained for a few
steps closes most of its held-out gap, resumes to the same numbers, and refuses a teacher
of another vocabulary in one line."""

import json
import random
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_utils import one_line_error

from easylm.llama import train as llama_train
from easylm.objectives.distill import chunked_token_jsd, token_jsd

EPS32 = float(np.finfo(np.float32).eps)


# ------------------------------------------------------------ the loss, against TRL's


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature=1.0,
                             log_space_mixture=False):
    """TRL's GKDTrainer.generalized_jsd_loss (trl/trainer/gkd_trainer.py at a9fa292,
    reduction "batchmean" with labels) in float64 numpy, transcribed from its source, not
    from distill.py. F.kl_div(input, target, reduction="none", log_target=True) is
    exp(target) * (target - input), per vocabulary entry; the mask drops labels -100 and
    batchmean divides the sum by the unmasked tokens. log_space_mixture: the negative
    twin's bug, the interpolated log-probabilities of TRL's first version (gkd_trainer.py
    at 03a860c) in place of the log of the mixture."""
    s = log_softmax(student_logits / temperature)
    t = log_softmax(teacher_logits / temperature)

    def kl_div(inputs, target):
        return np.exp(target) * (target - inputs)

    if beta == 0:
        jsd = kl_div(s, t)
    elif beta == 1:
        jsd = kl_div(t, s)
    else:
        if log_space_mixture:
            m = beta * t + (1 - beta) * s
        else:
            m = np.logaddexp(s + np.log(1 - beta), t + np.log(beta))
        jsd = beta * kl_div(m, t) + (1 - beta) * kl_div(m, s)
    mask = labels != -100
    return jsd[mask].sum() / mask.sum()


N, T, V = 3, 7, 48


def fixed_logits(seed=0):
    rng = np.random.default_rng(seed)
    student = rng.normal(0, 3, (N, T, V))
    teacher = rng.normal(0, 3, (N, T, V))
    labels = rng.integers(0, V, (N, T))
    labels[0, :3] = labels[2, 5:] = -100  # a prompt, padding
    return student, teacher, labels


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 2.0)])
def test_loss_is_trls_generalized_jsd(beta, temperature):
    student, teacher, labels = fixed_logits()
    masks = (labels != -100).astype(np.float32)
    per_token = token_jsd(jnp.asarray(student, jnp.float32), jnp.asarray(teacher, jnp.float32),
                          beta, temperature)
    got = float(jnp.sum(per_token * masks) / masks.sum())
    want = trl_generalized_jsd_loss(student, teacher, labels, beta, temperature)
    # fp32: each log-softmax entry is off by ~eps * |logit| (|logits / t| <= 15 here), and
    # a token's value sums V such terms weighted by probabilities summing to 1 (twice).
    scale = np.abs(student / temperature).max() + np.abs(teacher / temperature).max()
    tolerance = 4 * V * EPS32 * scale
    assert abs(got - want) <= tolerance, (got, want)
    assert want > 100 * tolerance  # the distributions differ: a real number is compared
    # Negative twin: the KL the other way round (beta 0 and 1; the divergence is symmetric
    # at 0.5), or at 0.5 the interpolated log-probabilities in place of the mixture.
    if beta in (0.0, 1.0):
        twin = trl_generalized_jsd_loss(student, teacher, labels, 1 - beta, temperature)
    else:
        twin = trl_generalized_jsd_loss(student, teacher, labels, beta, temperature,
                                        log_space_mixture=True)
    assert abs(got - twin) > tolerance, (got, twin)


# ------------------------------------------------------------ chunked = full logits

D, DT, CHUNK = 8, 12, 4


@partial(jax.jit, static_argnums=(0, 1))
def values_and_grads(jsd_fn, beta, hidden, head, teacher_hidden, teacher_head, weights):
    def f(hidden, head):
        per_token = jsd_fn(hidden, head, teacher_hidden, teacher_head, beta)
        return jnp.sum(per_token * weights), per_token
    (_, per_token), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, head)
    return [per_token, *grads]


def reference_jsd(student_logits, teacher_logits, beta):
    """TRL's per-token formula (above) in jnp, differentiated by autodiff: distill.py's
    gradient is written in closed form."""
    s = jax.nn.log_softmax(student_logits, axis=-1)
    t = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits, axis=-1))
    kl_div = lambda inputs, target: jnp.sum(jnp.exp(target) * (target - inputs), -1)  # noqa: E731
    if beta == 0:
        return kl_div(s, t)
    if beta == 1:
        return kl_div(t, s)
    m = jnp.logaddexp(s + jnp.log(1 - beta), t + jnp.log(beta))
    return beta * kl_div(m, t) + (1 - beta) * kl_div(m, s)


def full(hidden, head, teacher_hidden, teacher_head, beta):
    return reference_jsd(hidden @ head, teacher_hidden @ teacher_head, beta)


def chunked(hidden, head, teacher_hidden, teacher_head, beta):
    return chunked_token_jsd(hidden, head, teacher_hidden, teacher_head, beta, CHUNK)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_equals_full_logits_values_and_gradients(beta):
    """Per-token values and the gradients in the student's hidden states and head, the
    logits made CHUNK positions at a time (the gradient in closed form), against autodiff
    of TRL's formula on the full logits in float64."""
    rng = np.random.default_rng(1)
    T = 16
    args = [rng.normal(size=(N, T, D)), rng.normal(size=(D, V)) / np.sqrt(D),
            rng.normal(size=(N, T, DT)), 3 * rng.normal(size=(DT, V)) / np.sqrt(DT),
            rng.normal(size=(N, T))]
    with jax.enable_x64(True):
        want = [np.asarray(x) for x in values_and_grads(full, beta, *map(jnp.asarray, args))]
    f32 = [jnp.asarray(x, jnp.float32) for x in args]
    # Logits sum D terms, the log-softmax V more; the head's gradient sums N*T tokens.
    terms = [D + V, 2 * (D + V), N * T + D + V]

    def within(got):
        return all(np.abs(np.asarray(g) - w).max() <= 4 * n * EPS32 * np.abs(w).max()
                   for g, w, n in zip(got, want, terms))

    assert within(values_and_grads(chunked, beta, *f32))
    # Negative twin: the teacher's hidden states one position late.
    late = [f32[0], f32[1], jnp.roll(f32[2], 1, axis=1), *f32[3:]]
    assert not within(values_and_grads(chunked, beta, *late))


# ------------------------------------------------------------ memory, against GRPO's


def step_temp_bytes(objective_flags, chunk, rows=8, T=256):
    """XLA's temp bytes of the loss-and-gradient program of `objective` on `rows` rows of T
    tokens of the one-layer debug LLaMA with a vocabulary of 4,096 (where the logits weigh
    as in a real model; fp32), with --llama.loss_chunk_size `chunk`: GRPO as 2 prompts x 4
    completions, distill as 8 prompts x 1 completion."""
    from easylm import objectives, variants
    from easylm.llama.family import FAMILY

    config = llama_train.parse_flags(["train", *objective_flags, "--llama.base_model=debug",
                                      "--llama.num_hidden_layers=1", "--dtype=fp32",
                                      "--llama.vocab_size=4096",
                                      f"--llama.loss_chunk_size={chunk}",
                                      f"--train_dataset.json_dataset.seq_length={T}"])
    model = variants.build(FAMILY, config)
    objective = objectives.build(config, model, None)
    shape = (2, 4, T) if config.objective == "grpo" else (rows, T)
    batch = {"input_tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
             "target_tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
             "loss_masks": jax.ShapeDtypeStruct(shape, jnp.float32),
             "advantages": jax.ShapeDtypeStruct(shape[:2], jnp.float32),
             "valid": jax.ShapeDtypeStruct(shape[:2], jnp.float32)}
    frozen = {}
    if config.objective == "distill":
        frozen["teacher"] = jax.eval_shape(objective.teacher.model.init_params,
                                           jax.random.key(0))
        batch = {k: v for k, v in batch.items() if len(v.shape) == 2 and k != "valid"}
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    step = jax.jit(jax.value_and_grad(lambda p, b, f: objective.loss_fn(p, b, None, f).loss))
    return step.lower(params, batch, frozen).compile().memory_analysis().temp_size_in_bytes


def test_a_distill_step_holds_about_a_grpo_steps_memory(tmp_path):
    """The same rows (8 x 256) and a teacher of the student's shape: with the logits made
    16 positions at a time, the teacher's forward and both models' chunk logits add under
    1.2x to GRPO's temporaries (measured 1.11x). Negative twin: without chunking the
    (rows x T x V) logits of both models are live at once, 1.63x measured."""
    teacher = write_hf_teacher(tmp_path, vocab_size=4096)
    distill = ["--objective=distill", f"--distill.teacher={teacher}",
               "--distill.max_new_tokens=8"]
    grpo = ["--objective=grpo", "--grpo.num_generations=4", "--grpo.max_new_tokens=8"]
    ratio = step_temp_bytes(distill, 16) / step_temp_bytes(grpo, 16)
    unchunked = step_temp_bytes(distill, 0) / step_temp_bytes(grpo, 0)
    print(f"distill / GRPO temporaries: {ratio:.3f} chunked, {unchunked:.3f} unchunked")
    assert ratio <= 1.2, ratio
    assert unchunked > 1.2, unchunked


# ------------------------------------------------------------ the command

STUDENT = {"llama.base_model": "debug", "llama.num_hidden_layers": 1}
STEPS = 10


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(train, held-out) JSON lines of a prompt and a completion (words of a small
    vocabulary), and a teacher: the debug LLaMA (two layers, the student has one)
    trained for 12 steps of next-token prediction on the same texts, params::DIR."""
    from test_checkpoint import metrics  # noqa: F401 (the module the command tests share)

    directory = tmp_path_factory.mktemp("distill-task")
    words = "the cat dog sun big red day one".split()
    paths = {}
    for name, n, seed in (("train", 512, 0), ("held_out", 16, 1)):
        rng = random.Random(seed)
        rows = [{"prompt": " ".join(rng.choice(words) for _ in range(2)),
                 "completion": " ".join(rng.choice(words) for _ in range(3))} for _ in range(n)]
        paths[name] = directory / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
        if name == "train":
            paths["text"] = directory / "text.jsonl"
            paths["text"].write_text("".join(json.dumps({"text": f"{r['prompt']} "
                                                         f"{r['completion']}"}) + "\n"
                                             for r in rows))
    llama_train.main(["train", "--llama.base_model=debug", "--dtype=fp32",
                      f"--train_dataset.json_dataset.path={paths['text']}",
                      "--train_dataset.json_dataset.seq_length=32",
                      "--train_dataset.json_dataset.batch_size=8", "--total_steps=12",
                      "--log_freq=12", "--compilation_cache_dir=",
                      "--optimizer.adamw_optimizer.lr=1e-2",
                      "--optimizer.adamw_optimizer.lr_warmup_steps=1",
                      "--optimizer.adamw_optimizer.lr_decay_steps=12",
                      f"--logger.output_dir={directory / 'teacher'}",
                      "--logger.experiment_id=run"])
    return {**{k: str(v) for k, v in paths.items()},
            "teacher": f"params::{directory / 'teacher' / 'run' / 'checkpoints' / '12'}"}


def command(task, output_dir, **flags):
    flags = {"objective": "distill", "distill.teacher": task["teacher"], **STUDENT,
             "dtype": "fp32", "train_dataset.json_dataset.path": task["train"],
             "train_dataset.json_dataset.seq_length": 24,
             "train_dataset.json_dataset.batch_size": 16, "distill.max_new_tokens": 8,
             "eval_dataset.json_dataset.path": task["held_out"], "eval_freq": 1,
             "total_steps": STEPS, "log_freq": 1, "optimizer.adamw_optimizer.lr": 1e-2,
             "optimizer.adamw_optimizer.lr_warmup_steps": 1,
             "optimizer.adamw_optimizer.lr_decay_steps": STEPS, "compilation_cache_dir": "",
             "logger.output_dir": str(output_dir), "logger.experiment_id": "run", **flags}
    return ["train", *(f"--{k}={v}" for k, v in flags.items())]


@pytest.fixture(scope="module")
def learned(task, tmp_path_factory):
    from test_checkpoint import metrics

    output_dir = tmp_path_factory.mktemp("distill-run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        llama_train.main(command(task, output_dir))
    return metrics(output_dir)


def test_distilling_closes_most_of_the_held_out_gap(learned):
    """The held-out generalized JSD to the teacher (beta 0.5, on the held-out completions)
    at step 1's evaluation (its update is at learning rate 0: the random student's) falls
    by more than half in STEPS steps that mix the student's samples (lmbda 0.5) and the
    dataset's completions."""
    got = learned
    assert sorted(got) == list(range(1, STEPS + 1))
    first, final = got[1]["eval_loss"], got[STEPS]["eval_loss"]
    assert final < 0.5 * first, (first, final)
    on_policy = [got[s]["data/distill/on_policy"] for s in got]
    assert 0 < sum(on_policy) < STEPS  # both kinds of step were trained
    assert all(np.isfinite(got[s]["loss"]) and got[s]["gradient_norm"] > 0 for s in got)


def test_sigkill_then_resume_continues_with_the_same_numbers(task, learned, tmp_path):
    """Killed (SIGKILL) once step 2's checkpoint is complete, then the same command to
    step 6: every step's loss and gradient norm are bitwise those of the uninterrupted
    run (JSON floats round-trip exactly): the on-policy coin, the samples' keys and the
    data resume. The kill comes at once, so the killed run leaves steps after 2 half
    done or logged without a checkpoint: what the resume must not read."""
    import signal

    from cli_utils import xla_flags
    from test_checkpoint import ENV, metrics, run_until

    # Without the evaluations: they draw their own keys and change nothing trained.
    argv = command(task, tmp_path, eval_freq=0, total_steps=6, save_model_freq=2)
    env = dict(ENV, XLA_FLAGS=xla_flags(8))
    code, _, _ = run_until([sys.executable, "-m", "easylm.train", *argv[1:]], tmp_path, 2,
                           signal.SIGKILL, env)
    assert code == -signal.SIGKILL
    assert max(metrics(tmp_path)) < 6  # killed before the end
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        llama_train.main(argv)
    resumed = metrics(tmp_path)
    assert sorted(resumed) == list(range(1, 7))
    assert {resumed[s]["data/distill/on_policy"] for s in resumed} == {0.0, 1.0}
    for s in resumed:
        for key in ("loss", "gradient_norm", "data/completions/mean_length"):
            assert resumed[s][key] == learned[s][key], (s, key)


def write_hf_teacher(directory, **overrides) -> str:
    """hf::DIR of a one-layer debug LLaMA drawn at random, with `overrides`."""
    from easylm.llama.family import FAMILY
    from easylm.models.family import hf_adapter
    from easylm.models.hf_checkpoint import write_safetensors

    config = FAMILY.from_preset("debug", **{"num_hidden_layers": 1, **overrides})
    params = FAMILY.module_class(config).init_params(jax.random.key(1))
    write_safetensors(((name, np.asarray(x, np.float32)) for name, x in
                       hf_adapter(FAMILY).write_params(params, config)), str(directory))
    config.to_hf_config().save_pretrained(str(directory))
    return f"hf::{directory}"


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory):
    """A teacher with 256 tokens (the student has 512)."""
    return write_hf_teacher(tmp_path_factory.mktemp("teacher-256"), vocab_size=256)


def test_a_teacher_of_another_vocabulary_is_one_line(task, other_vocabulary, capsys, tmp_path):
    message = one_line_error(llama_train.main, command(
        task, tmp_path, **{"distill.teacher": other_vocabulary}), capsys)
    assert message == (f"--distill.teacher={other_vocabulary}: its vocabulary has 256 tokens, "
                       f"the student's 512; distillation compares distributions over one "
                       f"vocabulary")


@pytest.mark.parametrize("flags,message", [
    ({"distill.teacher": ""}, "--distill.teacher must be hf::DIR or params::PATH, got ''"),
    ({"distill.teacher": "nope"}, "--distill.teacher='nope': expected hf::DIR or params::PATH"),
    ({"distill.beta": 1.5}, "--distill.beta must be in [0, 1], got 1.5"),
])
def test_bad_setup_is_one_line(task, flags, message, capsys, tmp_path):
    assert one_line_error(llama_train.main, command(task, tmp_path, **flags), capsys) == message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
