"""Training logs: Weights & Biases (offline unless `--logger.online`), `metrics.jsonl`,
TensorBoard event files (`--logger.tensorboard`), a one-line summary per log step, and a
tqdm progress bar.

Only process 0 writes; the others keep quiet, unless `--log_all_worker`: then
process i > 0 also prints (prefixed `[process i]`) and writes
`metrics.process<i>.jsonl` and TensorBoard files in `process<i>/` (W&B stays one run,
process 0's). wandb is called
directly (mlxu's WandBLogger passes a `start_method` setting current wandb rejects).
`WANDB_MODE=disabled` in the environment turns wandb off entirely. Each metrics.jsonl
row carries `time`, the wall-clock time (Unix seconds) it was written.
"""

import json
import math
import numbers
import os
import re
import time

import jax
from ml_collections import ConfigDict
from tqdm import tqdm

from easylm.errors import UserError

HELP = {
    "online": "sync to Weights & Biases as the run goes (default: write offline; "
              "`wandb sync DIR` uploads later)",
    "project": "W&B project name",
    "entity": "W&B entity (user or team); empty: your default",
    "prefix": "prepended to the project name as PREFIX_PROJECT (EasyLM's convention)",
    "output_dir": "runs are written to OUTPUT_DIR/EXPERIMENT_ID",
    "experiment_id": "the run's name and W&B id; empty: derived from the flags, so the "
                     "same command writes (and resumes) in the same directory",
    "notes": "W&B notes for the run",
    "wandb_dir": "local directory for W&B files and metrics.jsonl; empty: the run directory "
                 "(set it when --logger.output_dir is a bucket)",
    "tensorboard": "also write TensorBoard event files beside metrics.jsonl: every logged "
                   "metric as a scalar, the flags as text (`tensorboard --logdir=OUTPUT_DIR`)",
}

# Shown in the one-line summary, in this order, when present.
# (Preference objectives log rewards/* instead of accuracy and perplexity.) A mixture of
# experts' `loss` is the total the gradient sees; its parts follow it (router_loss.py).
_SUMMARY = (("loss", "loss {:.4f}"), ("ce_loss", "ce_loss {:.4f}"),
            ("preference_loss", "preference_loss {:.4f}"),
            ("policy_loss", "policy_loss {:.4f}"), ("aux_loss", "aux_loss {:.3f}"),
            ("z_loss", "z_loss {:.3f}"), ("indexer_loss", "indexer_loss {:.4f}"),
            ("accuracy", "acc {:.3f}"),
            ("rewards/accuracy", "reward acc {:.3f}"), ("rewards/margin", "margin {:.3f}"),
            ("reward", "reward {:.3f}"), ("completions/mean_length", "length {:.1f}"),
            ("kl", "kl {:.2e}"), ("moe_load_min", "expert load min {:,.0f}"),
            ("moe_load_max", "max {:,.0f}"),
            ("moe_dropped", "dropped {:,.0f}"), ("learning_rate", "lr {:.2e}"),
            ("gradient_norm", "grad_norm {:.3f}"),
            ("tokens_per_second", "tokens/s {:,.0f}"))
_EVAL_SUMMARY = (("eval_loss", "eval loss {:.4f}"), ("eval_ce_loss", "ce_loss {:.4f}"),
                 ("eval_preference_loss", "preference_loss {:.4f}"),
                 ("eval_aux_loss", "aux_loss {:.3f}"), ("eval_accuracy", "acc {:.3f}"),
                 ("eval_rewards/accuracy", "reward acc {:.3f}"),
                 ("eval_rewards/margin", "margin {:.3f}"), ("eval_reward", "reward {:.3f}"),
                 ("eval_perplexity", "perplexity {:.2f}"), ("eval_tokens", "tokens {:,.0f}"),
                 ("eval_pairs", "pairs {:,.0f}"))


def get_default_config(updates=None) -> ConfigDict:
    config = ConfigDict()
    config.online = False
    config.project = "easylm"
    config.entity = ""
    config.prefix = ""
    config.output_dir = "runs"
    config.experiment_id = ""
    config.notes = ""
    config.wandb_dir = ""
    config.tensorboard = False
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def _format(fmt: str, value) -> str:
    """A number as `fmt` says; anything else (NaN and Inf are kept as strings) as it is."""
    if isinstance(value, (int, float)):
        return fmt.format(value)
    return re.sub(r"\{[^}]*\}", "{}", fmt).format(value)


