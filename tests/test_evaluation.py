"""lm-eval in-process (`easylm.evaluation.harness.HarnessLM`) against lm-eval's `hf` backend and
the HTTP server under `local-completions`: one tiny random HF model, the local tasks in
tests/eval_tasks/ (multiple choice, rolling log-likelihood, generate_until), and a
tokenizer that adds BOS and one that does not."""

import collections
import json
import os

import jax
import lm_eval
import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from serving_utils import ServerThread, make_tokenizer, tiny_config
from transformers import LlamaForCausalLM as HFLlama

from easylm import flags as flag_lib
from easylm.errors import UserError
from easylm.evaluation.harness import HarnessLM, load_tasks, task_manager
from easylm.llama.family import FAMILY
from easylm.serving import cli as serving_cli, scoring, server as server_lib
from easylm.serving.batcher import Batcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["tiny_mc", "tiny_rolling", "tiny_gen"]
S = 64  # the engine's context, and local-completions' max_length
# hf's and the in-process max_length: local-completions keeps 1 token of its max_length
# for the token it asks for, and 1 more in rolling windows, so S - 2 gives the same windows.
L = S - 2
EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module", autouse=True)
def in_repo():
    """The task files name their data relative to the repository (lm-eval reads
    dataset_kwargs.data_files relative to the working directory)."""
    cwd = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(cwd)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(directory, model, {adds_bos: tokenizer directory}) of a random HF LLaMA."""
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    model = HFLlama(tiny_config().to_hf_config()).eval()
    model.save_pretrained(root / "model")
    tokenizers = {}
    for adds_bos in (True, False):
        tokenizers[adds_bos] = str(root / f"tokenizer-bos-{adds_bos}")
        make_tokenizer(adds_bos=adds_bos).save_pretrained(tokenizers[adds_bos])
    return str(root / "model"), model, tokenizers


@pytest.fixture(scope="module")
def served(hf_model):
    """(engine, stop ids, server url): the server and the in-process model share one engine
    (so one set of compiled programs); the tests use them one at a time."""
    directory, _, tokenizers = hf_model
    config = flag_lib.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY), [
        "serve", f"--load_checkpoint=hf::{directory}", f"--tokenizer={tokenizers[True]}",
        f"--seq_length={S}", f"--min_bucket={S}", "--dtype=fp32", "--mesh_dim=1,-1,1"])
    engine, tokenizer, stop_ids = serving_cli.load_engine(FAMILY, config)
    batcher = Batcher(engine, stop_ids).start()
    with ServerThread(server_lib.create_app(server_lib.Service(config, batcher, tokenizer))) as server:
        yield engine, stop_ids, server.url
    batcher.stop()


@pytest.fixture(scope="module")
def twin_engine(served):
    """A second engine, made as the trainer will make one: over parameters on the devices."""
    engine = served[0]
    lm = HarnessLM.from_params(engine.model, engine.params, make_tokenizer(), engine.mesh,
                               {"seq_length": S, "min_bucket": S})
    assert lm.engine is not engine and lm.max_length == S
    return lm.engine


@pytest.fixture(scope="module")
def manager():
    return task_manager(TASKS, "tests/eval_tasks")


def run(model, manager, **kwargs):
    return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=manager,
                                   log_samples=True, bootstrap_iters=0, **kwargs)


def responses(results, task):
    """Per request (documents in order, then each document's requests)."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [r[0] for s in samples for r in s["resps"]], [a for s in samples for a in s["arguments"]]


def instances(kind, arguments):
    return [Instance(kind, {}, tuple(args), i) for i, args in enumerate(arguments)]


def close(a: float, b: float, lm, kind, args) -> bool:
    """fp32 log-likelihoods from two implementations: 1e-4 (the issue's bound; the worst
    short request here differs by ~7e-6), or for a long sum of n tokens n·eps·|sum| (each
    term differs in its last bits, and a sum of n such terms drifts by that much)."""
    n = len(lm._encode_pair(*args)[1]) if kind == "loglikelihood" else len(lm.tok_encode(args[0]))
    return a == pytest.approx(b, rel=n * EPS, abs=1e-4)


def logprob(response) -> float:
    """loglikelihood responds (log-probability, is greedy), loglikelihood_rolling a number."""
    return response[0] if isinstance(response, (tuple, list)) else response


def assert_close_per_request(ours, theirs, lm):
    for task, kind in (("tiny_mc", "loglikelihood"), ("tiny_rolling", "loglikelihood_rolling")):
        mine, args = responses(ours, task)
        other, other_args = responses(theirs, task)
        assert args == other_args
        for a, b, request in zip(mine, other, args):
            assert close(logprob(a), logprob(b), lm, kind, request), (request, a, b)
            if kind == "loglikelihood":
                assert a[1] == b[1], request  # is_greedy


@pytest.mark.parametrize("adds_bos", [True, False], ids=["adds-bos", "no-bos"])
def test_in_process_matches_hf_and_the_server(adds_bos, hf_model, served, twin_engine, manager):
    _, model, tokenizers = hf_model
    engine, stop_ids, url = served
    tokenizer = make_tokenizer(adds_bos=adds_bos)
    assert (tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id) == adds_bos
    lm = HarnessLM(engine, tokenizer, stop_ids, max_length=L)
    ours = run(lm, manager)
    hf = run(HFLM(pretrained=model, tokenizer=tokenizer, max_length=L, batch_size=1,
                  device="cpu"), manager)
    server = run("local-completions", manager, batch_size=8, model_args={
        "model": "easylm", "base_url": f"{url}/v1/completions", "tokenizer": tokenizers[adds_bos],
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": S,
        "add_bos_token": adds_bos, "max_retries": 1})

    for theirs in (hf, server):
        for task, metrics in theirs["results"].items():
            for name in ("acc,none", "acc_norm,none", "exact_match,none"):
                if name in metrics:
                    assert ours["results"][task][name] == metrics[name], (task, name)
        assert_close_per_request(ours, theirs, lm)
        assert responses(ours, "tiny_gen") == responses(theirs, "tiny_gen")

    # The data exercise what they should: documents longer than one window, generations
    # cut by a stop string (the same requests without `until` run on).
    _, rolling = responses(ours, "tiny_rolling")
    assert max(len(lm.tok_encode(text)) for (text,) in rolling) > 2 * L
    generated, gen_args = responses(ours, "tiny_gen")
    uncut = lm.generate_until(instances("generate_until", [
        (context, {**kwargs, "until": []}) for context, kwargs in gen_args]), disable_tqdm=True)
    stops = gen_args[0][1]["until"]
    assert any(text != whole and any(whole.startswith(text + s) for s in stops)
               for text, whole in zip(generated, uncut))

    # Negative twin: the other BOS rule and half the window move the numbers past the
    # tolerance, so the comparison above would catch either.
    wrong = HarnessLM(twin_engine, make_tokenizer(adds_bos=not adds_bos), stop_ids,
                      max_length=L // 2)
    for task, kind in (("tiny_mc", "loglikelihood"), ("tiny_rolling", "loglikelihood_rolling")):
        expected, args = responses(hf, task)
        got = getattr(wrong, kind)(instances(kind, args), disable_tqdm=True)
        assert not all(close(logprob(g), logprob(e), lm, kind, a)
                       for g, e, a in zip(got, expected, args)), task


def test_rolling_windows_are_lm_evals(hf_model):
    """The server's /loglikelihood-rolling windows (scoring.rolling_windows) are lm-eval's."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in (1, 5, 8, 9, 16, 17, 30):
        for length in (1, 4, 8):
            tokens = list(range(10, 10 + n))
            theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 1, length, 1)]
            ours = scoring.rolling_windows(tokens, 1, length)
            assert len(ours) == len(theirs)
            for (inputs, targets, start), (context, continuation) in zip(ours, theirs):
                whole = (context + continuation)[-(length + 1):]
                assert (inputs, targets[start:]) == (whole[:-1], continuation), (n, length)


def test_task_paths_and_data_that_cannot_load_are_one_line(tmp_path):
    # (Unknown task names: tests/test_eval_cli.py, through the command.)
    with pytest.raises(UserError, match="--include_path='no/such/dir' is not a directory"):
        load_tasks(["tiny_mc"], "no/such/dir")
    task = open(os.path.join(REPO, "tests/eval_tasks/tiny_mc.yaml")).read()
    (tmp_path / "lost.yaml").write_text(task.replace("tiny_mc", "lost").replace(
        "tests/eval_tasks/lost.jsonl", str(tmp_path / "lost.jsonl")))
    with pytest.raises(UserError, match=f"cannot load the data of --tasks=lost: Unable to find "
                                        f"'{tmp_path}/lost.jsonl'"):
        load_tasks(["lost"], str(tmp_path))
    (tmp_path / "lost.jsonl").write_text('{"question": "a", "choices": ["b"], "label": 0}\n{oops\n')
    with pytest.raises(UserError, match="cannot load the data of --tasks=lost: .*JSON parse error"):
        load_tasks(["lost"], str(tmp_path))


def test_the_generation_budget_is_checked_only_where_a_task_generates():
    """As `python -m easylm.eval` does: a multiple-choice task set runs under a
    --eval_harness.max_gen_toks longer than the context (it writes nothing); a generating
    task's own max_gen_toks is checked against the context before any task runs."""
    from easylm.data.tokenizer import load_tokenizer
    from easylm.evaluation import harness_flags
    from easylm.evaluation.harness import HarnessHook

    model = FAMILY.bind(FAMILY.from_preset("debug", num_hidden_layers=1))
    tokenizer = load_tokenizer("embedded")

    def hook(tasks):
        config = harness_flags.get_default_config({
            "tasks": tasks, "include_path": "tests/eval_tasks", "seq_length": 12,
            "max_gen_toks": 256})
        return HarnessHook(config, model, tokenizer, None)

    assert hook("tiny_mc").lm.max_gen_toks == 256
    with pytest.raises(UserError) as error:
        hook("tiny_mc,tiny_gen")
    assert str(error.value) == ("task tiny_gen's max_gen_toks=12 leaves no room for a prompt "
                                "in --eval_harness.seq_length=12")


# ------------------------------------------------------------ in the training loop

HOOK_STEPS = (5, 10)
TRAIN = [
    "--llama.base_model=debug", "--llama.num_hidden_layers=2", "--mesh_dim=2,2,2",
    "--train_dataset.json_dataset.seq_length=32", "--train_dataset.json_dataset.batch_size=8",
    "--total_steps=10", "--log_freq=100", "--save_model_freq=5", "--compilation_cache_dir=",
    "--logger.tensorboard=True", "--logger.experiment_id=run",
    "--eval_harness.tasks=tiny_mc,tiny_rolling", "--eval_harness.freq=5",
    "--eval_harness.limit=4", "--eval_harness.include_path=tests/eval_tasks",
]


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory):
    """(run directory, {step: programs lowered in the hook's call}, steps the hook ran at,
    {step: the host's waits for the device after it}) of a 10-step run on a 2,2,2 mesh with
    the hook every 5 steps. Every new program is lowered, whether the persistent
    compilation cache then has it or not. A wait: a jax.Array's value read
    (jax.device_get, float(), .item(), .tolist(), __array__) or block_until_ready."""
    from jax import monitoring
    from jax._src.array import ArrayImpl

    from easylm.evaluation.harness import HarnessHook
    from easylm.llama import train
    from easylm.training import logger, trainer

    root = tmp_path_factory.mktemp("harness-run")
    step, calls, compiles, waits = [0], [], {}, collections.Counter()

    def advance(self, steps=1):
        step[0] += steps

    def hook_call(self, at, state):
        calls.append(at)
        compiles[at] = 0
        return real_call(self, at, state)

    def on_compile(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and calls:
            compiles[calls[-1]] += 1

    def counted(method):
        if isinstance(method, property):
            return property(lambda self: (waits.update([step[0]]), method.fget(self))[1])
        return lambda *args, **kwargs: (waits.update([step[0]]), method(*args, **kwargs))[1]

    real_call = HarnessHook.__call__
    monitoring.register_event_duration_secs_listener(on_compile)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        patch.setattr(logger.Logger, "advance", advance)
        patch.setattr(HarnessHook, "__call__", hook_call)
        for name in ("_value", "__array__", "item", "block_until_ready"):
            patch.setattr(ArrayImpl, name, counted(ArrayImpl.__dict__[name]))
        patch.setattr(jax, "block_until_ready", counted(jax.block_until_ready))
        try:
            config = train.parse_flags(["train", *TRAIN, f"--logger.output_dir={root}"])
            trainer.train(config, FAMILY)
        finally:
            monitoring.unregister_event_duration_listener(on_compile)
    return root / "run", compiles, calls, waits


def test_training_logs_the_live_parameters_harness_metrics(harness_run):
    """Acceptance 2: metrics at steps 5 and 10, in metrics.jsonl and TensorBoard, equal to
    `python -m easylm.llama.eval`'s (its in-process functions) on the checkpoints of the
    same steps; the engine is built once (no new program in the second evaluation)."""
    from test_logger import read_events

    from easylm.evaluation.harness import evaluate, harness_metrics
    from easylm.llama import eval as eval_cli

    run_dir, compiles, calls, _ = harness_run
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    logged = {row["step"]: {k: v for k, v in row.items() if k.startswith("harness/")}
              for row in rows if "harness/seconds" in row}
    assert calls == list(HOOK_STEPS) and sorted(logged) == list(HOOK_STEPS)
    assert compiles[HOOK_STEPS[0]] > 0 and compiles[HOOK_STEPS[1]] == 0
    scalars, _ = read_events(run_dir)
    for key in logged[5]:
        assert [s for s, _ in scalars[key]] == list(HOOK_STEPS), key
        assert [v for _, v in scalars[key]] == [np.float32(logged[s][key]) for s in HOOK_STEPS]

    manager, tasks = load_tasks(["tiny_mc", "tiny_rolling"], "tests/eval_tasks")
    names = [k for k in logged[5] if k != "harness/seconds"]
    assert {"harness/tiny_mc/acc", "harness/tiny_rolling/bits_per_byte"} <= set(names)
    expected = {}
    for step in HOOK_STEPS:
        config = flag_lib.parse(eval_cli.model_config(), eval_cli.help_entries(), [
            "eval", f"--load_checkpoint=params::{run_dir}/checkpoints/{step}",
            "--tokenizer=embedded", "--mesh_dim=2,2,2", "--dtype=fp32"])
        expected[step] = harness_metrics(evaluate(eval_cli.load(config), tasks, manager,
                                                  limit=4, bootstrap_iters=0))
        # The same programs on the same mesh over the same numbers (measured: identical);
        # rel 1e-5, ~100 ulps, leaves room for a reordered sum of a few hundred tokens.
        for name in names:
            assert logged[step][name] == pytest.approx(expected[step][name], rel=1e-5), name
    # Negative twin: training moved the numbers by far more, so evaluating stale (or the
    # other step's) parameters would fail the comparison.
    assert logged[5]["harness/tiny_rolling/bits_per_byte"] != pytest.approx(
        expected[10]["harness/tiny_rolling/bits_per_byte"], rel=1e-3)


def test_the_hook_adds_no_host_sync_to_ordinary_steps(harness_run):
    """Acceptance 5: with the hook configured, the host waited for the device only after
    the first (compiling) step, the log steps (1, 10) and the hook's and saves' steps (5,
    10). The negative twin: the spies do see the hook's own fetches. (Not seen: numpy
    reading a CPU array through the buffer protocol, np.asarray(x); the loop has none.)"""
    _, _, calls, waits = harness_run
    assert calls == list(HOOK_STEPS)
    ordinary = [s for s in waits if s not in (0, 1, *HOOK_STEPS)]
    assert not ordinary, {s: waits[s] for s in ordinary}
    assert waits[5] > 10  # the engine's scoring calls, each fetched


def test_the_hook_on_a_lora_run_scores_as_the_merged_model(tmp_path):
    """--eval_harness on a QLoRA run: the engine runs the live adapters on the stored nf4
    base (no merged copy of the base); its log-likelihoods are the merged model's (W + s·A·B
    folded into each dequantized kernel), within the reordering of fp32 sums that merging
    is, and its logged metrics are the merged model's."""
    import contextlib

    from numerics import logprob_atol_for

    from easylm.data.tokenizer import load_tokenizer
    from easylm.evaluation.harness import evaluate, harness_metrics
    from easylm.llama import train
    from easylm.variants.adapters import Adapters
    from easylm.llama.config import LLaMAConfig
    from easylm.llama.model import LLaMAForCausalLM
    from easylm.training.setup import start
    from easylm.variants.lora import LoraConfig

    config = train.parse_flags(["train", *TRAIN[:5], "--compilation_cache_dir=",
                                "--lora.rank=4", "--lora.base_dtype=nf4", "--dtype=fp32",
                                *TRAIN[-4:], "--eval_harness.seq_length=64",
                                "--eval_harness.max_gen_toks=16",
                                f"--logger.output_dir={tmp_path}"])
    with contextlib.ExitStack() as cleanup:
        run = start(config, FAMILY, cleanup)
        base = run.state.frozen["base"]
        # B starts at 0 (the adapted model is the base): other adapters, that change it.
        keys = iter(jax.random.split(jax.random.key(1), 64))
        params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                              run.state.params)
        logged = run.harness(1, run.state.replace(params=params))
        lm_config = LLaMAConfig(**run.model.config)
        lm = Adapters(FAMILY).lora_model(lm_config, LoraConfig.from_flags(config.lora))
        merged = jax.jit(lm.merge)(base, params)
        hook = run.harness.lm
        merged_lm = HarnessLM.from_params(FAMILY.bind(lm_config), merged, load_tokenizer(
            "embedded"), run.mesh, {"seq_length": 64, "min_bucket": 16}, progress=False)
        ids = np.random.RandomState(0).randint(0, 512, (8, 64))
        requests = [(None, list(row[:n]), list(row[n:])) for row, n in zip(ids, range(1, 64, 8))]
        hook.engine.params, hook.engine.base = params, base
        ours = np.array([logprob for logprob, _ in hook._loglikelihood_tokens(requests)])
        theirs = np.array([logprob for logprob, _ in merged_lm._loglikelihood_tokens(requests)])
        merged_lm.engine.params = jax.jit(lm.merge)(base, lm.adapters_off(params))
        unadapted = np.array([lp for lp, _ in merged_lm._loglikelihood_tokens(requests)])
        merged_lm.engine.params = merged
        expected = harness_metrics(evaluate(merged_lm, run.harness.tasks, run.harness.manager,
                                            limit=4, bootstrap_iters=0))
    tolerance = logprob_atol_for(LLaMAForCausalLM(lm_config), jax.device_get(merged), 64)
    terms = np.array([len(continuation) for _, _, continuation in requests])
    print("max |log-likelihood difference|, LoRA vs merged:", np.abs(ours - theirs).max(),
          "tolerance:", tolerance(terms).min())
    assert np.all(np.abs(ours - theirs) <= tolerance(terms))
    assert np.all(np.abs(unadapted - theirs) > tolerance(terms))  # the adapters matter
    assert sorted(logged) == sorted({**expected, "harness/seconds": 0})
    for name, value in expected.items():
        # Means over tokens (or their exp: perplexities) of log-probabilities each within
        # tolerance(1): relative error <= tolerance(1) (bits per byte: divided further by
        # the mean |log-probability|, ~ln 512); accuracies are equal unless a choice is a
        # tie within that.
        assert logged[name] == pytest.approx(value, rel=tolerance(1)), name
