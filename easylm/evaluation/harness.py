"""lm-evaluation-harness in-process, on the serving engine: no server, no second process.

    lm = HarnessLM(engine, tokenizer, stop_token_ids)  # an Engine over any params, live ones too
    manager, tasks = load_tasks(["hellaswag"], include_path="")
    results = evaluate(lm, tasks, manager, limit=100)

The three request types follow lm-eval's `hf` backend, so the numbers match it, and
match the HTTP server under lm-eval's `local-completions` (the same engine calls):

    loglikelihood(context, continuation)
        Text is tokenized as the tokenizer does (its BOS included when it adds one; a
        prompt that already starts with the BOS text gets no second one); an empty
        context becomes the BOS token (EOS without one). The last max_length + 1 tokens
        of context + continuation are kept; the result is the continuation's summed
        log-probability and whether greedy decoding would produce it.
    loglikelihood_rolling(text)
        The text's tokens (the tokenizer's BOS among them if it adds one) after the BOS
        token, in lm-eval's windows of max_length, each token scored once (the windows
        of the server's `scoring.rolling_windows`).
    generate_until(context, gen_kwargs)
        The batcher's continuous batching: greedy unless the task samples, at most
        max_gen_toks tokens, the context cut from the left to leave them room, the
        text cut at the first `until` string; EOS ends it.

`max_length` is the `hf` backend's: the context a request may use, by default the
engine's seq_length. (lm-eval's `local-completions` keeps 1 token, and 2 for rolling
windows, of its own max_length for the token it asks for.)
"""

import datetime
import difflib
import json
import numbers
import os
import threading
import time

import lm_eval
import lm_eval.models  # noqa: F401  lm-eval fills its registry only when it is empty
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import (
    get_rolling_token_windows,
    handle_non_serializable,
    make_disjoint_window,
)
from tqdm import tqdm

from easylm.errors import UserError
from easylm.serving import scoring
from easylm.serving.batcher import Batcher, Generation, SamplingParams
from easylm.serving.engine import Engine

# Generation options a task may set that the engine honours; any other would change the
# output unnoticed, so it is an error.
_SAMPLING = {"do_sample", "temperature", "top_p", "top_k", "seed"}


