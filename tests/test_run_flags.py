"""The run flags (--seed, --mesh_dim, --dtype, --param_dtype, --load_checkpoint,
--tokenizer) read the same in every command that takes them: one shared text, and at
most a note on how the command differs."""

import pytest

from easylm import bench, flags, plan
from easylm.llama import eval as eval_cli, train
from easylm.llama.family import FAMILY
from easylm.runtime import run_flags
from easylm.serving import cli as serving_cli, decode_bench

# command -> (its flag tree, its help entries), both as the command builds them
COMMANDS = {
    "train": lambda: (train.default_config(), train.help_entries()),
    "plan": lambda: (plan.default_config(FAMILY), plan.help_entries(FAMILY)),
    "bench train": lambda: (bench.train_config(FAMILY), bench._train_help(FAMILY)),
    "bench decode": lambda: (decode_bench.default_config(FAMILY),
                             decode_bench.help_entries(FAMILY)),
    "serve": lambda: (serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY)),
    "eval": lambda: (eval_cli.default_config(), eval_cli.help_entries()),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_run_flag_has_the_shared_help(command):
    config, entries = COMMANDS[command]()
    taken = [name for name in run_flags.HELP if name in flags.flatten(config)]
    assert taken, f"{command} takes none of the run flags"
    for name in taken:
        shared = run_flags.HELP[name]
        assert entries[name] == shared or entries[name].startswith(shared + "; "), \
            f"{command} --{name}: {entries[name]!r}"


def test_the_trainer_takes_all_six_with_their_shared_defaults():
    config = train.default_config()
    assert {name: config[name] for name in run_flags.DEFAULTS} == run_flags.DEFAULTS


def test_the_engine_commands_state_how_they_differ_in_the_same_words():
    # The server, the eval command and the decode benchmark build the same engine.
    helps = [COMMANDS[c]()[1] for c in ("serve", "eval", "bench decode")]
    for name in ("mesh_dim", "dtype"):
        assert len({h[name] for h in helps}) == 1
    assert serving_cli.default_config(FAMILY).mesh_dim == \
        decode_bench.default_config(FAMILY).mesh_dim == serving_cli.ENGINE_MESH_DIM


def test_a_flag_outside_the_six_is_refused():
    with pytest.raises(ValueError, match="lr"):
        run_flags.get_default_config("seed", lr=1.0)
    with pytest.raises(ValueError, match="dtype"):
        run_flags.help_entries("seed", dtype="a note on a flag not taken")
