"""GRPO's routing replay: the engine records each token's expert choices while
sampling and the training forward replays them, so the trainer's log-probabilities are
the sampler's to fp32 rounding.

The model is a tiny random Qwen3-MoE built with transformers whose routers give every
expert the same column up to a relative 1e-6: near-tied router logits, gaps of the order
of the ~1e-7 x sqrt(D) rounding by which the engine's forward (prefill, then one token at
a time over a KV cache) and the training forward (all positions at once) differ. Without
replay some tokens then go to other experts, which moves their log-probabilities by far
more than rounding.

Tolerance (tests/numerics.py): a layer has the dense layer's reductions plus the
router's matmul and the weighted sum of the chosen experts (test_moe_models.moe_rel); a
log-probability moves by at most twice the largest logit error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from llama_variants import hf_variant
from numerics import assert_close, assert_differs, fp32_rel
from test_grpo import task  # noqa: F401 (a fixture: prompts and the parity reward)
from test_grpo_tools import tools_module  # noqa: F401 (a fixture: the tools' module)

from easylm import model_flags
from easylm.llama import hf
from easylm.llama.config import LLaMAConfig
from easylm.llama.family import FAMILY
from easylm.models import moe
from easylm.objectives import rollouts
from easylm.serving import engine as engine_lib

T, NEW, ROWS = 16, 6, 8  # training row length, completion tokens, rows sampled
TIE = 1e-6  # relative difference between the router's columns


def tiny_config() -> LLaMAConfig:
    return LLaMAConfig.from_preset("debug_moe", num_hidden_layers=2, vocab_size=64,
                                   initializer_range=0.2)


def save_tied(config, directory):
    """transformers' random model of `config` with near-tied routers, saved."""
    model = hf_variant(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # (E, D)
                parameter.copy_(parameter[:1] * (1 + TIE * torch.randn_like(parameter)))
    model.save_pretrained(directory)


def logprob_atol(config, logits_scale: float, extra_per_layer: int = 0,
                 length: int = T) -> float:
    """`extra_per_layer`: reductions a variant adds to each layer (LoRA's x A and (x A) B);
    `length`: the rows' (attention's reductions)."""
    terms = max(config.hidden_size, config.moe_intermediate_size, length)
    per_layer = (7 if config.qk_norm else 6) + 2 + extra_per_layer
    return 2 * fp32_rel(terms, per_layer * config.num_hidden_layers + 1) * logits_scale


def sample(config, model, params, base=None):
    """Rollout rows of ROWS completions the engine samples at temperature 1 from `model`
    (on its frozen `base`, for a variant), with its log-probabilities and its recorded
    choices."""
    engine = engine_lib.Engine(
        engine_lib.get_default_config({"batch_size": ROWS, "seq_length": T,
                                       "min_bucket": T - NEW, "decode_steps": 4}),
        model, params, base=base, record_routing=True)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(3, config.vocab_size, rng.randint(3, 8)).tolist()
               for _ in range(ROWS)]
    sampling = engine_lib.Sampling.empty(ROWS)
    sampling.keys[:] = rollouts.sampling_keys(0, 0, 0, 0, ROWS)
    sampling.temperature[:] = 1.0
    routing = []
    completions, logprobs = rollouts.generate(engine, prompts, sampling, NEW,
                                              config.eos_token_id, routing)
    rows = rollouts.token_rows(prompts, completions, 1, T, 0, np.ones(ROWS, bool))
    rows["sampling_logps"] = rollouts.completion_values(prompts, logprobs, 1, T)
    rows["routing"] = rollouts.completion_routing(routing, T)  # (N, L, T, K)
    return rows


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """(config, model, params, rollout rows with the engine's log-probabilities and its
    recorded choices, the tolerance) of ROWS completions sampled at temperature 1, the
    layers scanned."""
    config = tiny_config()
    directory = tmp_path_factory.mktemp("tied")
    save_tied(config, directory)
    # Scanned layers: the replayed rows reach each layer through nn.scan (the command
    # tests below run the layers one by one).
    config = config.replace(scan_layers=True)
    _, params = hf.load_hf_params(str(directory), scan_layers=True)
    model = FAMILY.bind(config)
    rows = sample(config, model, params)
    logits = model.forward(params, jnp.asarray(rows["input_tokens"])).logits
    atol = logprob_atol(config, float(jnp.abs(logits).max()))
    return config, model, params, rows, atol


