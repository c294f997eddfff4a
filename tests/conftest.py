"""Test setup: 8 virtual CPU devices for sharding tests, fp32 matmuls on CPU."""

import os

# Must happen before jax is imported anywhere.
os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# The tests' tiny models are compile-bound: LLVM at -O0 compiles them faster (CPU time of
# an ep = fsdp training test: 34.8 s, 23.7 s at -O0). Exported, so xdist workers and the
# commands the tests start inherit it (tests that set their own device count keep it:
# cli_utils.xla_flags). It may change float bits, so a test compares bits only between
# runs of one program in one environment (two programs that differ in a constant, a run
# of 1 step and one of 3, may be fused otherwise: test_image_chats' cache run is the JSONL
# run's command). The README's quick start, whose printed losses the README shows, runs
# with XLA's defaults (test_readme.newcomer_env). Not also `--xla_cpu_use_fusion_emitters=
# false` (XLA's older loop emitters: whole suite 2,668 -> 1,531 s with both): two of three
# whole-suite runs with both lost an xdist worker to a segmentation fault (once inside
# JAX's serialization of a compiled program for its persistent cache, once in
# test_sharding; not reproduced alone), which would fail CI.
COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)
for flag in COMPILE_FLAGS:
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + flag
# W&B off: its init costs seconds per trainer start. The tests of the W&B path (the
# README's first command, multi-host) ask for offline runs themselves.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import logging  # noqa: E402
import pytest  # noqa: E402  (after the environment above)


@pytest.fixture(autouse=True)
def _root_logger_as_found():
    """A command's main() run in the test process (`logging.basicConfig(force=True)`: the
    server's, lm-eval's, the token cache's) points the root logger at the test's captured
    stderr, which closes when the test ends: a later test's log line (or a thread's left
    running) then printed "--- Logging error --- ValueError: I/O operation on closed
    file" into the run's output. Each test leaves the root logger's handlers and level as
    it found them (besides pytest's own capture, which it adds and removes itself)."""
    def own(handler):
        return type(handler).__module__.startswith("_pytest")

    root = logging.getLogger()
    before, level = [h for h in root.handlers if not own(h)], root.level
    yield
    for handler in root.handlers[:]:
        if not own(handler) and handler not in before:
            root.removeHandler(handler)
    for handler in before:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def served():
    """(batcher, Flax module, params): the tiny LLaMA behind a batcher, shared by the
    serving tests (tests/serving_utils.py)."""
    from serving_utils import make_batcher

    batcher, model, params = make_batcher()
    yield batcher, model, params
    batcher.stop()


@pytest.fixture(scope="session")
def logprob_atol(served):
    """Tolerance of one log-probability: the engine's programs (prefill buckets, decode
    windows, the cache) sum in other orders than a full forward pass."""
    from numerics import logprob_atol_for

    _, model, params = served
    return logprob_atol_for(model, params)
