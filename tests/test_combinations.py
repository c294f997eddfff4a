"""Where features meet: objectives x data types x variants x layouts x accumulation, each
through the commands a user runs next (train, resume, the printed serve and eval lines,
plan, preview), on the tiny debug model.

Every combination would be 4 x 8 x 3 x 2 x 2 runs; the 14 cases below are chosen so
that every pair of values of any two of (objective, variant, scanned layers,
accumulation) meets in some case, and every data type trains with every objective that
reads it (checked by `test_the_cases_cover_every_pair`, which fails when a value is added
to a factor and no case takes it). A combination the trainer cannot run is refused at
startup in one line (the REFUSED table).
"""

import contextlib
import io
import itertools
import json
import re
import shlex

import pytest

from easylm import flags as flag_lib, plan
from easylm.data import preview
from easylm.data.cache import build
from easylm.data.embedded.stories import documents
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError
from easylm.llama import eval as eval_cli, train
from easylm.llama.family import FAMILY
from easylm.serving import cli as serving_cli
from easylm.training import trainer

OBJECTIVES = ("next_token", "dpo", "simpo", "orpo")
DOCUMENTS = ("json", "chat", "huggingface", "cache", "mixture")  # next-token data
PAIRS = ("pairs", "chat_pairs", "hf_pairs")  # preference data
VARIANTS = {"full": [], "lora": ["--lora.rank=4"],
            "qlora": ["--lora.rank=4", "--lora.base_dtype=nf4"]}

# (objective, data, variant, scan_layers, accumulate_gradient_steps): each objective with
# each variant, the layouts and accumulation spread so that every pair of those four
# factors' values meets, and the two data types left over on next-token runs of their own.
CASES = [
    ("next_token", "json", "full", False, 1),
    ("next_token", "chat", "lora", True, 2),
    ("next_token", "huggingface", "qlora", False, 2),
    ("dpo", "pairs", "full", True, 2),
    ("dpo", "chat_pairs", "lora", True, 1),
    ("dpo", "hf_pairs", "qlora", False, 1),
    ("simpo", "hf_pairs", "full", False, 2),
    ("simpo", "pairs", "lora", False, 1),
    ("simpo", "chat_pairs", "qlora", True, 1),
    ("orpo", "chat_pairs", "full", True, 1),
    ("orpo", "hf_pairs", "lora", False, 2),
    ("orpo", "pairs", "qlora", True, 2),
    ("next_token", "cache", "lora", False, 1),
    ("next_token", "mixture", "qlora", True, 1),
]

# Combinations refused at startup: (objective, data) -> the one line.
NOT_PAIRS = ("--train_dataset.preference.enabled=True reads pairs from a json or "
             "huggingface source, not --train_dataset.type=")
REFUSED = {
    ("dpo", "cache"): NOT_PAIRS + "cache",
    ("orpo", "mixture"): NOT_PAIRS + "mixture",
    ("next_token", "pairs"): (
        "--train_dataset.preference.enabled=True makes batches of preference pairs, which "
        "train with --objective=dpo, simpo, orpo, not the default --objective=next_token"),
    # Text read as pairs: every example is skipped, so the first batch cannot be made.
    ("simpo", "json"): (
        "no usable document for row 0 of the batch: it reads documents 0, 16, 32, ... of "
        "each epoch (4 of the 64), and all were skipped (* skips so far, the first: {path}:1: "
        "missing field 'prompt'; the example has: text): fix the data"),
}