def test_replay_collection_walks_the_layers_as_router_stats_stacks_them():
    """`router_stats` stacks the sown stats (<layer>/stats) and `replay_collection` splits
    the recorded rows over the blocks (<layer>/mlp) in the same order, for 11 layers one by
    one ('10' sorts before '2') and for a scanned pattern of two slots with a tail layer:
    each layer gets its own rows back. Tree operations only (the forward's fixture above
    replays a 2-layer model end to end)."""
    K, N = 2, 3

    def stats(marks):  # RouterStats whose chosen experts are the layer's mark
        marks = np.asarray(marks)
        return moe.RouterStats(np.zeros((*marks.shape, N, 4)),
                               np.broadcast_to(marks[..., None, None], (*marks.shape, N, K)),
                               np.zeros((*marks.shape, 4)), np.zeros(marks.shape))

    kernel = np.zeros((5, 4))
    one_by_one = {str(i): i for i in range(11)}
    sown = {"model": {"layers": {k: {"stats": (stats(i),)} for k, i in one_by_one.items()}}}
    params = {"model": {"layers": {k: {"mlp": {"router": {"kernel": kernel}}}
                                   for k in one_by_one}}}
    replay = moe.replay_collection(params, moe.router_stats(sown).experts)
    for key, mark in one_by_one.items():
        assert (replay["model"]["layers"][key]["mlp"]["experts"] == mark).all(), key
    # scanned: slot0 holds layers 0, 2, 4; slot1 layers 1, 3, 5; tail6 layer 6
    slots = {"slot0": [0, 2, 4], "slot1": [1, 3, 5]}
    sown = {"model": {"layers": {k: {"stats": (stats(m),)} for k, m in slots.items()},
                      "tail6": {"stats": (stats(6),)}}}
    stacked = np.zeros((3, 5, 4))
    params = {"model": {"layers": {k: {"mlp": {"router": {"kernel": stacked}}} for k in slots},
                        "tail6": {"mlp": {"router": {"kernel": kernel}}}}}
    replay = moe.replay_collection(params, moe.router_stats(sown).experts)
    for key, marks in slots.items():
        got = replay["model"]["layers"][key]["mlp"]["experts"][:, 0, 0]
        np.testing.assert_array_equal(got, marks)
    assert (replay["model"]["tail6"]["mlp"]["experts"] == 6).all()
    with pytest.raises(ValueError, match="routing to replay has 6 layers, the model 7"):
        moe.replay_collection(params, moe.router_stats(sown).experts[:6])


def trainer_logps(model, params, rows, routing=None, base=None):
    """The training forward's log-probabilities of the sampled tokens, replaying
    `routing` (N, L, T, K) when given."""
    kwargs = {} if base is None else {"base": base}
    if routing is not None:
        L, K = routing.shape[1], routing.shape[-1]
        kwargs["routing"] = jnp.asarray(routing).swapaxes(0, 1).reshape(L, -1, K)
    logits = model.forward(params, jnp.asarray(rows["input_tokens"]), **kwargs).logits
    logps, _ = rollouts.token_logps(logits, jnp.asarray(rows["target_tokens"]), 1.0)
    return np.asarray(logps) * rows["loss_masks"]


def test_recorded_choices_cover_every_fed_position(sampled):
    """Each row's prompt and completion positions the training row feeds carry K
    distinct recorded experts; the positions past them are -1 (routed as usual)."""
    config, _, _, rows, _ = sampled
    routing = rows["routing"]
    assert routing.shape == (ROWS, config.num_hidden_layers, T, config.num_experts_per_tok)
    fed = np.cumsum(rows["loss_masks"][:, ::-1], axis=1)[:, ::-1] > 0  # up to the last target
    assert ((routing >= 0).all(axis=(1, 3)) == fed).all()
    ordered = np.sort(routing[fed.nonzero()[0], :, fed.nonzero()[1]], axis=-1)
    assert (np.diff(ordered, axis=-1) > 0).all() and (ordered < config.num_experts).all()


