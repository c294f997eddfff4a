"""The objectives' registry (easylm/objectives/__init__.py): each objective a class, imported
only when chosen, reached by name or as MODULE:CLASS; and the proof that adding one is one
file, a test-only objective (tests/toy_objective.py) that trains through the public train
command and shows its line in the plan, on the test-only family (tests/toy_family.py)."""

import ast
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import toy_family
import toy_objective
from cli_utils import one_line_error

from easylm import model_flags
from easylm import flags as flag_lib, objectives, plan, train
from easylm.errors import UserError
from easylm.objectives.next_token import NextToken
from easylm.objectives.preference import DPO
from easylm.training.options import default_config, family_run_defaults, help_entries

PACKAGE = pathlib.Path(objectives.__file__).resolve().parent.parent
REPO = PACKAGE.parent
TOY = toy_family.FAMILY
OBJECTIVE = "--objective=toy_objective:LabelSmoothed"
ROWS = ["--train_dataset.json_dataset.seq_length=32", "--train_dataset.json_dataset.batch_size=8"]


def test_names_and_module_class_reach_the_classes_and_bad_ones_are_one_line():
    assert objectives.get("dpo") is DPO and objectives.get("next_token") is NextToken
    assert objectives.get("toy_objective:LabelSmoothed") is toy_objective.LabelSmoothed
    with pytest.raises(UserError, match="^--objective=toy_objective:Nope: module "):
        objectives.get("toy_objective:Nope")
    with pytest.raises(UserError, match="toy_objective.UserError is not an "
                                                   "Objective class$"):
        objectives.get("toy_objective:UserError")


def test_an_objective_is_imported_only_when_chosen():
    # What next-token training imports of easylm.objectives: the registry, the interface,
    # its own module, the router losses it adds for a mixture of experts and the indexer
    # loss for a sparse attention model; not DPO's reference tables, GRPO's rollouts or
    # its rewards.
    code = ("import sys; from easylm import objectives; objectives.get('next_token'); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('easylm.objectives'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out == ["easylm.objectives", "easylm.objectives.base",
                   "easylm.objectives.indexer_loss", "easylm.objectives.next_token",
                   "easylm.objectives.router_loss"], out


