"""Profiler traces: take them from the training loop, and say where a step's time goes.

`summarize_trace(log_dir, steps)` reads the `perfetto_trace.json.gz` that
`jax.profiler.trace(log_dir, create_perfetto_trace=True)` writes under
`log_dir/plugins/profile/<timestamp>/` (Chrome trace events: 'M' events name processes
and threads, 'X' events carry `ts` and `dur` in microseconds) and reduces it to
milliseconds per profiled step: wall time from the first kernel to the last, busy time
(kernels of all streams, overlap counted once), the idle fraction between them (where
the device waits for the host), time by kind of kernel, the top kernels and HLO ops,
and every line's total. It also writes every kernel's row to `kernels.csv` next to the
trace. The wall time runs from the first kernel to the last, so the gap before the
first profiled step is not counted: profile a few steps.

A traced step is not quite an untraced one: the tracer costs some microseconds per
kernel launch, and XLA:GPU runs its command buffers (CUDA graphs) as separate kernel
launches while a trace is on, unless XLA_FLAGS has
`--xla_enable_command_buffers_during_profiling=true`. Compare the traced step time with
an untraced one before reading idle time as the loop's.

On GPU a device process ("/device:GPU:0") has one line per CUDA stream
("Stream #13(Kernel,MemcpyD2D)") whose events are the kernels, and derived lines
("XLA Ops", "XLA Modules", "Steps", "Framework Ops", ...) that regroup the same time;
kernel figures come from the stream lines (or, if none is named so, from every line
not known to be derived), HLO op figures from "XLA Ops" (or, without it, from the
kernels' `hlo_op` argument). Only the first device is summarised (one process drives
one GPU in the usual setup). XLA:CPU has no device process: its work runs on host
threads, whose totals (and HLO ops) are reported instead.

`Profiler` traces a window of steps of the training loop, called from the loop.

    python -m easylm.runtime.profiling LOG_DIR [STEPS]   prints a trace's summary as one JSON line
"""

import collections
import csv
import glob
import gzip
import json
import os
import re
import sys

import jax

from easylm.errors import UserError, exit_on_user_error

# (category, regex searched in the lower-cased kernel name); the first match wins, so
# cuDNN's flash-attention kernels count as attention although some are GEMM-like.
CATEGORIES = (
    ("attention", r"sdpa|fmha|flash|cudnn"),
    ("collectives", r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all"
                    r"|collective[-_]?permute"),
    ("matmul", r"gemm|xmma|cutlass|cublas|nvjet|dot|matmul"),
    ("memcpy/memset", r"memcpy|memset"),
)
OTHER = "other"

# Device lines that regroup the kernels' time (or carry no kernels): never counted as kernels.
NOT_KERNEL_LINES = {"steps", "xla modules", "xla ops", "async xla ops", "framework ops",
                    "framework name scope", "tensorflow ops", "tensorflow name scope",
                    "source code", "launch stats", "host offload ops", "_counters_",
                    "xla traceme", "cupti overhead"}
TOP = 20


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, pattern in CATEGORIES if re.search(pattern, name)), OTHER)


def find_trace(log_dir: str) -> str:
    """The newest perfetto_trace.json.gz under log_dir/plugins/profile/."""
    paths = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    if not paths:
        raise UserError(f"no plugins/profile/*/perfetto_trace.json.gz under {log_dir}")
    return max(paths, key=os.path.getmtime)


def summarize_trace(log_dir: str, steps: int) -> dict:
    """Where `steps` profiled steps spent their time, per step (see the module docstring)."""
    path = find_trace(log_dir)
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    processes, threads = {}, {}
    lines = collections.defaultdict(list)  # (pid, tid) -> its complete events
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e.get("ph") == "X" and "dur" in e:
            lines[(e["pid"], e.get("tid"))].append(e)
    named = lambda key: threads.get(key, str(key[1]))
    devices = sorted((name for name in processes.values() if name.startswith("/device:")),
                     key=lambda name: (len(name), name))  # /device:GPU:2 before /device:GPU:10
    summary = {"trace": path, "steps": steps, "device": devices[0] if devices else None}
    if not devices:
        return summary | _host_summary({named(k): v for k, v in lines.items()}, steps)
    device_lines = collections.defaultdict(list)  # line name -> events, same names merged
    for key, line in lines.items():
        if processes.get(key[0]) == devices[0]:
            device_lines[named(key)].extend(line)
    return summary | {"devices": len(devices)} | _device_summary(device_lines, steps, path)