def test_replay_matches_the_sampler_and_routing_anew_does_not(sampled):
    """Acceptance 4: replaying the engine's choices, the trainer's log-probabilities are
    the engine's within the derived fp32 bound; routing anew, some tokens take other
    experts and the difference is far larger (the figure printed with -s)."""
    _, model, params, rows, atol = sampled
    masks = rows["loss_masks"]
    sampler = rows["sampling_logps"] * masks
    replayed = trainer_logps(model, params, rows, rows["routing"])
    assert_close(replayed, sampler, atol, scale=1.0)
    anew = trainer_logps(model, params, rows)
    print(f"\nsampler vs trainer max |logp diff|: replay {np.abs(replayed - sampler).max():.3g}"
          f", no replay {np.abs(anew - sampler).max():.3g} (bound {atol:.3g})")
    assert_differs(anew, sampler, atol, scale=1.0)


@pytest.mark.parametrize("wrong", ["other_layer", "shifted_position"])
def test_misplaced_choices_are_caught(sampled, wrong):
    """Negative twins: the recorded choices replayed at the other layer, or one position
    late, give log-probabilities the same comparison rejects."""
    _, model, params, rows, atol = sampled
    routing = rows["routing"]
    if wrong == "other_layer":
        routing = routing[:, ::-1]
    else:
        routing = np.concatenate([routing[:, :, :1], routing[:, :, :-1]], axis=2)
    sampler = rows["sampling_logps"] * rows["loss_masks"]
    assert_differs(trainer_logps(model, params, rows, routing), sampler, atol, scale=1.0)


def test_replay_under_lora_matches_the_sampler(sampled):
    """LoRA (rank 2, every adapter drawn N(0, 0.2) so that they move the logits) on the
    near-tied MoE base: the engine runs the adapters on the frozen base and records its
    choices, the LoRA training forward replays them, and the log-probabilities agree
    within the same derived bound (two more reductions a layer: x A, (x A) B); routing
    anew, they do not."""
    from ml_collections import ConfigDict

    from easylm import variants
    from easylm.variants.lora import LoraConfig

    config, _, params, _, _ = sampled
    flags = model_flags.flag_config(FAMILY, "debug_moe")
    for name in ("num_hidden_layers", "vocab_size", "initializer_range", "scan_layers"):
        flags[name] = getattr(config, name)
    model = variants.build(FAMILY, ConfigDict(dict(
        llama=flags, dtype="fp32", param_dtype="fp32",
        lora=dict(LoraConfig.get_default_config().to_dict(), rank=2))))
    shapes = jax.eval_shape(model.init_params, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(shapes))))
    adapters = jax.tree.map(lambda leaf: 0.2 * jax.random.normal(next(keys), leaf.shape),
                            shapes)
    rows = sample(config, model, adapters, base=params)
    logits = model.forward(adapters, jnp.asarray(rows["input_tokens"]), base=params).logits
    atol = logprob_atol(config, float(jnp.abs(logits).max()), extra_per_layer=2)
    sampler = rows["sampling_logps"] * rows["loss_masks"]
    replayed = trainer_logps(model, adapters, rows, rows["routing"], base=params)
    assert_close(replayed, sampler, atol, scale=1.0)
    anew = trainer_logps(model, adapters, rows, base=params)
    print(f"\nLoRA sampler vs trainer max |logp diff|: replay "
          f"{np.abs(replayed - sampler).max():.3g}, no replay {np.abs(anew - sampler).max():.3g}"
          f" (bound {atol:.3g})")
    assert_differs(anew, sampler, atol, scale=1.0)


def test_replay_still_trains_the_router(sampled):
    """Replayed experts (not the logits' own top k) keep their weights' dependence on the
    router: a loss of the weights has a nonzero gradient at each chosen expert's logit."""
    config, _, _, rows, _ = sampled
    moe_config = config.moe
    logits = jnp.asarray(np.random.RandomState(1).randn(5, moe_config.num_experts), jnp.float32)
    first_layer = rows["routing"][:, 0]  # (N, T, K)
    experts = jnp.asarray(first_layer[first_layer[..., 0] >= 0][:5], jnp.int32)
    signal = jnp.asarray(np.random.RandomState(2).randn(5, moe_config.num_experts_per_tok))

    def loss(x):
        weights, chosen = moe.route(x, moe_config, experts)
        return jnp.sum(weights * signal), chosen

    grad, chosen = jax.grad(loss, has_aux=True)(logits)
    np.testing.assert_array_equal(chosen, experts)  # the replayed ones, not the top k
    assert float(jnp.abs(jnp.take_along_axis(grad, experts, axis=-1)).min()) > 0


