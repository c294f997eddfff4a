"""`python -m easylm.plot`: two runs' metrics.jsonl (as the trainer writes them) overlaid in
one PNG, read back and checked pixel by pixel; one clear line for each bad run directory."""

import json

import numpy as np
from cli_utils import one_line_error
from PIL import Image

from easylm import plot

# matplotlib's first two cycle colours: run 1, run 2.
COLORS = {"C0": (0x1F, 0x77, 0xB4), "C1": (0xFF, 0x7F, 0x0E)}


def write_run(directory, lr, steps=20, cut_last_line=False):
    """metrics.jsonl as the trainer logs it: a train line per step (tokens/s unknown on the
    first, which compiles), an eval line every 5 steps, NaN as a string."""
    directory.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        lines.append({"step": step, "loss": 6.0 / step ** (lr * 100), "accuracy": 0.1,
                      "learning_rate": lr * min(1.0, step / 5),
                      "gradient_norm": "nan" if step == 7 else 1.0 + 1.0 / step,
                      "tokens_seen": step * 4096, "mfu": None,
                      "tokens_per_second": None if step == 1 else 9000.0 + 50 * step})
        if step % 5 == 0:
            lines.append({"step": step, "eval_loss": 5.0 / step ** (lr * 90), "eval_tokens": 512})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (directory / "metrics.jsonl").write_text(text + ('{"step": 21, "lo' if cut_last_line else ""))
    return str(directory)


def pixels(path, color) -> int:
    image = np.asarray(Image.open(path).convert("RGB")).astype(int)
    return int((np.abs(image - np.array(COLORS[color])).sum(axis=-1) < 30).sum())


def test_two_runs_overlaid_in_one_png(tmp_path, capsys):
    runs = [write_run(tmp_path / "base", 3e-3), write_run(tmp_path / "fast", 1e-2, cut_last_line=True)]
    output = str(tmp_path / "runs.png")
    plot.main(["plot", *runs, f"--output={output}"])
    assert capsys.readouterr().out == f"wrote {output} (2 runs)\n"
    image = Image.open(output)
    assert image.format == "PNG" and image.size == (1200, 800)
    rgb = np.asarray(image.convert("RGB"))
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50  # not blank: axes, text, lines
    # Both runs drawn: five panels of lines in each run's colour.
    assert pixels(output, "C0") > 2000 and pixels(output, "C1") > 2000
    # The check can fail: one run alone leaves no pixel of the second colour.
    single = str(tmp_path / "one.png")
    plot.main(["plot", runs[0], f"--output={single}"])
    assert pixels(single, "C0") > 2000 and pixels(single, "C1") == 0


def test_reads_what_the_trainer_writes(tmp_path):
    series = plot.read_metrics(write_run(tmp_path / "run", 3e-3, cut_last_line=True))
    assert [s for s, _ in series["eval_loss"]] == [5, 10, 15, 20]
    assert [s for s, _ in series["tokens_per_second"]] == list(range(2, 21))  # None: a gap
    assert 7 not in [s for s, _ in series["gradient_norm"]]  # "nan": a gap
    assert "mfu" not in series and len(series["loss"]) == 20  # the cut last line: left out


def expect_error(argv, capsys) -> str:
    return one_line_error(plot.main, ["plot", *argv], capsys)


def test_bad_runs_are_one_line(tmp_path, capsys):
    good = write_run(tmp_path / "good", 3e-3)
    out = f"--output={tmp_path / 'x.png'}"
    assert expect_error([out], capsys).startswith("no run directory given; usage:")
    assert expect_error([str(tmp_path / "missing"), out], capsys).startswith(
        f"{tmp_path / 'missing'}: no metrics.jsonl there")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert expect_error([good, str(tmp_path / "empty"), out], capsys) == (
        f"{tmp_path / 'empty' / 'metrics.jsonl'} holds no logged steps yet")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{oops\n{"step": 3}\n')
    assert expect_error([str(tmp_path / "bad"), out], capsys) == (
        f"{tmp_path / 'bad' / 'metrics.jsonl'}, line 2: not JSON (Expecting property name "
        f"enclosed in double quotes)")
    assert expect_error([good, "--output=plot.jpg"], capsys) == \
        "--output='plot.jpg' must be a .png file"
    assert expect_error([good, f"--output={tmp_path}/no/dir/p.png"], capsys).startswith(
        f"--output='{tmp_path}/no/dir/p.png': directory")
    assert not (tmp_path / "x.png").exists()


def test_grpo_runs_add_reward_length_and_kl_panels(tmp_path):
    run = tmp_path / "grpo"
    run.mkdir()
    lines = [{"step": s, "loss": 0.01, "learning_rate": 1e-3, "gradient_norm": 1.0,
              "tokens_per_second": 900.0, "reward": 0.4 + 0.02 * s,
              "completions/mean_length": 8.0 - 0.1 * s, "kl": 1e-3 * s} for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = plot.plot([str(run)], str(tmp_path / "grpo.png"))
    image = Image.open(output)
    assert image.size == (1200, 1200)  # a third row of panels
    rgb = np.asarray(image.convert("RGB")).astype(int)
    bottom = rgb[800:]  # reward is drawn in the second row's third cell; length, KL here
    assert (np.abs(bottom - np.array(COLORS["C0"])).sum(axis=-1) < 30).sum() > 300
    # The twin: a run without rewards keeps the two rows.
    assert Image.open(plot.plot([write_run(tmp_path / "lm", 3e-3)],
                                str(tmp_path / "lm.png"))).size == (1200, 800)