class HarnessLM(TemplateLM):
    """An lm-eval model over an `Engine` (which holds the parameters and the mesh).

    The engine is used from the calling thread for scoring and from a batcher thread
    started for each `generate_until` call; nothing else may use it meanwhile.
    """

    def __init__(self, engine: Engine, tokenizer, stop_token_ids=(), max_length: int | None = None,
                 max_gen_toks: int = 256, seed: int = 1234, progress: bool = True):
        super().__init__()
        self.progress = progress  # tqdm bars per request type
        self.engine, self.tokenizer = engine, tokenizer
        self.stop_token_ids = {i for i in (*stop_token_ids, tokenizer.eos_token_id) if i is not None}
        self.max_length = max_length or engine.seq_length  # the `hf` backend's max_length
        if self.max_length > engine.seq_length:
            raise UserError(f"max_length={self.max_length} is above the engine's seq_length="
                            f"{engine.seq_length}")
        self.max_gen_toks = max_gen_toks
        self.seed = seed  # for tasks that sample; local-completions sends 1234 too

    @classmethod
    def from_params(cls, model, params, tokenizer, mesh=None, engine_config=None, **kwargs):
        """Over parameters already on the devices (`model`: the family's `Model`)."""
        return cls(Engine(engine_config, model, params, mesh), tokenizer, **kwargs)

    # ------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tokenizer.decode([self.prefix_token_id]))
        return self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"]

    # ------------------------------------------------------------ requests

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        L = self.max_length
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > L:
                raise UserError(f"a continuation of {len(continuation)} tokens does not fit "
                                f"the context of {L} tokens (--seq_length)")
            kept = (list(context) + list(continuation))[-(L + 1):]
            rows.append((kept[:-1], kept[1:], len(kept) - 1 - len(continuation)))
        # Longest first, so that each engine call pads its rows to a similar length.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results = [None] * len(rows)
        step = self.engine.batch_size
        with tqdm(total=len(rows), disable=disable_tqdm or not self.progress,
                  desc="loglikelihood") as bar:
            for start in range(0, len(order), step):
                chunk = order[start:start + step]
                job = scoring.summed([rows[i] for i in chunk], list)
                for i, answer in zip(chunk, scoring.run(self.engine, job)):
                    results[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(chunk))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append((None, *make_disjoint_window(window)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _sampling(self, gen_kwargs: dict) -> SamplingParams:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_tokens = kwargs.pop("max_gen_toks")
        unknown = sorted(set(kwargs) - _SAMPLING)
        if unknown:
            raise UserError(f"unsupported generation_kwargs: {', '.join(unknown)} (easylm's "
                            f"engine takes until, max_gen_toks, {', '.join(sorted(_SAMPLING))})")
        if max_tokens >= self.max_length:
            raise UserError(f"max_gen_toks={max_tokens} leaves no room for a prompt in the "
                            f"context of {self.max_length} tokens (--seq_length)")
        sample = kwargs["do_sample"]
        return SamplingParams(
            max_tokens=max_tokens, temperature=float(kwargs["temperature"]) if sample else 0.0,
            top_p=float(kwargs.get("top_p", 1.0)), top_k=int(kwargs.get("top_k", 0)),
            seed=int(kwargs.get("seed", self.seed)), stop=tuple(until))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        jobs = []
        for req in requests:
            context, gen_kwargs = req.args[:2]
            params = self._sampling(gen_kwargs)
            prompt = self.tok_encode(context)[-(self.max_length - params.max_tokens):]
            jobs.append((prompt or [self.prefix_token_id], params))
        bar = tqdm(total=len(jobs), disable=disable_tqdm or not self.progress,
                   desc="generate_until")
        done = threading.Semaphore(0)

        def on_event(event):
            if event.finish_reason or event.error:
                done.release()

        # Every request queued before the batcher starts: its device calls then follow from
        # the requests alone, not from thread timing, and so are the same on every process
        # (which a multi-host engine needs: each call is collective).
        batcher = Batcher(self.engine, self.stop_token_ids)
        generations = [Generation(prompt, params, self.tokenizer, on_event)
                       for prompt, params in jobs]
        for g in generations:
            batcher.submit(g)
        batcher.start()
        try:
            for _ in generations:
                done.acquire()
                bar.update(1)
        finally:
            batcher.stop()
            bar.close()
        out = []
        for req, g in zip(requests, generations):
            if g.finish_reason == "error":
                raise RuntimeError("generation failed on the engine (see the log above)")
            # The text is cut at the first stop string already; lm-eval's own post-processing
            # on top, as its backends do.
            text = postprocess_generated_text(g.stream.text, list(g.params.stop), None)
            self.cache_hook.add_partial("generate_until", tuple(req.args[:2]), text)
            out.append(text)
        return out


# ---------------------------------------------------------------- tasks and results


def task_manager(names: list[str], include_path: str = "", flags: str = "--"):
    """An lm-eval TaskManager that knows every name in `names`, or a UserError naming the
    first unknown one. `include_path`: comma-separated directories of task YAML files.
    Indexing lm-eval's own ~15,000 tasks takes seconds, so local tasks alone skip it.
    `flags`: how the messages name the flags (the trainer's: `--eval_harness.`)."""
    from lm_eval.tasks import TaskManager

    paths = [p for p in include_path.split(",") if p]
    for path in paths:
        if not os.path.isdir(path):
            raise UserError(f"{flags}include_path={path!r} is not a directory")
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(_known(local, name) for name in names):
            return local
    manager = TaskManager(include_path=paths or None)
    for name in names:
        if not _known(manager, name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            where = "lm-eval's tasks" + (f" or {flags}include_path={include_path}" if paths else "")
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(f"unknown task {name!r}: not among {where}{hint}")
    return manager


def load_tasks(names: list[str], include_path: str = "", flags: str = "--"):
    """(TaskManager, the tasks and groups `names` name, built with their data): every
    problem a task can have before a model runs is a UserError here."""
    from datasets.exceptions import DatasetGenerationError

    import datasets

    manager = task_manager(names, include_path, flags)
    # datasets draws a bar on stderr the first time it builds a task's split (not once it
    # is cached): noise before lm-eval's own progress, and before a refusal's one line.
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        loaded = manager.load(names)
    except (FileNotFoundError, ConnectionError, DatasetGenerationError) as e:
        # datasets' errors for a missing or malformed data file, or a hub dataset offline.
        reasons = [str(x).splitlines()[0] for x in (e, e.__cause__) if x is not None and str(x)]
        raise UserError(f"cannot load the data of {flags}tasks={','.join(names)}: "
                        f"{': '.join(reasons)}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    children = {child for group in loaded["group_map"].values() for child in group}
    built = [*loaded["groups"].items(), *loaded["tasks"].items()]
    return manager, [item for name, item in built if name not in children]


def check_generation_room(tasks: list, max_gen_toks: int, seq_length: int, flags: str = "--"):
    """Each generating task's tokens to write (its own max_gen_toks, else the flag's) must
    leave room for a prompt in the context; checked before any task runs, and only for
    tasks that generate: multiple-choice and log-likelihood tasks write nothing."""
    leaves = [leaf for item in tasks
              for leaf in (item.get_all_tasks() if hasattr(item, "get_all_tasks") else [item])]
    for task in leaves:
        if task.config.output_type != "generate_until":
            continue
        own = (task.config.generation_kwargs or {}).get("max_gen_toks")
        if (own or max_gen_toks) >= seq_length:
            source = (f"task {task.config.task}'s max_gen_toks={own}" if own
                      else f"{flags}max_gen_toks={max_gen_toks}")
            raise UserError(f"{source} leaves no room for a prompt in {flags}seq_length="
                            f"{seq_length}")


def _known(manager, name: str) -> bool:
    return name in manager.all_tasks or (name.endswith((".yaml", ".yml")) and os.path.isfile(name))


def evaluate(lm, tasks: list, manager, num_fewshot: int | None = None,
             limit: float | None = None, log_samples: bool = False,
             bootstrap_iters: int = 100000) -> dict:
    """lm-eval's results dict (with `log_samples`, its `samples` too). `tasks`: names, or
    what `load_tasks` built."""
    if limit is not None and limit >= 1:
        limit = int(limit)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                                   num_fewshot=num_fewshot, limit=limit, log_samples=log_samples,
                                   bootstrap_iters=bootstrap_iters)


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def write_results(results: dict, directory: str) -> list[str]:
    """results_<time>.json and, when `results` holds samples, samples_<task>_<time>.jsonl
    (lm-eval's file names) in `directory`; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    stamp = datetime.datetime.now().isoformat().replace(":", "-")
    results = dict(results)
    samples = results.pop("samples", None) or {}
    paths = [os.path.join(directory, f"results_{stamp}.json")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    for task, rows in samples.items():
        paths.append(os.path.join(directory, f"samples_{task}_{stamp}.jsonl"))
        with open(paths[-1], "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return paths


# ---------------------------------------------------------------- in the training loop


class HarnessHook:
    """lm-eval tasks on the trainer's live parameters: `hook(step, state)` -> metrics named
    `harness/<task>/<metric>` (a filter other than lm-eval's `none` adds `/<filter>`), and
    `harness/seconds`; the trainer calls it every `hook.every` steps.

    Made once, before training, from the `--eval_harness.*` flags (easylm.evaluation.harness_flags):
    the tasks and their data are loaded (a bad name or file is a UserError then, not at the
    first evaluation), and one engine is made on the trainer's mesh. Each call hands the
    engine `state.params` as they are (sharded, in their dtype; `model`, the trainer's
    family `Model`, computes in the trainer's dtype), so the programs compiled by the first call serve every later one;
    nothing is written and nothing is fetched outside the call, and the engine's cache is
    freed between calls. Every process must call it at the same steps: each runs every
    request (the engine's calls are collective); the trainer's Logger writes only process
    0's results. (`step` is the loop hooks' signature; the results do not depend on it.)
    """

    def __init__(self, config, model, tokenizer, mesh):
        from easylm.evaluation import harness_flags
        from easylm.serving import engine as engine_lib

        names = harness_flags.task_names(config)
        max_seq_length = model.max_seq_length
        _check_hook_config(config, max_seq_length)
        self.config, self.every = config, config.freq
        self.manager, self.tasks = load_tasks(names, config.include_path, "--eval_harness.")
        seq_length = config.seq_length or min(max_seq_length or 2048, 2048)
        engine_config = engine_lib.get_default_config({
            "batch_size": config.batch_size, "seq_length": seq_length,
            "min_bucket": config.min_bucket, "decode_steps": config.decode_steps})
        check_generation_room(self.tasks, config.max_gen_toks, seq_length, "--eval_harness.")
        self.lm = HarnessLM.from_params(model, None, tokenizer, mesh, engine_config,
                                        stop_token_ids=(model.eos_token_id,),
                                        max_gen_toks=config.max_gen_toks, progress=False)
        self.lm.engine.release()  # training needs the memory more

    def __call__(self, step: int, state) -> dict:
        start = time.time()
        engine = self.lm.engine
        # A variant's model serves its live parameters on their frozen base.
        engine.params, engine.base = state.params, state.frozen.get("base")
        engine.reset()  # the cache, for generate_until requests (compiled once, at the start)
        try:
            results = evaluate(self.lm, self.tasks, self.manager, self.config.num_fewshot,
                               self.config.limit, bootstrap_iters=self.config.bootstrap_iters)
        finally:
            engine.params = engine.base = None  # the next train step donates these buffers
            engine.release()
        return {**harness_metrics(results), "harness/seconds": time.time() - start}


def harness_metrics(results: dict) -> dict:
    """lm-eval's per-task (and per-group) numbers as flat `harness/<task>/<metric>` names;
    what is not a number (an alias, a stderr of 'N/A') is left out."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or isinstance(value, bool) or not isinstance(value, numbers.Number):
                continue
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            out[f"harness/{task}/{name}"] = float(value)
    return out


def _check_hook_config(config, max_seq_length: int):
    """Flag values the hook cannot use, named as the trainer's flags."""
    if config.freq < 1:
        raise UserError(f"--eval_harness.freq must be >= 1 with --eval_harness.tasks, got "
                        f"{config.freq}")
    if config.limit is not None and config.limit <= 0:
        raise UserError(f"--eval_harness.limit must be > 0, got {config.limit}")
    for name, low in (("num_fewshot", 0), ("bootstrap_iters", 0), ("max_gen_toks", 1),
                      ("batch_size", 1), ("seq_length", 0), ("min_bucket", 1),
                      ("decode_steps", 1)):
        if config[name] is not None and config[name] < low:
            raise UserError(f"--eval_harness.{name} must be >= {low}, got {config[name]}")
    if max_seq_length and config.seq_length > max_seq_length:
        raise UserError(f"--eval_harness.seq_length={config.seq_length} is above the model's "
                        f"max_position_embeddings={max_seq_length}")