# ------------------------------------------------------------ through the public command

STEPS = 3


def grpo_argv(directory, task, output_dir, replay=True):
    train, _ = task
    return ["train", "--objective=grpo", f"--grpo.routing_replay={replay}",
            f"--load_checkpoint=hf::{directory}", "--tokenizer=embedded",
            f"--train_dataset.json_dataset.path={train}",
            "--train_dataset.json_dataset.seq_length=16",
            "--train_dataset.json_dataset.batch_size=8", "--grpo.num_generations=2",
            f"--grpo.max_new_tokens={NEW}", "--grpo.reward_funcs=grpo_task_rewards:parity",
            f"--total_steps={STEPS}", "--save_model_freq=2", "--log_freq=1",
            "--optimizer.adamw_optimizer.lr=1e-2",
            "--optimizer.adamw_optimizer.lr_warmup_steps=1",
            f"--optimizer.adamw_optimizer.lr_decay_steps={STEPS}", "--compilation_cache_dir=",
            f"--logger.output_dir={output_dir}", "--logger.experiment_id=run"]


@pytest.fixture(scope="module")
def command_run(task, tmp_path_factory):
    """(hf directory, config, output dir, metrics by step) of STEPS GRPO steps with replay
    through `python -m easylm.train` (in this process) on the near-tied Qwen3-MoE, at the
    embedded tokenizer's vocabulary."""
    from test_checkpoint import metrics

    from easylm import train

    config = LLaMAConfig.from_preset("debug_moe", num_hidden_layers=2, initializer_range=0.2)
    directory = tmp_path_factory.mktemp("tied-512")
    save_tied(config, directory)
    output_dir = tmp_path_factory.mktemp("grpo-replay")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        train.main(grpo_argv(directory, task, output_dir))
    return directory, config, output_dir, metrics(output_dir)


def test_grpo_command_logs_the_sampler_trainer_difference_within_rounding(command_run):
    """Every step's rollouts, scored by the training forward with the sampler's choices
    replayed, agree with the engine's log-probabilities within the derived bound
    (data/rollout/sampler_logp_diff_max), and the router terms are logged."""
    directory, config, _, got = command_run
    assert sorted(got) == list(range(1, STEPS + 1))
    _, params = hf.load_hf_params(str(directory))
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (4, T))
    atol = logprob_atol(config, float(jnp.abs(FAMILY.bind(config).forward(params, ids).logits).max()))
    for step, line in got.items():
        assert 0 <= line["data/rollout/sampler_logp_diff_max"] <= atol, (step, atol)
        assert line["data/rollout/sampler_logp_diff_mean"] <= \
            line["data/rollout/sampler_logp_diff_max"]


@pytest.mark.slow  # a second interpreter and compile: ~60 s on two busy cores
def test_sigkill_then_resume_with_replay_is_bitwise(command_run, task, tmp_path, capsys):
    """`python -m easylm.train` with replay killed (SIGKILL) once step 2 is logged and its
    checkpoint complete, then the same command: the resumed step 3 is bitwise the
    uninterrupted run's (loss, gradient norm, reward, the sampler-trainer figures), so
    its rollouts and their recorded choices were the same."""
    import os
    import signal
    import sys

    from cli_utils import xla_flags
    from test_checkpoint import ENV, metrics, run_until

    from easylm import train

    directory, _, _, got = command_run
    argv = grpo_argv(directory, task, tmp_path)
    env = dict(ENV, XLA_FLAGS=xla_flags(8),
               PYTHONPATH=os.pathsep.join([ENV["PYTHONPATH"], os.path.dirname(task[0])]))
    code, _, _ = run_until([sys.executable, "-m", "easylm.train", *argv[1:]], tmp_path, 2,
                           signal.SIGKILL, env)
    assert code == -signal.SIGKILL
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        train.main(argv)
    assert f"steps 2 -> {STEPS}" in capsys.readouterr().out  # resumed, not started over
    resumed = metrics(tmp_path)
    for key in ("loss", "gradient_norm", "reward", "data/rollout/sampler_logp_diff_max",
                "data/rollout/sampler_logp_diff_mean"):
        assert resumed[STEPS][key] == got[STEPS][key], key