def _device_summary(lines: dict, steps: int, path: str) -> dict:
    kernel_lines = [k for k in lines if "stream" in k.lower()] or \
                   [k for k in lines if k.lower() not in NOT_KERNEL_LINES]
    kernels = [e for k in kernel_lines for e in lines[k]]
    lines_ms = {k: _ms(_union(v), steps) for k, v in lines.items()}
    if not kernels:
        return {"note": "no kernel events on the device", "lines_ms": lines_ms}
    busy = _union(kernels)
    wall = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    table = _table(kernels)
    by_category = {c: 0.0 for c, _ in CATEGORIES} | {OTHER: 0.0}
    for kernel, row in table.items():
        by_category[category(kernel)] += row["us"]
    ops = _table([e for k, v in lines.items() if k.lower() == "xla ops" for e in v])
    if not ops:  # no derived line: the kernels' own `hlo_op`
        ops = _table([e for e in kernels if "hlo_op" in (e.get("args") or {})],
                     key=lambda e: e["args"]["hlo_op"])
    csv_path = os.path.join(os.path.dirname(path), "kernels.csv")
    _write_csv(csv_path, table, steps, busy)
    return {
        "wall_ms": _ms(wall, steps),
        "busy_ms": _ms(busy, steps),
        "idle_fraction": round(1 - busy / wall, 4) if wall else 0.0,
        "categories_ms": {c: _ms(us, steps) for c, us in by_category.items()},
        "top_kernels": _top(table, steps, busy, "hlo_op"),
        "top_hlo_ops": _top(ops, steps, busy, "long_name") if ops else None,
        "lines_ms": lines_ms,
        "kernels_csv": csv_path,
    }


def _host_summary(lines: dict, steps: int) -> dict:
    """XLA:CPU: its threads' busy time, and the HLO ops its thunks ran (`hlo_op` in args)."""
    threads = collections.Counter()
    ops = []
    for name, line in lines.items():
        if "xla" in name.lower():  # e.g. 'tf_XLAEigen/<id>': one entry per thread pool
            threads[re.sub(r"/-?\d+$", "", name)] += _union(line)
            ops += [e for e in line if "hlo_op" in (e.get("args") or {})]
    table = _table(ops)
    total = sum(row["us"] for row in table.values()) or 1.0
    return {"note": "no device in the trace (XLA:CPU runs on host threads; on a GPU, CUPTI "
                    "was not found): busy ms per step of the host's XLA threads, summed over "
                    "the threads of a pool; the top HLO ops' share is of all ops' time",
            "host_xla_threads_ms": {k: _ms(v, steps) for k, v in threads.most_common()},
            "top_hlo_ops": _top(table, steps, total, "long_name")}


def _ms(us: float, steps: int) -> float:
    return round(us / 1000 / steps, 3)


def _union(events: list) -> float:
    """Microseconds covered by at least one of the events (overlaps and nesting once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _table(events: list, key=lambda e: e["name"]) -> dict:
    """{key: {'us': total, 'calls': n, 'args': the first event's args}}, largest first."""
    table = {}
    for e in events:
        row = table.setdefault(key(e), {"us": 0.0, "calls": 0, "args": e.get("args") or {}})
        row["us"] += e["dur"]
        row["calls"] += 1
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["us"]))


def _top(table: dict, steps: int, busy: float, detail: str) -> list:
    """The TOP largest rows; `detail` is an args key shown when present (long_name: HLO text)."""
    rows = []
    for name, row in list(table.items())[:TOP]:
        out = {"name": name[:120], "ms": _ms(row["us"], steps),
               "calls": round(row["calls"] / steps, 2), "share": round(row["us"] / busy, 4)}
        if detail in row["args"]:
            out[detail] = str(row["args"][detail])[:200]
        rows.append(out)
    return rows


def _write_csv(path: str, table: dict, steps: int, busy: float):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["kernel", "category", "ms_per_step", "calls_per_step", "share_of_busy",
                         "hlo_op"])
        for name, row in table.items():
            writer.writerow([name, category(name), row["us"] / 1000 / steps,
                             row["calls"] / steps, row["us"] / busy, row["args"].get("hlo_op", "")])


class Profiler:
    """Traces steps `start .. start + steps - 1` (numbered from 1, as in the logs) of a
    training loop into `directory`: the loop calls `before(step)` and `after(step,
    outputs)` around each step, and `stop()` when it ends, however it ends (a run that
    ends inside the window keeps the steps it traced)."""

    def __init__(self, directory: str, start: int, steps: int, log=print):
        self.directory, self.start, self.steps, self.log = directory, start, steps, log
        self.active = False
        self.outputs, self.last = None, None

    def before(self, step: int):
        if self.steps and step == self.start:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs):
        self.outputs, self.last = outputs, step
        if self.active and step >= self.start + self.steps - 1:
            self.stop()

    def stop(self):
        """Ends the trace, once the traced steps are done on the device, and logs where it is."""
        if not self.active:
            return
        self.active = False
        try:
            jax.block_until_ready(self.outputs)
        finally:
            jax.profiler.stop_trace()
        steps = max(self.last or self.start, self.start) - self.start + 1
        self.log(f"profile of {steps} step(s) from step {self.start}: "
                 f"{find_trace(self.directory)}; view it in ui.perfetto.dev, or with xprof (or "
                 f"tensorboard) --logdir {self.directory}; summary: python -m easylm.runtime.profiling "
                 f"{self.directory} {steps}")


@exit_on_user_error
def main(argv=None):
    argv = list(argv or sys.argv)[1:]
    usage = "usage: python -m easylm.runtime.profiling LOG_DIR [STEPS (traced steps, default 1)]"
    if argv[:1] in (["--help"], ["-h"]):
        print(usage)
        return
    if not 1 <= len(argv) <= 2 or (len(argv) == 2 and not argv[1].isdigit()) or argv[1:] == ["0"]:
        raise UserError(usage)
    print(json.dumps(summarize_trace(argv[0], int(argv[1]) if len(argv) > 1 else 1)))


if __name__ == "__main__":
    main()