def test_the_cases_cover_every_pair():
    resumed = [case for case in CASES if case[-1] == 2]
    for i, values in ((0, OBJECTIVES), (2, tuple(VARIANTS)), (3, (False, True))):
        assert {case[i] for case in resumed} == set(values)
    factors = {"objective": OBJECTIVES, "variant": tuple(VARIANTS), "scan": (False, True),
               "accumulate": (1, 2)}
    index = {"objective": 0, "variant": 2, "scan": 3, "accumulate": 4}
    for (a, values_a), (b, values_b) in itertools.combinations(factors.items(), 2):
        met = {(case[index[a]], case[index[b]]) for case in CASES}
        missing = set(itertools.product(values_a, values_b)) - met
        assert not missing, (a, b, sorted(missing, key=str))
    # Each data type with an objective that reads it; each preference objective on text
    # pairs, chat pairs and a HF dataset of pairs.
    trained = {(objective, data) for objective, data, *_ in CASES}
    want = {("next_token", d) for d in DOCUMENTS} | {(o, d) for o in OBJECTIVES[1:]
                                                     for d in PAIRS}
    assert trained == want, want ^ trained


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Each data type's flags (a next-token run's train_dataset.*)."""
    import datasets

    root = tmp_path_factory.mktemp("data")
    tokenizer = load_tokenizer("embedded")
    texts = list(documents(64, seed=3))
    text_rows = [{"text": t} for t in texts]
    chat_rows = [{"messages": [{"role": "user", "content": t[:40]},
                               {"role": "assistant", "content": t[40:120]}]} for t in texts]
    pair_rows = [{"prompt": t[:40], "chosen": t[40:90], "rejected": u[40:80]}
                 for t, u in zip(texts, texts[1:])]
    chat_pair_rows = [{"prompt": p["prompt"], "chosen": [{"role": "assistant",
                                                           "content": p["chosen"]}],
                       "rejected": p["rejected"]} for p in pair_rows]

    def jsonl(name, rows):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    def saved(name, rows):
        path = root / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
        return str(path)

    build({"json_dataset": {"path": jsonl("text", text_rows)}}, tokenizer, str(root / "cache"),
          shard_size=32, progress=False)
    mixture = [dict(name="text", weight=0.5, path=str(root / "text.jsonl")),
               dict(name="cache", weight=0.5, type="cache", path=str(root / "cache"))]
    pairs = ["--train_dataset.preference.enabled=True"]
    chat = ["--train_dataset.text_processor.chat=True"]
    return {
        "json": ["--train_dataset.json_dataset.path=" + jsonl("text", text_rows)],
        "chat": [*chat, "--train_dataset.json_dataset.path=" + jsonl("chat", chat_rows)],
        "huggingface": ["--train_dataset.type=huggingface",
                        "--train_dataset.huggingface_dataset.path=" + saved("hf", text_rows)],
        "cache": ["--train_dataset.type=cache", f"--train_dataset.cache.path={root / 'cache'}"],
        "mixture": ["--train_dataset.type=mixture",
                    "--train_dataset.mixture.sources=" + json.dumps(mixture)],
        "pairs": [*pairs, "--train_dataset.json_dataset.path=" + jsonl("pairs", pair_rows)],
        "chat_pairs": [*pairs, *chat,
                       "--train_dataset.json_dataset.path=" + jsonl("chat_pairs",
                                                                    chat_pair_rows)],
        "hf_pairs": [*pairs, "--train_dataset.type=huggingface",
                     "--train_dataset.huggingface_dataset.path=" + saved("hf_pairs",
                                                                         pair_rows)],
    }


def with_sizes(argv: list[str]) -> list[str]:
    """Rows of 32 tokens, 16 a batch, in whichever block the data type reads."""
    block = next((a.split("=")[1] for a in argv if a.startswith("--train_dataset.type=")),
                 "json")
    block = {"json": "json_dataset", "huggingface": "huggingface_dataset"}.get(block, block)
    return [*argv, f"--train_dataset.{block}.seq_length=32",
            f"--train_dataset.{block}.batch_size=16"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A HF directory of the debug shape (random weights), every case's starting point:
    a LoRA run's serve and eval lines name their base, which must be on disk."""
    import torch
    from transformers import LlamaForCausalLM

    from easylm.llama.config import LLaMAConfig

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("base")
    config = LLaMAConfig.from_preset("debug", num_hidden_layers=1)  # a layer: less to compile
    LlamaForCausalLM(config.to_hf_config()).save_pretrained(directory)
    return directory


