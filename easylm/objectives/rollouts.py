"""GRPO's batches: rollouts of the live parameters, their rewards and advantages.

For each batch of B prompts from the data pipeline (data/prompts.py):

  0. on several processes, every process's prompt rows are gathered (`gather_prompts`):
     each process makes every rollout (the engine's calls are collective) and places its
     own rows of the batch;
  1. generate: the serving engine (serving/engine.py) on the trainer's mesh, reading the
     train state's parameters in place (LoRA: the live adapters on their frozen base, as
     the lm-eval hook does; no copy, no host round trip of weights): all B x G rows are
     prefilled in one call and decoded together until each has its EOS or
     max_new_tokens. Row i's sampling key comes from (--seed, the step, i), so a resumed
     run draws the same completions. With --grpo.routing_replay (a mixture of experts)
     the engine also records each fed token's expert choices, which the batch carries
     (`routing`) for every forward over it to replay;
  2. score: the reward functions (rewards.py) on the host, then `advantages`;
  3. the batch: prompt + completion in rows of seq_length + 1 tokens, (B, G, T) arrays,
     placed on the devices; then, in one jitted program on the live parameters, the
     rollout's own log-probabilities (num_iterations > 1), the reference's (beta > 0),
     and the sampler-vs-trainer log-probability differences (temperature 1).

The engine's programs (one prefill, a decode program per cache window) are compiled at
the first step and serve every later one; its cache is freed between rollouts.
"""

import collections
import contextlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from easylm.errors import UserError
from easylm.models import vision
from easylm.objectives import episodes as episodes_lib, rewards as rewards_lib
from easylm.runtime.sharding import BATCH_AXES
from easylm.serving import cache_layout, engine as engine_lib, pages as pages_lib

# (B, G) per-completion values a batch carries for the metrics (besides each reward
# function's rewards/<name>/sum and /count).
ROW_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
               "completions/clipped_ratio")
_TRAIN, _EVAL = 0, 1  # salts of the sampling keys


def _nanstd(x, axis=None):
    """TRL's nanstd: Bessel-corrected over the non-NaN entries (NaN for fewer than 2)."""
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    mean = np.nanmean(x, axis=axis, keepdims=True)
    variance = np.nansum((x - mean) ** 2, axis=axis, keepdims=True) / np.maximum(count - 1, 1)
    return np.where(count > 1, np.sqrt(variance), np.nan)


def advantages(per_function: np.ndarray, weights: np.ndarray, scale_rewards: str,
               valid: np.ndarray):
    """(rewards (B, G), advantages (B, G), std (B, G)) from each function's rewards
    (F, B, G) (NaN: None), in float64 as TRL's "sum_then_normalize": the weighted sum over
    functions (NaN where every function said None: such a completion gets advantage 0
    and counts in no baseline), minus the group's mean, divided by the group's or the
    batch's std + 1e-4 unless scale_rewards is none. Rows not `valid` count nowhere."""
    with np.errstate(all="ignore"):
        rewards = np.nansum(per_function * weights[:, None, None], axis=0)
        rewards = np.where(np.isnan(per_function).all(0) | ~valid, np.nan, rewards)
        mean = np.nanmean(rewards, axis=1, keepdims=True)
        axis = None if scale_rewards == "batch" else 1
        std = np.broadcast_to(_nanstd(rewards, axis=axis), rewards.shape)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    return rewards, np.nan_to_num(adv, nan=0.0), std