def test_gspo_sampling_mode_and_masked_truncations_run_with_replay(command_run, task, tmp_path):
    """GRPO with routing replay and --grpo.importance_sampling_level=sequence,
    --grpo.importance_sampling_mode=sequence_truncate, --grpo.mask_truncated_completions:
    the loss counts only the completions that ended (EOS) before max_new_tokens. At this
    random model's first step every completion runs to max_new_tokens, so no token has a
    loss, and the step is finite (the load-balancing loss over no token was 0/0 before).
    Negative twin: the same first step's rollouts without the flag (command_run) train
    on their tokens."""
    from test_checkpoint import metrics

    from easylm import train

    directory, _, _, plain = command_run
    argv = grpo_argv(directory, task, tmp_path) + [
        "--total_steps=1", "--save_model_freq=0", "--grpo.importance_sampling_level=sequence",
        "--grpo.importance_sampling_mode=sequence_truncate",
        "--grpo.mask_truncated_completions=True"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        train.main(argv)
    line, twin = metrics(tmp_path)[1], plain[1]
    rows = 8 * 2  # batch_size x num_generations
    assert line["completions/clipped_ratio"] == twin["completions/clipped_ratio"]  # the same
    ended = (1 - line["completions/clipped_ratio"]) * rows
    assert line["loss_tokens"] <= ended * NEW and np.isfinite(line["loss"])
    assert twin["loss_tokens"] > ended * NEW


# ------------------------------------------------------------ multi-turn episodes (tools)


@pytest.fixture(scope="module")
def episodes(tmp_path_factory, tools_module):
    """(config, model, params, episodes' rows with the engine's log-probabilities and
    recorded choices, the episodes, the tolerance): test_grpo_tools' 8 tool-calling
    episodes of up to 3 turns on the near-tied Qwen3-MoE at the chat tokenizer's
    vocabulary, each later turn extended onto the kept cache."""
    from test_grpo_tools import ENGINE, S, multi_turn, roll
    from tool_chat import TEMPLATE, VOCAB, make_tokenizer
    from transformers.utils import get_json_schema

    from easylm.data.conversations import ChatRenderer
    from easylm.objectives import episodes as episodes_lib

    directory = tmp_path_factory.mktemp("tied-tools")
    tools = tools_module[1]
    config = tiny_config().replace(vocab_size=VOCAB)
    save_tied(config, directory / "model")
    _, params = hf.load_hf_params(str(directory / "model"))
    model = FAMILY.bind(config)
    functions = [tools.add, tools.boom]  # (hang: its timeout would only slow the test)
    renderer = ChatRenderer(make_tokenizer(), TEMPLATE, [get_json_schema(f) for f in functions],
                            config.eos_token_id)
    engine = engine_lib.Engine(ENGINE, model, params, record_routing=True)
    eps = roll(engine, renderer, renderer.tokenizer, functions, keep=True)
    multi_turn(eps)  # some episode called a tool and was extended
    rows = episodes_lib.episode_rows(eps, S, 0, np.ones(len(eps), bool))
    logits = model.forward(params, jnp.asarray(rows["input_tokens"])).logits
    atol = logprob_atol(config, float(jnp.abs(logits).max()), length=S)
    return config, model, params, rows, eps, atol, directory / "model"


def test_episodes_record_every_fed_position(episodes):
    """Each episode's row carries K distinct recorded experts at every position it feeds
    up to its last target (prompt, sampled tokens, the appended tool messages) and -1
    past it."""
    config, _, _, rows, eps, _, _ = episodes
    routing = rows["routing"]
    assert routing.shape[1:] == (config.num_hidden_layers, rows["loss_masks"].shape[1],
                                 config.num_experts_per_tok)
    fed = np.zeros(rows["loss_masks"].shape, bool)
    for i, e in enumerate(eps):
        fed[i, :len(e.tokens) - 1] = True  # every input whose next token is in the row
    assert (routing >= 0).all(axis=(1, 3))[fed].all()
    assert not (routing >= 0).any(axis=(1, 3))[~fed].any()
    ordered = np.sort(routing[fed.nonzero()[0], :, fed.nonzero()[1]], axis=-1)
    assert (np.diff(ordered, axis=-1) > 0).all() and (ordered < config.num_experts).all()


def test_episodes_replay_matches_the_sampler_and_routing_anew_does_not(episodes):
    """Multi-turn episodes with tool calls: replaying the choices the engine recorded
    (prefill, decode steps, and each `extend` of a tool message), the trainer's
    log-probabilities of every turn's tokens are the engine's within the derived fp32
    bound. Negative twins: routing anew, and replaying all but the extended positions
    (the tool messages and the re-fed token before each, routed anew), they differ by
    far more."""
    _, model, params, rows, eps, atol, _ = episodes
    sampler = rows["sampling_logps"] * rows["loss_masks"]
    replayed = trainer_logps(model, params, rows, rows["routing"])
    assert_close(replayed, sampler, atol, scale=1.0)
    anew = trainer_logps(model, params, rows)
    extended = rows["routing"].copy()
    for i, e in enumerate(eps):
        context = np.flatnonzero(~np.asarray(e.model[:extended.shape[2]]))
        context = context[context >= e.prompt_length]  # the appended messages' tokens
        extended[i, :, np.unique(np.concatenate([context, context - 1]))] = -1
    unextended = trainer_logps(model, params, rows, extended)
    print(f"\nepisodes sampler vs trainer max |logp diff|: replay "
          f"{np.abs(replayed - sampler).max():.3g}, no replay {np.abs(anew - sampler).max():.3g}"
          f", extended positions anew {np.abs(unextended - sampler).max():.3g} "
          f"(bound {atol:.3g})")
    assert_differs(anew, sampler, atol, scale=1.0)
    assert_differs(unextended, sampler, atol, scale=1.0)


# Extended (24.5 s of CI's summed time): in CI the episodes' recorded choices replay
# within the bound (test_episodes_replay_matches_the_sampler_and_routing_anew_does_not,
# the command's rollout code), the command logs that bound's figure with replay
# (test_grpo_command_logs_the_sampler_trainer_difference_within_rounding) and runs tools
# (tests/test_grpo_tools.py::test_train_command_runs_on_through_failing_tools). What only
# this adds: the two flags in one command.
@pytest.mark.extended
def test_grpo_command_with_tools_and_replay(episodes, tools_module, tmp_path, monkeypatch):
    """python -m easylm.train --objective=grpo --grpo.routing_replay=True --grpo.tools=...
    on the near-tied Qwen3-MoE: two steps of multi-turn episodes with tool calls, each
    step's rollouts scored by the training forward replaying the sampler's choices within
    the derived bound (data/rollout/sampler_logp_diff_max)."""
    from test_checkpoint import metrics
    from test_grpo_tools import S, command

    from easylm import train

    config, model, params, _, _, _, directory = episodes
    argv = [a for a in command(tmp_path, **{
        "grpo.routing_replay": True, "grpo.temperature": 1.0,
        "grpo.tools": "grpo_test_tools:add,boom"}) if not a.startswith("--llama.")]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    train.main(argv + [f"--load_checkpoint=hf::{directory}"])
    got = metrics(tmp_path)
    assert sorted(got) == [1, 2]
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (4, S))
    atol = logprob_atol(config, float(jnp.abs(model.forward(params, ids).logits).max()),
                        length=S)
    print(f"\ncommand with tools: sampler_logp_diff_max "
          f"{[line['data/rollout/sampler_logp_diff_max'] for line in got.values()]} "
          f"(bound {atol:.3g})")
    for step, line in got.items():
        assert 0 <= line["data/rollout/sampler_logp_diff_max"] <= atol, (step, line)
    assert sum(line["data/rollout/tool_calls"] for line in got.values()) > 0