def scan_name_branches(source: str, filename: str = "<source>") -> list[str]:
    """Comparisons that branch on which objective a run trains: an operand that is a
    registered objective's name, or the objective itself (`objective`, `<x>.objective`)
    compared with anything but the registry's own tables: REGISTRY (is it registered?) and
    DEFAULT (whether a message calls it 'the default')."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(isinstance(o, ast.Constant) and o.value in objectives.REGISTRY
                    for o in operands)
        chosen = any(isinstance(o, ast.Attribute) and o.attr == "objective"
                     or isinstance(o, ast.Name) and o.id == "objective" for o in operands)
        registry = any(isinstance(o, ast.Name) and o.id in ("REGISTRY", "DEFAULT")
                       for o in operands)
        if named or (chosen and not registry):
            found.append(f"{filename}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_generic_code_branches_on_the_objectives_name():
    # Generic code: all of easylm/ but the objectives' own modules, which may name
    # themselves (GRPO's loss_type 'grpo', the preference losses' table).
    own = {f"{target.partition(':')[0].replace('.', '/')}.py"
           for target in objectives.REGISTRY.values()}
    found = [hit for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(REPO)) not in own
             for hit in scan_name_branches(path.read_text(), str(path.relative_to(REPO)))]
    assert found == []


def test_the_name_branch_scan_finds_them():
    # Negative twin: each form the registry replaced is caught.
    source = ('if config.objective == "grpo":\n    pass\n'
              'x = config.objective in (NEXT_TOKEN, GRPO)\n'
              'y = objective != "next_token"\n'
              'z = config.objective == DEFAULT\n')
    hits = scan_name_branches(source)
    assert [hit.split()[0] for hit in hits] == ["<source>:1", "<source>:3", "<source>:4"], hits


# ------------------------------------------------- the test-only objective, end to end


def test_the_toy_objective_at_epsilon_0_is_the_next_token_loss():
    # Its own loss (log_softmax) against the next-token loss (logsumexp): the same sum of
    # 8 x 32 token losses summed in another order, so fp32 agreement to ~n·eps relative.
    config = flag_lib.parse(default_config(TOY, "toy_objective:LabelSmoothed"),
                            help_entries(TOY, "toy_objective:LabelSmoothed"),
                            ["train", OBJECTIVE, "--label_smoothing.epsilon=0", *ROWS])
    model = model_flags.build(TOY, config)
    params = model.init_params(jax.random.key(0))
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, model.vocab_size, (8, 33))
    batch = dict(input_tokens=tokens[:, :-1], target_tokens=tokens[:, 1:],
                 loss_masks=(rng.uniform(size=(8, 32)) < 0.8).astype(np.float32))
    toy = objectives.build(config, model, None)
    assert isinstance(toy, toy_objective.LabelSmoothed)
    smoothed = toy.loss_fn(params, batch, jax.random.key(1), {})
    plain = NextToken(model).loss_fn(params, batch, jax.random.key(1), {})
    bound = 256 * 1.2e-7  # n·eps for n <= 8 x 32 terms
    assert float(smoothed.loss) == pytest.approx(float(plain.loss), rel=bound)
    assert float(smoothed.correct) == float(plain.correct)
    # Negative twin: smoothing at 0.1 moves the loss past that bound (at initialisation
    # the model is near uniform, where smoothing changes little: measured 2e-4 relative).
    toy.epsilon = 0.1
    moved = toy.loss_fn(params, batch, jax.random.key(1), {})
    assert float(moved.loss) != pytest.approx(float(plain.loss), rel=bound)


def test_a_new_objective_trains_through_the_train_command(tmp_path, capsys):
    train.main(["train", "--family=toy_family:FAMILY", OBJECTIVE, *ROWS, "--total_steps=3",
                "--log_freq=1", "--mesh_dim=1,-1,1", "--optimizer.adamw_optimizer.lr=1e-2",
                "--optimizer.adamw_optimizer.lr_warmup_steps=1", "--dpo.beta=0.5",
                f"--logger.output_dir={tmp_path}", "--logger.experiment_id=toy"])
    out = capsys.readouterr().out
    assert "| objective label-smoothed next token (epsilon 0.1)" in out, out
    # another objective's flag trains, and is said to be ignored
    assert [line for line in out.splitlines() if "ignored" in line] == [
        "warning: --dpo.beta=0.5 is ignored: only --objective=dpo reads it, this run "
        "trains --objective=toy_objective:LabelSmoothed"], out
    lines = (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()
    losses = [row["loss"] for row in map(json.loads, lines) if "loss" in row]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    # Its flags are its own: checked in one line, and only there when it is chosen.
    argv = ["train", "--family=toy_family:FAMILY", *ROWS, f"--logger.output_dir={tmp_path}"]
    assert one_line_error(train.main, [*argv, OBJECTIVE, "--label_smoothing.epsilon=1"],
                          capsys) == "--label_smoothing.epsilon must be in [0, 1), got 1.0"
    assert "label_smoothing.epsilon" in one_line_error(
        train.main, [*argv, "--label_smoothing.epsilon=0.2"], capsys)


def test_a_new_objective_shows_its_line_in_the_plan(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["plan", "--family=toy_family:FAMILY", OBJECTIVE, *ROWS,
                   "--plan.device_memory_gib=1", "--plan.num_devices=1"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert " | 8 documents (label smoothing 0.1) x 32 tokens per step | " in out, out
    # and the run directory's name leaves the registered objectives' options out
    config = flag_lib.parse(default_config(TOY, "toy_objective:LabelSmoothed"),
                            help_entries(TOY, "toy_objective:LabelSmoothed"),
                            ["train", OBJECTIVE, *ROWS], derived=family_run_defaults(TOY))
    assert set(objectives.unused_flags(config)) == {"dpo.", "simpo.", "orpo.", "grpo.",
                                                    "distill."}


@pytest.mark.parametrize("argv, warned", [
    ([], []),
    (["--objective=dpo", "--dpo.beta=0.5", "--train_dataset.preference.enabled=True"], []),
    (["--simpo.gamma=0.5", "--dpo.beta=0.1"], ["--simpo.gamma=0.5 is ignored: only "
                                               "--objective=simpo reads it"]),
    (["--lora.alpha=32"], ["--lora.alpha=32.0 is ignored: the lora variant is off"]),
    (["--lora.rank=4", "--lora.alpha=32"], []),
])
def test_flags_this_run_does_not_read_are_warned_about(argv, warned):
    from easylm.llama.family import FAMILY
    from easylm.training.options import parse_flags, warn_about_ignored_flags

    lines = []
    warn_about_ignored_flags(parse_flags(FAMILY, ["train", *argv]), FAMILY, lines.append)
    # --dpo.beta=0.1 is its default: nothing to say
    assert [line.removeprefix("warning: ").split(", this run")[0] for line in lines] == warned


def test_its_flags_come_with_the_command_lines_objective(tmp_path, capsys):
    assert objectives.named_in(["x", "--objective", "a:B", "--objective=c:D"]) == "c:D"
    assert objectives.named_in(["x", "--objective", "a:B"]) == "a:B"
    assert objectives.named_in(["x", "--objectives=a:B"]) is None
    # Named only in a flagfile, a MODULE:CLASS's flags are not defined: one line, not a
    # traceback from the first read of them.
    flagfile = tmp_path / "flags"
    flagfile.write_text(f"{OBJECTIVE}\n")
    message = one_line_error(train.main, ["train", "--family=toy_family:FAMILY",
                                          f"--flagfile={flagfile}", *ROWS], capsys)
    assert message == ("--objective=toy_objective:LabelSmoothed: its flags "
                       "--label_smoothing.* are not defined; give --objective on the "
                       "command line, not in a --flagfile")