def token_logps(logits, targets, temperature: float):
    """(log-probabilities of `targets` (N, T), entropies (N, T)) of softmax(logits / t),
    in fp32, as TRL's `_get_per_token_logps_and_entropies`. logits (N, T, V)."""
    logits = logits.astype(jnp.float32) / temperature
    log_z = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z
    probs = jnp.exp(logits - log_z[..., None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return chosen, entropy


def image_rows(batch):
    """A rollout batch's image inputs (B, G, ...) as rows (N, ...), or None (text)."""
    images = vision.image_inputs_of(batch)
    return None if images is None else {k: rows(v) for k, v in images.items()}


def rows(x):  # (B, G, ...) -> (N, ...)
    return x.reshape(-1, *x.shape[2:])


def corrects_sampling(options) -> bool:
    """Whether batches carry truncated importance weights: the cap is on and the engine's
    log-probabilities (of the model's own distribution, as OpenAI reports them) are the
    sampler's: temperature 1, top_p 1."""
    return bool(options.importance_sampling_cap) and options.temperature == 1 and \
        options.top_p == 1


def sampling_weights(diff, masks, mode: str, cap: float):
    """The importance weights of the sampler's mismatch, as TRL's GRPOTrainer makes them
    (vllm_importance_sampling_mode): diff (..., T) the training forward's log-probabilities
    less the engine's on the completion tokens (0 elsewhere). token_*: exp(diff) per token;
    sequence_*: exp of the completion's summed diff, broadcast over its tokens; *_truncate:
    min(weight, cap); *_mask: 0 where the weight is above cap."""
    if mode.startswith("sequence"):
        diff = jnp.broadcast_to(jnp.sum(diff * masks, axis=-1, keepdims=True), diff.shape)
    weight = jnp.exp(diff)
    if mode.endswith("truncate"):
        return jnp.minimum(weight, cap)
    return jnp.where(weight > cap, 0.0, weight)


def sampling_keys(seed: int, salt: int, step: int, index: int, n: int) -> np.ndarray:
    """(n, 2) uint32 raw keys, one per row, from the run's seed and where the rollout is."""
    state = np.random.SeedSequence([seed, salt, step, index]).generate_state(2 * n, np.uint32)
    return state.reshape(n, 2)


def generate(engine, prompts, sampling, max_new_tokens: int, eos_id, routing=None,
             images=None):
    """Each prompt's completion (ids, EOS included when drawn) and the engine's
    log-probabilities of them: one prefill of every row, then decode calls (each
    dispatched before the previous one's tokens are read) until every row has its EOS or
    max_new_tokens. Rows that have ended decode on (their tokens dropped) while others
    have not; each call attends over the cache window the unfinished rows need.
    `routing` (a list, an engine recording routing): each row's expert choices (P, L, K)
    for the P positions of its prompt and completion a training row feeds (its last
    token is a target only), appended in row order. `images`: the prompts' images
    (engine.PromptImages), prefilled with them."""
    n = len(prompts)
    tokens, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
    chosen = [[] for _ in range(n)]  # per row: (L, K) per position fed
    done = np.zeros(n, bool)
    full = sampling.pad(engine.batch_size)
    calls = -(-(max_new_tokens - 1) // engine.config.decode_steps)
    pending, issued = [engine.prefill(prompts, list(range(n)), sampling, images)], 0
    while pending:
        if issued < calls:
            active = np.zeros(engine.batch_size, bool)
            active[:n] = ~done
            pending.append(engine.decode(full, active))
            issued += 1
        out = engine.fetch(pending.pop(0))
        ids, lps = out[:2]  # (steps, rows)
        if routing is not None:
            _record(chosen, out[4], not tokens[0], prompts, done)
        for i in np.flatnonzero(~done):
            for t, lp in zip(ids[:, i].tolist(), lps[:, i].tolist()):
                tokens[i].append(t)
                logprobs[i].append(lp)
                if t == eos_id or len(tokens[i]) == max_new_tokens:
                    done[i] = True
                    break
        if done.all():
            break
    if routing is not None:
        routing.extend(np.stack(row[:len(p) + len(t) - 1]) for row, p, t in
                       zip(chosen, prompts, tokens))
    return tokens, logprobs


def _record(chosen, experts, prefill: bool, prompts, done):
    """Append a fetched call's expert choices to each unfinished row's: a prefill's
    (1, n, L, T, K) for the prompt's positions, a decode call's (C, B, L, K) one per step
    (the choices of the token that step fed). Past a row's end they are cut off later."""
    for i in np.flatnonzero(~done):
        if prefill:
            chosen[i].extend(experts[0, i, :, :len(prompts[i])].swapaxes(0, 1))
        else:
            chosen[i].extend(experts[:, i])


def token_rows(prompts, completions, G: int, T: int, pad_id: int, keep: np.ndarray) -> dict:
    """Rows of prompt + completion (N, T+1) as input_tokens, target_tokens and loss_masks
    (N, T), the loss on the completion's tokens of the rows `keep`s."""
    N = len(completions)
    tokens = np.full((N, T + 1), pad_id, np.int32)
    masks = np.zeros((N, T + 1), np.float32)
    for i, completion in enumerate(completions):
        prompt = prompts[i // G]
        row = list(prompt) + list(completion)
        tokens[i, :len(row)] = row
        masks[i, len(prompt):len(row)] = float(keep[i])
    return {"input_tokens": tokens[:, :-1], "target_tokens": tokens[:, 1:],
            "loss_masks": masks[:, 1:]}


def completion_values(prompts, values, G: int, T: int) -> np.ndarray:
    """(N, T) float32: each completion's per-token `values` (the engine's log-probabilities)
    where token_rows puts its targets, 0 elsewhere."""
    out = np.zeros((len(values), T), np.float32)
    for i, row in enumerate(values):
        start = len(prompts[i // G]) - 1  # the target of input position p is token p + 1
        row = row[:T - start]
        out[i, start:start + len(row)] = row
    return out


def completion_routing(routing, T: int) -> np.ndarray:
    """(N, L, T, K) int16: each row's recorded expert choices (`generate`'s) where
    token_rows puts its input tokens, -1 (route as usual) past them."""
    L, K = routing[0].shape[1:]
    out = np.full((len(routing), L, T, K), -1, np.int16)
    for i, row in enumerate(routing):
        row = row[:T]
        out[i, :, :len(row)] = row.swapaxes(0, 1)
    return out


def reward_inputs(examples, completions, texts, chat: bool = False):
    """TRL's reward-function arguments: (prompts, completions, completion_ids, fields), from
    each completion's example (a prompt's, repeated for its G completions), ids and text.
    `chat` (multi-turn episodes): `texts` are the messages after the prompt, as they are."""
    prompts, shown, fields = [], [], {}
    keys = sorted({k for e in examples for k in e} - {"prompt", "completion", "completion_ids"})
    for example, text in zip(examples, texts):
        prompts.append(example["prompt"])
        if chat:
            shown.append(text)
        elif not isinstance(example["prompt"], str):
            shown.append([{"role": "assistant", "content": text}])
        else:
            shown.append(text)
        for k in keys:
            fields.setdefault(k, []).append(example.get(k))
    return prompts, shown, [list(c) for c in completions], fields


def gather_prompts(prompts: dict) -> tuple[dict, slice]:
    """(every process's prompt rows in global row order, the slice of them this process
    serves): each process then issues the same engine calls over all rows (they are
    collective), scores every completion alike (reward functions must be deterministic)
    and places its own rows. One process: its rows, all of them."""
    if jax.process_count() == 1:
        return prompts, slice(None)
    if "image_encodings" in prompts:
        raise UserError("--objective=grpo on prompts with images runs in one process as yet")
    from jax.experimental import multihost_utils

    local = json.dumps({"tokens": [t[:n].tolist() for t, n in zip(prompts["prompt_tokens"],
                                                                  prompts["prompt_lengths"])],
                        "examples": list(prompts["examples"])}, default=str).encode()
    data = np.frombuffer(local, np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:len(data)] = data
    parts = [json.loads(bytes(row[:n])) for row, n in
             zip(np.asarray(multihost_utils.process_allgather(padded)), sizes)]
    tokens = [t for part in parts for t in part["tokens"]]
    examples = np.empty(len(tokens), object)
    examples[:] = [e for part in parts for e in part["examples"]]
    batch = np.zeros((len(tokens), max(map(len, tokens), default=1) or 1), np.int32)
    for i, t in enumerate(tokens):
        batch[i, :len(t)] = t
    b = len(prompts["prompt_lengths"])
    return ({"prompt_tokens": batch, "prompt_lengths": np.asarray(list(map(len, tokens)),
                                                                  np.int32),
             "examples": examples}, slice(jax.process_index() * b, (jax.process_index() + 1) * b))


def cache_sizes(engine) -> dict:
    """A paged engine's pool (pages, the scratch page included), the bytes of its cache
    (the pool, each row's state and the page table, all devices') and those of the dense
    cache of its rows (every row's whole length)."""
    dense = jax.eval_shape(lambda: engine.model.init_cache(engine.batch_size, engine.seq_length))
    return {"cache_pool_pages": engine.layout.pages,
            "cache_bytes": sum(x.nbytes for x in jax.tree.leaves(engine.cache)),
            "dense_cache_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dense))}


def generation_metrics(generated: dict, tokens: int) -> dict:
    """A rollout's generation metrics from `Rollouts._leased`'s record and the tokens it
    sampled: seconds, tokens per second, the prompt tokens run through the model
    (prefill_tokens: a prompt a group shares once, with share_prompts) and those copied
    from a shared prompt's cache (cached_prompt_tokens); with --grpo.page_size, the cache
    pages the rows held at the end (cache_pages: a group's prompt pages once), the pool's
    pages and its bytes beside the dense cache's (`cache_sizes`)."""
    seconds = generated["seconds"]
    pages = {} if generated.get("pages") is None else {
        "rollout/cache_pages": float(generated["pages"]),
        **{f"rollout/{k}": float(generated[k]) for k in ("cache_pool_pages", "cache_bytes",
                                                       "dense_cache_bytes")}}
    return {"rollout/generation_seconds": seconds,
            "rollout/tokens_per_second": tokens / max(seconds, 1e-9),
            "rollout/prefill_tokens": float(generated["prefilled"]),
            "rollout/cached_prompt_tokens": float(generated["cached"]), **pages}


def _nothing(batch: dict) -> dict:
    """`batch` (a rollout's host arrays) as places that count nowhere: not valid, no loss
    mask, no advantage, no reward counted."""
    out = dict(batch)
    for key in ("valid", "loss_masks", "advantages"):
        out[key] = np.zeros_like(batch[key])
    for key in batch:
        if key.startswith("rewards/"):
            out[key] = np.zeros_like(batch[key])
    return out


class Rollouts:
    """The GRPO objective's batches (`batches`), made on the mesh the train state is on."""

    def __init__(self, objective, state):
        self.objective, self.options = objective, objective.options
        self.mesh = jax.tree.leaves(state.params)[0].sharding.mesh
        self.engines = {}  # (rows, seq_length) -> Engine
        self.names = [getattr(f, "__name__", name) if ":" in name else name
                      for name, f in objective.reward_functions]
        self._score = self._scoring_program()
        self._train_began = None

    def _scoring_program(self):
        """A jitted (params, frozen, batch) -> ({old_logps, ref_logps, scored_logps,
        is_ratio, logp_difference} (B, G, T), each where the loss reads it; metrics), or
        None when it has nothing to make. The policy's forward is made once for old_logps,
        the importance weights, scored_logps (the policy beside the reference, from one
        program, for the KL: grpo_sums) and, at temperature 1 (where the engine's
        log-probabilities are of the same distribution), the sampler-vs-trainer metrics:
        the largest and the mean |training logp - engine logp| over completion tokens,
        on the parameters that sampled (logged as data/rollout/sampler_logp_diff_max, _mean)."""
        objective, o = self.objective, self.options
        old, ref, weights = (o.num_iterations > 1, objective.reference != "none",
                             corrects_sampling(o))
        compare = o.temperature == 1
        if not (old or ref or weights or compare):
            return None

        def logps(params, frozen, batch, reference=False):
            tokens = batch["input_tokens"]
            out, _ = objective.token_logps(params, frozen, rows(tokens),
                                           rows(batch["target_tokens"]), reference,
                                           routing=batch.get("routing"),
                                           images=image_rows(batch))
            return out.reshape(tokens.shape)

        def score(params, frozen, batch):
            out, metrics = {}, {}
            policy = logps(params, frozen, batch)
            diff = (policy - batch["sampling_logps"]) * batch["loss_masks"]
            if old:
                out["old_logps"] = policy
            if weights:
                out["is_ratio"] = sampling_weights(diff, batch["loss_masks"],
                                                   o.importance_sampling_mode,
                                                   o.importance_sampling_cap)
                out["logp_difference"] = jnp.abs(diff)
            if compare:
                metrics["rollout/sampler_logp_diff_max"] = jnp.max(jnp.abs(diff))
                metrics["rollout/sampler_logp_diff_mean"] = jnp.sum(jnp.abs(diff)) / jnp.maximum(
                    jnp.sum(batch["loss_masks"]), 1.0)
            if ref:
                out["ref_logps"] = logps(params, frozen, batch, reference=True)
                out["scored_logps"] = policy
            return out, metrics

        return jax.jit(score, out_shardings=(NamedSharding(self.mesh, P(BATCH_AXES)),
                                             NamedSharding(self.mesh, P())))

    def _engine(self, n: int, seq_length: int):
        """The engine for n rows of seq_length tokens: every prompt in one prefill bucket
        (min_bucket: the longest prompt a row takes), so one prefill program and the
        decode windows (compiled at its first rollout) serve every rollout."""
        key = (n, seq_length)
        if key not in self.engines:
            config = engine_lib.get_default_config({
                "batch_size": n, "seq_length": seq_length,
                "min_bucket": seq_length - self.options.max_new_tokens,
                "share_prompts": self.options.share_prompts,
                "page_size": self.options.page_size,
                "decode_from_pages": self.options.decode_from_pages,
                "decode_kernel": self.options.decode_kernel,
                # one group per prompt: a rollout's rows are its prompts' copies
                "prefix_groups": -(-n // self.options.num_generations)
                if self.options.shared_prefix_attention else 0})
            config.pages = self._pool_pages(config)
            self.engines[key] = engine_lib.Engine(config, self.objective.model, None, self.mesh,
                                                  record_routing=self.options.routing_replay)
            self.engines[key].release()  # until the first rollout
        return self.engines[key]

    def _pool_pages(self, config) -> int:
        """With --grpo.page_size and sharing, one-turn rollouts' pool: what the groups
        need at most (`pages.group_pages`: each prompt's full pages once, each
        completion's own, the positions decode calls write past max_new_tokens before
        the host reads that a row ended), not every row's whole length; else 0 (the
        engine's default: every row's length). Episodes' rows grow by their turns, and a
        recurrent state (Gated DeltaNet) shares no page: the whole length for them."""
        o = self.options
        if not (o.page_size and o.share_prompts and self.objective.environment is None) or \
                cache_layout.check_cache(self.objective.model).has_state:
            return 0
        steps = config.decode_steps
        written = -(-(o.max_new_tokens - 1) // steps) * steps  # decode calls x steps
        return pages_lib.group_pages(config.batch_size, o.num_generations, config.min_bucket,
                                     written, config.seq_length, o.page_size)

    def batches(self, dataset, place, live_state):
        """(device batch, metrics) per step. A batch of rollouts serves num_iterations
        steps, the first of them at a step that is a multiple of num_iterations (a run
        resumed between two has a shorter cycle first)."""
        evaluating, mu = dataset.for_eval, self.options.num_iterations
        data = dataset.iterate()
        for index, (prompts, data_metrics) in enumerate(data):
            prompts, rows_here = gather_prompts(prompts)
            state = live_state()
            step = int(state.step)  # waits for the step in flight: the train time
            now = time.perf_counter()
            train = {} if evaluating or self._train_began is None else \
                {"rollout/train_seconds": now - self._train_began}
            if self.options.dynamic_sampling and not evaluating:
                batch, metrics, data_metrics = self.informative_rollout(
                    state, prompts, data_metrics, data, dataset.seq_length, step)
            else:
                batch, metrics = self.rollout(state, prompts, dataset.seq_length, (
                    _EVAL, step, index) if evaluating else (_TRAIN, step, 0))
            batch = place({k: v[rows_here] for k, v in batch.items()})
            if self._score is not None:
                scored, compared = self._score(state.params, state.frozen, batch)
                batch.update(scored)
                metrics.update({k: float(v) for k, v in compared.items()})
            batch.pop("sampling_logps")  # read by the scoring program only
            metrics["rollout/seconds"] = time.perf_counter() - now
            if not evaluating:
                self._train_began = time.perf_counter()
            for _ in range(1 if evaluating else mu - step % mu):
                yield batch, {**data_metrics, **train, **metrics}

    def rollout(self, state, prompts: dict, T: int, where: tuple):
        """(host batch, metrics): G completions of each prompt of `prompts` (a prompts
        batch), their rewards, advantages and token rows."""
        o, objective = self.options, self.objective
        if objective.environment is not None:
            return self.episode_rollout(state, prompts, T, where)
        G, lengths = o.num_generations, prompts["prompt_lengths"]
        valid = lengths > 0  # (B,) padding rows at the end of an eval pass
        pad = objective.tokenizer.pad_token_id or 0
        prompt_ids = [prompts["prompt_tokens"][b, :n].tolist() if n else [pad]
                      for b, n in enumerate(lengths)]
        # A group's G rows share their prompt: the engine prefills it once (share_prompts).
        repeated = [p for p in prompt_ids for _ in range(G)]
        routing = [] if o.routing_replay else None
        images = self._prompt_images(prompts, repeated)
        with self._leased(state, len(repeated), T, where) as (engine, sampling, generated):
            completions, logprobs = generate(engine, repeated, sampling, o.max_new_tokens,
                                             objective.model.eos_token_id, routing, images)
        per_function, truncated, keep = self._completion_rewards(prompts, completions, valid)
        rows_ = token_rows(prompt_ids, completions, G, T, pad, keep)
        rows_["sampling_logps"] = completion_values(prompt_ids, logprobs, G, T)
        if routing is not None:  # (N, L, T, K): what the training forward replays
            rows_["routing"] = completion_routing(routing, T)
        if images is not None:  # the rows' image inputs, for every forward over them
            rows_.update(images.lay_out(list(range(len(repeated))), T))
        return self._assemble(rows_, per_function, valid, truncated,
                              [len(c) for c in completions], generated)

    def _prompt_images(self, prompts: dict, repeated: list):
        """The engine's `PromptImages` of an image prompts batch's G rows per prompt, or
        None for text prompts. A prompt's key is its images' content (`vision.images_key`):
        a group shares its prompt's prefill and pages, and so do prompts of equal tokens
        and images; equal tokens with other images never do.
        Laid out to a training row's T tokens, the same inputs serve its forward: the
        completion's tokens are text (a sampled placeholder token too, as in the engine),
        its rotary positions counting on from the prompt's."""
        encodings = prompts.get("image_encodings")
        if encodings is None:
            return None
        if self.objective.environment is not None:
            raise UserError("--grpo.environment and --grpo.tools do not take prompts with "
                            "images as yet")
        G, reader = self.options.num_generations, self.objective.images

        def lay_out(requests, T):
            return reader.batch_inputs([[0] if i is None else repeated[i] for i in requests],
                                       [[] if i is None else encodings[i // G]
                                        for i in requests], T)

        keys = [vision.images_key(encoded) for encoded in encodings]
        return engine_lib.PromptImages([keys[i // G] for i in range(len(repeated))], lay_out)

    @contextlib.contextmanager
    def _leased(self, state, n: int, T: int, where: tuple):
        """(the engine of n rows, reset, on the live parameters; each row's sampling; a
        dict that holds, once the block ends, the generation's seconds and the engine's
        prompt-token counts). On leaving, the engine lets go of the parameters (the next
        train step donates their buffers) and of its cache."""
        o = self.options
        sampling = engine_lib.Sampling.empty(n)
        sampling.keys[:] = sampling_keys(self.objective.config.seed, *where, n)
        sampling.temperature[:], sampling.top_p[:] = o.temperature, o.top_p
        fresh = (n, T) not in self.engines
        engine = self._engine(n, T)
        engine.params, engine.base = state.params, state.frozen.get("base")
        engine.reset()
        if fresh:  # every decode window now: no program at a later step
            engine.compile_decode(sampling.pad(n))
            engine.reset()
        generated, began = {}, time.perf_counter()
        sizes = cache_sizes(engine) if engine.pages else {}
        try:
            yield engine, sampling, generated
        finally:
            engine.params = engine.base = None
            engine.release()
        generated.update(seconds=time.perf_counter() - began, **engine.prompt_tokens,
                         pages=engine.pages.in_use if engine.pages else None, **sizes)

    def episode_rollout(self, state, prompts: dict, T: int, where: tuple):
        """(host batch, metrics): G multi-turn episodes of each prompt's example with the
        objective's environment (episodes.py), their rewards, advantages and token rows
        (the loss on the model's tokens only)."""
        o, objective = self.options, self.objective
        G, valid = o.num_generations, prompts["prompt_lengths"] > 0
        pad = objective.tokenizer.pad_token_id or 0
        episodes, shown = self._episodes(prompts["examples"], valid, T, pad)
        with self._leased(state, len(episodes), T, where) as (engine, sampling, generated):
            episodes_lib.run_episodes(engine, episodes, sampling, o.max_new_tokens,
                                      o.max_turns, objective.renderer, objective.tokenizer)
        row_valid = np.repeat(valid, G)
        real = np.flatnonzero(row_valid)
        sampled = [[t for t, m in zip(e.tokens, e.model) if m] for e in episodes]
        B = len(valid)
        per_function = self._rewards(
            real, B, [dict(prompts["examples"][i // G], environment_reward=episodes[i].reward)
                      for i in real], [sampled[i] for i in real],
            [episodes[i].messages[len(shown[i]):] for i in real], chat=True)
        truncated = np.asarray([e.truncated for e in episodes])
        keep = row_valid & ~(truncated & o.mask_truncated_completions)
        rows_ = episodes_lib.episode_rows(episodes, T, pad, keep)
        batch, metrics = self._assemble(rows_, per_function, valid, truncated,
                                        [len(t) for t in sampled], generated)
        done = [episodes[i] for i in real] or [episodes_lib.Episode(None, [], [], [], [])]
        envs = [e.env for e in done]
        metrics.update({
            "rollout/turns_per_episode": float(np.mean([e.turns for e in done])),
            "rollout/prefill_tokens_per_episode": float(np.mean([e.prefilled for e in done])),
            "rollout/tool_calls": float(sum(getattr(v, "calls", 0) for v in envs)),
            "rollout/tool_errors": float(sum(getattr(v, "errors", 0) for v in envs))})
        return batch, metrics

    def _episodes(self, examples, valid, T: int, pad: int):
        """(G new episodes of each example, each one's prompt messages): an environment
        each, reset on its example; a padding row's (not `valid`) has none."""
        objective, G = self.objective, self.options.num_generations
        episodes, shown = [], []
        for b, example in enumerate(examples):
            for _ in range(G):
                if not valid[b]:
                    episodes.append(episodes_lib.Episode(None, [], [pad], [False], [0.0]))
                    shown.append([])
                    continue
                env = objective.environment()
                messages = list(env.reset(dict(example)))
                ids = objective.renderer.ids(messages, True)
                if len(ids) >= T:
                    raise UserError(f"a prompt rendered with the chat template (and the tools' "
                                    f"schemas) is {len(ids)} tokens, which leaves no room in "
                                    f"rows of seq_length={T}")
                episodes.append(episodes_lib.Episode(env, messages, ids, [False] * len(ids),
                                                     [0.0] * len(ids)))
                shown.append(list(messages))
        return episodes, shown

    def informative_rollout(self, state, prompts, data_metrics, data, T: int, step: int):
        """(host batch, metrics, the last prompts' data metrics): DAPO's dynamic sampling.
        Rollouts of `prompts`, then of the next batches of `data` (each process's, gathered
        as any), until B groups with a reward signal (rewards not all equal) fill the batch
        or max_sampling_rounds batches are spent. The groups keep the order they were
        sampled in; surplus ones are dropped; places still empty hold a group marked not
        valid (no loss, no metric). Round r samples with the keys of (step, r), so a
        resumed run, whose data state counts every batch drawn, samples the same."""
        B = len(prompts["prompt_lengths"])
        parts, found, counts = [], 0, collections.Counter()
        seconds = tokens = longest = prefilled = cached = 0.0
        for round_ in range(self.options.max_sampling_rounds):
            if round_:
                try:
                    prompts, data_metrics = next(data)
                except StopIteration:  # a single pass ran out: train on what there is
                    break
                prompts, _ = gather_prompts(prompts)
            batch, metrics = self.rollout(state, prompts, T, (_TRAIN, step, round_))
            seconds += metrics["rollout/generation_seconds"]
            tokens += metrics["rollout/tokens_per_second"] * metrics["rollout/generation_seconds"]
            longest = max(longest, metrics["completions/max_length"])
            prefilled += metrics["rollout/prefill_tokens"]
            cached += metrics["rollout/cached_prompt_tokens"]
            valid = batch["valid"][:, 0] > 0
            signal = np.flatnonzero(valid & ~(batch["frac_reward_zero_std"][:, 0] > 0))
            counts["sampled_groups"] += int(valid.sum())
            counts["dropped_groups"] += int(valid.sum()) - len(signal)
            take = signal[:B - found]
            counts["surplus_groups"] += len(signal) - len(take)
            parts.append((batch, take))
            found += len(take)
            counts["rounds"] += 1
            if found == B:
                break
        if found < B:  # the last batch's first groups, trained on by no loss or metric
            batch = parts[-1][0]
            parts.append((_nothing(batch), np.arange(B - found)))
            counts["empty_groups"] = B - found
        batch = {k: np.concatenate([b[k][take] for b, take in parts]) for k in parts[0][0]}
        metrics = {"rollout/generation_seconds": seconds,
                   "rollout/tokens_per_second": tokens / max(seconds, 1e-9),
                   "rollout/prefill_tokens": prefilled, "rollout/cached_prompt_tokens": cached,
                   "completions/max_length": longest}
        metrics.update({f"dynamic_sampling/{k}": float(counts[k]) for k in (
            "rounds", "sampled_groups", "dropped_groups", "surplus_groups", "empty_groups")})
        return batch, metrics, data_metrics

    def _completion_rewards(self, prompts, completions, valid):
        """(each reward function's rewards (F, B, G), each completion's truncation flag
        (N,), whether the loss keeps it (N,)) of one-turn `completions`."""
        o, objective = self.options, self.objective
        B, G = len(valid), o.num_generations
        eos = objective.model.eos_token_id
        row_valid = np.repeat(valid, G)
        truncated = np.asarray([not c or c[-1] != eos for c in completions])
        real = np.flatnonzero(row_valid)
        texts = objective.tokenizer.batch_decode(
            [completions[i][:-1] if not truncated[i] else completions[i] for i in real],
            skip_special_tokens=True)
        per_function = self._rewards(real, B, [prompts["examples"][i // G] for i in real],
                                     [completions[i] for i in real], texts)
        return per_function, truncated, row_valid & ~(truncated & o.mask_truncated_completions)

    def _rewards(self, real, B: int, examples, completions, texts, chat: bool = False):
        """Each reward function's rewards (F, B, G) of the rows `real` (their examples,
        completions and texts, in that order); NaN elsewhere."""
        G = self.options.num_generations
        per_function = np.full((len(self.names), B * G), np.nan)
        if len(real):
            per_function[:, real] = rewards_lib.score(self.objective.reward_functions,
                                                      *reward_inputs(examples, completions,
                                                                     texts, chat=chat))
        return per_function.reshape(-1, B, G)

    def _assemble(self, batch, per_function, valid, truncated, lengths, generated):
        """(the host batch (B, G, ...), metrics) of a rollout, one-turn or episodes: from
        its rows (N, ...: token rows, sampling_logps and with routing replay routing), each
        function's rewards (F, B, G), the completions' truncation flags and sampled
        lengths (N,), and `_leased`'s record of the generation."""
        o, objective = self.options, self.objective
        B, G = len(valid), o.num_generations
        row_valid = np.repeat(valid, G)
        rewards, adv, std = advantages(per_function, objective.weights, o.scale_rewards,
                                       np.broadcast_to(valid[:, None], (B, G)))
        batch = {k: v.reshape(B, G, *v.shape[1:]) for k, v in batch.items()}
        lengths = np.asarray(lengths, np.float32)
        values = {"advantages": adv, "valid": row_valid, "reward": np.nan_to_num(rewards),
                  "reward_std": np.nan_to_num(std), "frac_reward_zero_std": np.isclose(std, 0),
                  "completions/mean_length": lengths, "completions/clipped_ratio": truncated}
        for name, r in zip(self.names, per_function):
            values[f"rewards/{name}/sum"] = np.nan_to_num(r)
            values[f"rewards/{name}/count"] = ~np.isnan(r)
        batch.update({k: np.asarray(v, np.float32).reshape(B, G) for k, v in values.items()})
        return batch, {"completions/max_length": float(lengths[row_valid].max(initial=0)),
                       **generation_metrics(generated, int(lengths.sum()))}