def case_argv(tmp_path, data, base, case) -> list[str]:
    objective, kind, variant, scan, accumulate = case
    return with_sizes([
        "train", f"--load_checkpoint=hf::{base}", "--tokenizer=embedded",
        f"--objective={objective}",
        *data[kind], *VARIANTS[variant], f"--llama.scan_layers={scan}",
        f"--optimizer.accumulate_gradient_steps={accumulate}", "--log_freq=1", "--save_model_freq=1",
        "--dtype=fp32", "--mesh_dim=-1,1,1", f"--logger.output_dir={tmp_path}",
        "--logger.experiment_id=run", f"--compilation_cache_dir={tmp_path / 'xla'}"])


def run(argv) -> tuple[str, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        final = trainer.train(train.parse_flags(argv), FAMILY)
    return final, out.getvalue()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_combination_trains_resumes_serves_evaluates_plans_and_previews(
        case, data, base, tmp_path, capsys):
    argv = case_argv(tmp_path, data, base, case)
    # Half the cases (those accumulating, which meet every objective, variant and layout)
    # stop after a step and resume; the others train their two steps at once.
    resume = case[-1] == 2
    if resume:
        run([*argv, "--total_steps=1"])
    _, resumed = run([*argv, "--total_steps=2"])
    assert (f"loading trainstate::{tmp_path}/run/checkpoints/1" in resumed) == resume, resumed
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [row["step"] for row in steps if "loss" in row] == [1, 2]
    assert all(map(_finite, (row["loss"] for row in steps if "loss" in row)))
    lines = {line.split(":", 1)[0]: shlex.split(line.split(":", 1)[1])[3:]
             for line in resumed.splitlines() if line.startswith(("serve it:", "eval it:"))}
    assert sorted(lines) == ["eval it", "serve it"], resumed
    assert f"{tmp_path}/run/checkpoints/2" in " ".join(lines["serve it"])
    serve = flag_lib.parse(serving_cli.default_config(FAMILY), serving_cli.help_entries(FAMILY),
                           ["serve", *lines["serve it"], "--pre_compile=False"])
    assert serving_cli.load_engine(FAMILY, serve)[0].params is not None
    evaluate = flag_lib.parse(eval_cli.model_config(), eval_cli.help_entries(),
                              ["eval", *lines["eval it"][:-1], "--pre_compile=False"])
    assert eval_cli.load(evaluate).engine.params is not None
    # plan takes the trainer's flags; exit 0: fits (no device memory known on a CPU).
    with pytest.raises(SystemExit) as exit_code:
        plan.main([a for a in argv if not a.startswith("--compilation_cache_dir")])
    assert exit_code.value.code == 0
    assert "per device" in capsys.readouterr().out
    # preview takes the data flags and the tokenizer.
    preview.main(["preview", "--tokenizer=embedded",
                  *[a for a in argv if a.startswith("--train_dataset.")]])
    shown = capsys.readouterr().out
    assert "target tokens:" in shown and "with loss:" in shown, shown


def _finite(x: float) -> bool:
    return x == x and abs(x) < float("inf")


@pytest.mark.parametrize("objective, kind", REFUSED)
def test_a_combination_that_cannot_run_is_refused_in_one_line(objective, kind, data, base,
                                                              tmp_path):
    argv = case_argv(tmp_path, data, base, (objective, kind, "full", False, 1))
    with pytest.raises(UserError) as error:
        trainer.train(train.parse_flags([*argv, "--total_steps=1"]), FAMILY)
    path = next((a.split("=", 1)[1] for a in data[kind] if ".path=" in a), "")
    want = re.escape(REFUSED[objective, kind].format(path=path)).replace(r"\*", r"\d+")
    assert re.fullmatch(want, str(error.value)), str(error.value)
