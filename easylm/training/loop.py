"""The training loop: it only feeds batches, logs every --log_freq steps and calls the
extras every N steps as hooks (`Run.add_hook(fn, every=N)`): evaluation, lm-eval,
checkpoints, the profiler's window of steps, preemption."""

import contextlib
import os
import signal
import time

import jax

from easylm.errors import UserError
from easylm.runtime import flops, profiling
from easylm.training.run import Run, StepInfo
from easylm.training.state import TrainState


def _evaluate(run: Run, state: TrainState) -> dict:
    totals = None
    batches = run.objective.batches(run.eval_dataset, run.place, lambda: state)
    for i, (batch, _) in enumerate(batches):
        if run.config.eval_steps and i >= run.config.eval_steps:
            break
        if totals is None:
            totals = run.eval_zeros(state.params, batch, state.frozen)
        totals = run.eval_step(state.params, batch, totals, state.frozen)
    if totals is None:
        return {}
    totals = jax.device_get(totals)
    return {**{f"eval_{k}": float(v) for k, v in totals.means().items()},
            f"eval_{totals.COUNT}": float(totals.count)}


class _Preemption(contextlib.AbstractContextManager):
    """While entered, SIGTERM sets a flag the loop checks after each step; on exit the
    previous handler is back (a process that trains in-process, as tests do, can then be
    stopped by SIGTERM again)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame):
        self.requested = True


def add_standard_hooks(run: Run, cleanup: contextlib.ExitStack):
    """The profiler window, evaluation, lm-eval (--eval_harness), checkpoints and
    preemption, as the flags say; the SIGTERM handler is undone by `cleanup`."""
    config = run.config
    # Every process traces its own devices; W&B's directory is local also when the run
    # directory is a bucket.
    profiler = profiling.Profiler(
        os.path.join(config.logger.wandb_dir or run.run_dir, "profile",
                     f"process{jax.process_index()}"),
        config.profile_start_step, config.profile_steps, run.log.print)
    if config.profile_steps and config.profile_start_step <= run.start_step:
        run.log.print(f"note: not profiling: --profile_start_step={config.profile_start_step} "
                      f"is before this run's first step, {run.start_step + 1}")
    # Stopped before the manager and the logs close, also after an error; a run that ends
    # inside the window stops it before its final save.
    run.profiler = profiler
    run.add_hook(lambda info: (profiler.after(info.step, info.metrics),
                               profiler.before(info.step + 1)))
    if run.eval_dataset is not None:
        run.add_hook(lambda info: run.log.log(info.step, _evaluate(run, info.state)),
                     every=config.eval_freq)
    if run.harness is not None:
        run.add_hook(lambda info: run.log.log(info.step, run.harness(info.step, info.state)),
                     every=run.harness.every)
    for every in {config.save_model_freq, config.save_milestone_freq} - {0}:
        run.add_hook(lambda info: run.save(info.step), every=every)
    preemption = cleanup.enter_context(_Preemption())

    def on_sigterm(info):
        if preemption.requested:
            run.log.print(f"SIGTERM: saving a checkpoint at step {info.step} and exiting")
            run.stop_requested = True

    run.add_hook(on_sigterm)


def loop(run: Run) -> int:
    """Train from `run.start_step` to --total_steps (or until a hook stops it), logging
    every --log_freq steps, running the hooks, then save; returns the last step."""
    config = run.config
    step = run.start_step
    # Batches arrive on the devices; an online objective makes them from the live state.
    data = run.objective.batches(run.dataset, run.place, lambda: run.state)
    throughput = _Throughput(run)
    # Last in, first out: the save in flight completes before the manager and the logs
    # close (also after an error), and the profiler stops before that.
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(run.manager.wait)
        profiler = run.profiler
        if profiler is not None:
            cleanup.callback(profiler.stop)
            profiler.before(step + 1)
        while step < config.total_steps and not run.stop_requested:
            batch, data_metrics = next(data)
            run.state, metrics = run.train_step(run.state, batch)
            step += 1
            run.log.advance()
            throughput.started(step, metrics)
            if step % config.log_freq == 0 or step in (run.start_step + 1, config.total_steps):
                _log_step(run, step, metrics, data_metrics, throughput)
            info = StepInfo(step, run.state, metrics)
            with throughput.paused():
                for every, hook in run.hooks:
                    if step % every == 0:
                        hook(info)
        if profiler is not None:
            profiler.stop()  # the final save is not traced
        run.save(step)
    return step


class _Throughput:
    """Tokens/s between log steps, from after the first (compiling) step, not counting
    the time hooks take (evaluation, saves)."""

    def __init__(self, run: Run):
        self.batch_tokens = run.batch_tokens
        # A live reference's forward pass counts in MFU.
        self.flops_per_token = run.objective.flops_per_token(run.dataset.seq_length)
        self.peak = flops.peak_flops_per_device(jax.devices()[0], run.config.peak_tflops)
        self.clock = None  # (time, step)

    def started(self, step: int, metrics):
        if self.clock is None:  # the first step compiles; time from after it
            jax.block_until_ready(metrics)
            self.clock = (time.time(), step)

    @contextlib.contextmanager
    def paused(self):
        began = time.time()
        yield
        self.clock = (self.clock[0] + time.time() - began, self.clock[1])

    def measure(self, step: int) -> dict:
        now = time.time()
        tokens_per_second = None
        if step > self.clock[1]:
            tokens_per_second = (step - self.clock[1]) * self.batch_tokens / (now - self.clock[0])
        self.clock = (now, step)
        return dict(tokens_seen=step * self.batch_tokens, tokens_per_second=tokens_per_second,
                    mfu=flops.mfu(self.flops_per_token, tokens_per_second, self.peak,
                                  jax.device_count()) if tokens_per_second else None)


def _log_step(run: Run, step: int, metrics: dict, data_metrics: dict, throughput: _Throughput):
    """The one place the loop waits for the device: the step's metrics, checked for a
    non-finite loss."""
    values = {k: v.item() for k, v in jax.device_get(metrics).items()}
    bad = values.pop("first_nonfinite_step")
    if bad >= 0 and not run.config.skip_nonfinite_updates:
        raise UserError(
            f"loss or gradient norm became NaN/Inf at step {bad}; stopping "
            f"(lower the learning rate, or pass --skip_nonfinite_updates=True "
            f"to skip such steps)"
        )
    values.update(**throughput.measure(step), **{f"data/{k}": v for k, v in data_metrics.items()})
    run.log.log(step, values)
