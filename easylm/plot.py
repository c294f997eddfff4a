"""Plot training runs from their metrics.jsonl: `python -m easylm.plot RUN_DIR [RUN_DIR ...]`.

    python -m easylm.plot runs/llama-1a2b3c                      # -> metrics.png
    python -m easylm.plot runs/baseline runs/lr-2x --output=lr.png

One PNG: loss, eval loss, learning rate, gradient norm and tokens/s against the step,
the runs overlaid (one colour each); with GRPO runs among them, also reward, completion
length and KL. For runs logged to neither W&B nor TensorBoard;
the trainer writes metrics.jsonl in every run directory (or in --logger.wandb_dir).
"""

import json
import os
import sys

from ml_collections import ConfigDict

from easylm import flags as flag_lib
from easylm.errors import UserError, exit_on_user_error

USAGE = "usage: python -m easylm.plot RUN_DIR [RUN_DIR ...] [--output=PNG]"
HELP = {"output": "the PNG to write"}
# (metrics.jsonl key, panel title), in panel order.
PANELS = (("loss", "loss"), ("eval_loss", "eval loss"), ("learning_rate", "learning rate"),
          ("gradient_norm", "gradient norm"), ("tokens_per_second", "tokens/s"))
# Added where a run logged rewards (--objective=grpo; docs/rl.md names each metric).
RL_PANELS = (("reward", "reward"), ("completions/mean_length", "completion length"),
             ("kl", "KL"))


def default_config() -> ConfigDict:
    config = ConfigDict()
    config.output = "metrics.png"
    return config


def read_metrics(run: str) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value)]} of the numbers in RUN/metrics.jsonl (a run directory or the
    file itself). A last line cut short (a run still writing) is left out."""
    path = run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{run}: no metrics.jsonl there (expected a run directory of "
                        f"python -m easylm.llama.train, or its --logger.wandb_dir)")
    with open(path) as f:
        lines = [line for line in f.read().split("\n")]
    series: dict[str, list] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                continue
            raise UserError(f"{path}, line {number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UserError(f"{path}, line {number}: expected an object with an integer 'step'")
        for key, value in record.items():
            # None (not measured yet) and strings ("nan") are gaps in the line.
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((record["step"], value))
    if not series:
        raise UserError(f"{path} holds no logged steps yet")
    return series


def labels(runs: list[str]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [os.path.basename(os.path.normpath(r).removesuffix("/metrics.jsonl")) for r in runs]
    return [n if names.count(n) == 1 else r for n, r in zip(names, runs)]


def plot(runs: list[str], output: str) -> str:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    if not output.endswith(".png"):
        raise UserError(f"--output={output!r} must be a .png file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise UserError(f"--output={output!r}: directory {os.path.dirname(output)!r} does not exist")
    metrics = [read_metrics(run) for run in runs]
    panels = PANELS + (RL_PANELS if any("reward" in m for m in metrics) else ())
    rows = -(-(len(panels) + 1) // 3)  # and a cell for the legend
    figure = Figure(figsize=(12, 4 * rows), dpi=100, layout="constrained")
    axes = list(figure.subplots(rows, 3).flat)
    for ax in axes[len(panels) + 1:]:
        ax.axis("off")
    for ax, (key, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for color, (label, series) in enumerate(zip(labels(runs), metrics)):
            points = series.get(key, [])
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, color=f"C{color}", label=label,
                        marker="o" if len(points) < 30 else None, markersize=3)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
    legend = axes[len(panels)]
    legend.axis("off")
    handles = [line for ax in figure.axes[:len(panels)] for line in ax.lines]
    by_label = {line.get_label(): line for line in handles}
    legend.legend(by_label.values(), by_label.keys(), loc="center", title="runs")
    figure.savefig(output)
    return output


@exit_on_user_error
def main(argv=None):
    argv = list(argv or sys.argv)
    runs = [a for a in argv[1:] if not a.startswith("-")]
    config = flag_lib.parse(default_config(), HELP, [argv[0]] + [a for a in argv[1:]
                                                                 if a.startswith("-")], USAGE)
    if not runs:
        raise UserError(f"no run directory given; {USAGE}")
    print(f"wrote {plot(runs, config.output)} ({len(runs)} run{'s' * (len(runs) > 1)})")


if __name__ == "__main__":
    main()