def format_metrics(step: int, metrics: dict) -> str:
    parts = [f"step {step}"]
    if "harness/seconds" in metrics:  # --eval_harness: every task's numbers, then the time
        return " | ".join(parts + [f"{k[len('harness/'):]} {_format('{:.4g}', v)}"
                                   for k, v in metrics.items() if k != "harness/seconds"]
                          + [f"lm-eval {metrics['harness/seconds']:.1f}s"])
    if "eval_loss" in metrics:
        return " | ".join(parts + [_format(fmt, metrics[key]) for key, fmt in _EVAL_SUMMARY
                                   if metrics.get(key) is not None])
    for key, fmt in _SUMMARY:
        if metrics.get(key) is not None:
            parts.append(_format(fmt, metrics[key]))
    if metrics.get("tokens_per_second") is None and "loss" in metrics:
        parts.append("tokens/s n/a (compiling)")
    if metrics.get("mfu") is not None:  # unknown peak: the run's header line says so once
        parts.append(f"MFU {100 * metrics['mfu']:.1f}%")
    return " | ".join(parts)


def progress_postfix(metrics: dict) -> dict:
    """The progress bar's fields after a log step."""
    speed = metrics.get("tokens_per_second")  # None while the first step compiles
    return {"loss": _format("{:.4f}", metrics["loss"]),
            "tokens/s": "compiling" if speed is None else f"{speed:,.0f}"}


class Logger:
    """`log(step, metrics)` writes everywhere; `close()` at the end."""

    def __init__(self, config: ConfigDict, run_dir: str, flags: dict,
                 total_steps: int, start_step: int = 0, all_processes: bool = False):
        process = jax.process_index()
        self.enabled = process == 0 or all_processes
        self.prefix = f"[process {process}] " if process else ""
        log_dir = config.wandb_dir or run_dir
        if "://" in log_dir:
            raise UserError(f"--logger.wandb_dir must be a local directory for W&B files and "
                            f"metrics.jsonl when the run directory is {run_dir}")
        self.metrics_path = os.path.join(
            log_dir, f"metrics.process{process}.jsonl" if process else "metrics.jsonl")
        self.wandb_run = None
        self.tensorboard = None
        self.progress = None
        if not self.enabled:
            return
        try:
            os.makedirs(log_dir, exist_ok=True)
            _truncate_after(self.metrics_path, start_step)
            self.metrics_file = open(self.metrics_path, "a")
        except OSError as e:
            raise UserError(f"cannot write {self.metrics_path} (--logger.wandb_dir, or else "
                            f"the run directory): {e.strerror}") from None
        if config.tensorboard:
            from tensorboardX import SummaryWriter

            # On resume, purge_step makes TensorBoard drop what the run that died logged
            # after the checkpoint, as _truncate_after does for metrics.jsonl. The file
            # name holds the time in seconds; the start step keeps a resumed run's file
            # from replacing (or, read in name order, preceding) one made the same second.
            self.tensorboard = SummaryWriter(
                log_dir if process == 0 else os.path.join(log_dir, f"process{process}"),
                purge_step=start_step + 1 if start_step else None,
                filename_suffix=f".step{start_step:010d}")
            # Indented: a Markdown code block, one flag per line as it would be typed.
            self.tensorboard.add_text("flags", "\n".join(
                f"    --{name}={value}" for name, value in flags.items()), start_step)
        if process == 0 and os.environ.get("WANDB_MODE") != "disabled":
            import wandb

            project = f"{config.prefix}_{config.project}" if config.prefix else config.project
            self.wandb_run = wandb.init(
                project=project, entity=config.entity or None, notes=config.notes or None,
                id=os.path.basename(run_dir), name=os.path.basename(run_dir), dir=log_dir,
                config=flags, resume="allow", mode="online" if config.online else "offline",
                settings=wandb.Settings(silent=True),
            )
        # disable=None: no bar when stderr is not a terminal (CI logs, files).
        self.progress = tqdm(total=total_steps, initial=start_step,
                             disable=None if process == 0 else True,
                             dynamic_ncols=True, unit="step")

    def advance(self, steps: int = 1):
        if self.progress is not None:
            self.progress.update(steps)

    def log(self, step: int, metrics: dict, echo: bool = True):
        if not self.enabled:
            return
        if self.tensorboard is not None:
            for key, value in metrics.items():
                value = value.item() if hasattr(value, "item") else value
                if isinstance(value, numbers.Number) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, float(value), step)  # NaN and Inf too
            self.tensorboard.flush()
        metrics = {k: _plain(v) for k, v in metrics.items()}
        try:
            self.metrics_file.write(json.dumps({"step": step, "time": time.time(), **metrics})
                                    + "\n")
            self.metrics_file.flush()
        except OSError as e:
            raise UserError(f"cannot write {self.metrics_path}: {e.strerror}") from None
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        if self.progress is not None and "loss" in metrics:
            self.progress.set_postfix(progress_postfix(metrics))
        if echo:
            self.print(format_metrics(step, metrics))

    def print(self, line: str):
        if self.enabled:
            tqdm.write(self.prefix + line)  # prints above the bar without breaking it

    def close(self):
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.close()
        self.metrics_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()



def _plain(value):
    """JSON-friendly: numpy scalars to Python numbers, NaN/Inf kept as strings."""
    if value is None or isinstance(value, (str, bool)):
        return value
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _truncate_after(path: str, step: int):
    """On resume, drop lines logged after the checkpoint by the run that died."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)
