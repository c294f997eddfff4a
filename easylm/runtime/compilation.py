"""Before the first compile: the persistent XLA compilation cache and, on GPU hosts, the
XLA flags measured to help training."""

import contextlib
import os
from typing import NamedTuple

import jax

# On GPU hosts: the latency-hiding scheduler, and cuBLAS instead of Triton for the GEMMs
# (Triton's are slower at the shapes of LLMs; +1.1% on the llama_1b step on one H200,
# docs/benchmarks.md).
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_enable_triton_gemm=false")


def setup_compilation(cache_dir: str) -> None:
    """Before the first compile: the persistent compilation cache (a second start of the
    same step skips XLA compilation) and, on GPU hosts, GPU_XLA_FLAGS."""
    if cache_dir:
        cache_dir = os.path.expanduser(cache_dir)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if _gpu_plugin_installed():
        present = os.environ.get("XLA_FLAGS", "")
        extra = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in present]
        os.environ["XLA_FLAGS"] = " ".join([present, *extra]).strip()


def _gpu_plugin_installed() -> bool:
    """Whether jax's CUDA plugin is installed, decided without starting a backend (XLA
    reads XLA_FLAGS when the backend starts, so the flags must be set before)."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return False

    def installed(name):  # find_spec of 'a.b' raises when package 'a' is missing
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            return False

    return any(installed(name)
               for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12"))


class Compile(NamedTuple):
    """One XLA compile: the compiled function's name ("jit(_decode)") and its seconds."""

    program: str
    seconds: float


@contextlib.contextmanager
def counting_compiles():
    """A list that gets one `Compile` per XLA compile while the block runs (every jitted
    function's and every eager operation's: `jax.monitoring`'s backend-compile event);
    the benchmarks report it so a timed region is known to hold no compile, and tests
    count a program's compiles by its name."""
    compiles = []

    def listen(event, duration, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(Compile(fun_name, duration))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
