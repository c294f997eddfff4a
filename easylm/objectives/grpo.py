"""GRPO (`--objective=grpo`): online RL with verifiable rewards, its DAPO and Dr. GRPO
variants, as TRL's GRPOTrainer computes them (`_compute_loss`); formulas, papers, options
and metrics in docs/rl.md.

Each step's batch is made from rollouts of the live parameters (rollouts.py): B prompts
from the data pipeline (--train_dataset.*.batch_size), G = --grpo.num_generations
completions each, sampled by the serving engine on the trainer's mesh, scored by the
reward functions (rewards.py), turned into advantages (rollouts.advantages), then trained
on by the ordinary step `(state, batch) -> (state, metrics)`. A batch holds (B, G, T)
arrays (a prompt's group stays on one device): input_tokens, target_tokens, loss_masks
(1 on the completion's tokens), advantages (B, G), old_logps / ref_logps (B, G, T) where
the loss needs them, and per-completion values the metrics sum (`ROW_METRICS`).

Shape letters: B prompts, G completions per prompt, N = B*G rows, T positions, V vocabulary.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from easylm.data import environments
from easylm.data.conversations import make_renderer
from easylm.data.options import loader_block
from easylm.errors import UserError
from easylm.models.paged_attention import DECODE_KERNELS
from easylm.objectives import rewards as rewards_lib
from easylm.objectives.base import BASE, COPY, NO_REFERENCE, Objective
from easylm.objectives.chunked_logps import chunked_token_logps
from easylm.objectives.rollouts import (
    ROW_METRICS,
    Rollouts,
    corrects_sampling,
    image_rows,
    rows,
    token_logps,
)
from easylm.objectives.router_loss import fed_tokens, with_router_loss

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

HELP = {
    "grpo.num_generations": "G: completions sampled per prompt (the group its advantages "
                            "compare within); the step trains on batch_size x G completions",
    "grpo.max_new_tokens": "the longest completion, in tokens (TRL's max_completion_length); "
                           "a prompt may use the rest of the row (seq_length - this)",
    "grpo.temperature": "sampling temperature of the rollouts; the log-probabilities are of "
                        "the logits divided by it, as TRL's are",
    "grpo.top_p": "nucleus sampling of the rollouts (1: off)",
    "grpo.beta": "weight of the k3 KL to the reference (LoRA: the base with the adapters "
                 "off; else a frozen copy of the starting parameters); 0: no reference",
    "grpo.use_bias_correction_kl": "multiply the per-token KL by the ratio exp(logp - "
                                   "old_logp) (TRL's option and default; DeepSeek-V3.2): 1 in "
                                   "value, it adds KL x grad(logp) to the gradient, the "
                                   "unbiased reverse-KL gradient",
    "grpo.epsilon": "the clip range below: ratios under 1 - epsilon are clipped",
    "grpo.epsilon_high": "the clip range above (DAPO's clip-higher); 0: epsilon",
    "grpo.loss_type": "how per-token losses are averaged: grpo (per completion, then over "
                      "completions), bnpo and dapo (over the step's completion tokens), "
                      "dr_grpo (a sum over tokens / (completions x max_new_tokens))",
    "grpo.scale_rewards": "advantages divided by the std of the group's rewards (group), of "
                          "the batch's (batch), or not (none: Dr. GRPO)",
    "grpo.num_iterations": "optimizer steps on each batch of rollouts (mu), the ratio taken "
                           "against the rollouts' log-probabilities",
    "grpo.mask_truncated_completions": "completions cut at max_new_tokens get no loss (DAPO)",
    "grpo.reward_funcs": "comma-separated reward functions: answer_match, format, "
                         "length_penalty, math_verify, or module:function (docs/rl.md)",
    "grpo.reward_weights": "comma-separated weights of reward_funcs ('': all 1)",
    "grpo.format_pattern": "the format reward's regular expression ('': an answer after "
                           "#### or in \\boxed{})",
    "grpo.length_buffer": "length_penalty's buffer in tokens before max_new_tokens (0: a "
                          "quarter of max_new_tokens)",
    "grpo.importance_sampling_level": "the policy ratio of the clipped term (TRL's option): "
                                      "token (per token), or sequence (GSPO: exp of the "
                                      "mean over the completion's tokens of logp - old_logp, "
                                      "one ratio per completion, clipped by epsilon / "
                                      "epsilon_high)",
    "grpo.importance_sampling_cap": "importance sampling of the engine's sampled "
                                    "tokens against the training forward, the weights' cap "
                                    "(TRL's vllm_importance_sampling_clip_max); 0: off. "
                                    "Applied at temperature 1 and top_p 1 only, where the "
                                    "engine's log-probabilities are the sampler's",
    "grpo.importance_sampling_mode": "how the cap acts (TRL's vllm_importance_sampling_mode):"
                                     " token_truncate (min(exp(logp - engine logp), cap) per "
                                     "token), token_mask (0 where that is above the cap), "
                                     "sequence_truncate / sequence_mask (the same on exp of "
                                     "the completion's summed difference, one weight a "
                                     "completion)",
    "grpo.dynamic_sampling": "DAPO's dynamic sampling: a group whose completions all got "
                             "the same reward (no advantage, nothing to learn) is dropped "
                             "and the rollouts of more prompts fill the step's batch_size "
                             "groups (at most max_sampling_rounds batches of prompts)",
    "grpo.max_sampling_rounds": "dynamic sampling's bound: batches of prompts rolled out for "
                                "one step; a batch still short after them trains on the "
                                "groups it has (the empty places count nowhere; logged as "
                                "dynamic_sampling/empty_groups)",
    "grpo.routing_replay": "a mixture-of-experts model: the engine records each token's "
                           "expert choices in every MoE layer while sampling and the "
                           "training (and scoring) forwards replay them, so that the "
                           "trainer routes as the sampler did (docs/rl.md)",
    "grpo.share_prompts": "a group's num_generations rows prefill their prompt once and "
                          "copy its cache (the engine's share_prompts; logged as "
                          "rollout/prefill_tokens and rollout/cached_prompt_tokens); False: "
                          "each row prefills its own copy",
    "grpo.page_size": "the rollout engine's paged cache (the engine's --page_size): "
                      "positions per page; a group's rows then also hold their prompt's "
                      "full pages once (with share_prompts), and a multi-turn episode's "
                      "cache grows page by page; 0: dense, each row owns seq_length "
                      "positions",
    "grpo.decode_from_pages": "with --grpo.page_size, the rollouts' decode attends straight "
                              "from the pages (the engine's --decode_from_pages: ragged paged "
                              "attention, the kernel on a TPU) instead of gathering each "
                              "row's window",
    "grpo.decode_kernel": "with --grpo.decode_from_pages, the engine's --decode_kernel: "
                          "batched (ours, paged_decode_kernel.py; on a v5e llama_1b decodes "
                          "29% faster than with rpa at batch 64), rpa (JAX's ragged paged "
                          "attention) or batched_vpu",
    "grpo.shared_prefix_attention": "with --grpo.decode_kernel=batched or batched_vpu: decode "
                                    "reads each group's shared prompt pages once for its "
                                    "num_generations rows (the engine's --prefix_groups, "
                                    "one group per prompt: cascade attention); on a v5e "
                                    "the qwen3_0.6b rollout 1.88x the dense cache's "
                                    "tokens/s",
    "grpo.tools": "multi-turn tool use: MODULE:FN[,FN...], plain Python functions with type "
                  "hints and an Args: docstring, shown to the model through the chat "
                  "template's tools=; its <tool_call>{json}</tool_call> (Qwen/Hermes) or "
                  "{\"name\": ..., \"parameters\": ...} (Llama 3) calls run and their "
                  "results (or errors) come back as tool messages (docs/rl.md)",
    "grpo.environment": "multi-turn episodes with MODULE:CLASS: reset(example) -> messages, "
                        "step(messages) -> (messages to append, reward or None, done); its "
                        "rewards reach the 'environment' reward function",
    "grpo.tool_timeout": "seconds a tool call may run; past it the model reads a timeout "
                         "error (0: no limit)",
    "grpo.max_turns": "model turns per multi-turn episode (each up to max_new_tokens; the "
                      "whole episode within the row's seq_length)",
}


def get_default_config(updates=None) -> ConfigDict:
    """TRL's GRPOConfig defaults where the option is the same."""
    config = ConfigDict(dict(
        num_generations=8, max_new_tokens=256, temperature=1.0, top_p=1.0, beta=0.0,
        use_bias_correction_kl=True, epsilon=0.2, epsilon_high=0.0, loss_type="dapo",
        scale_rewards="group",
        num_iterations=1, mask_truncated_completions=False, reward_funcs="answer_match",
        reward_weights="", format_pattern="", length_buffer=0,
        importance_sampling_cap=3.0, importance_sampling_mode="token_truncate",
        importance_sampling_level="token", dynamic_sampling=False, max_sampling_rounds=4,
        routing_replay=False, share_prompts=True, page_size=0, decode_from_pages=False,
        decode_kernel="batched", shared_prefix_attention=False, tools="", environment="",
        tool_timeout=10.0, max_turns=4))
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def check_options(options, seq_length: int) -> None:
    checks = (("num_generations", options.num_generations >= 2, ">= 2 (a group's rewards "
               "are compared with each other)"),
              ("max_new_tokens", 1 <= options.max_new_tokens < seq_length,
               f">= 1 and below the row's seq_length={seq_length}, leaving room for a prompt"),
              ("temperature", options.temperature > 0, "> 0"),
              ("top_p", 0 < options.top_p <= 1, "in (0, 1]"),
              ("beta", options.beta >= 0, ">= 0"),
              ("epsilon", 0 < options.epsilon < 1, "in (0, 1)"),
              ("epsilon_high", options.epsilon_high >= 0, ">= 0"),
              ("num_iterations", options.num_iterations >= 1, ">= 1"),
              ("max_sampling_rounds", options.max_sampling_rounds >= 1, ">= 1"),
              ("max_turns", options.max_turns >= 1, ">= 1"),
              ("page_size", options.page_size >= 0, ">= 0 (0: dense)"),
              ("tool_timeout", options.tool_timeout >= 0, ">= 0 (0: no limit)"),
              ("importance_sampling_cap", options.importance_sampling_cap == 0 or
               options.importance_sampling_cap >= 1, "0 (off) or >= 1"),
              ("loss_type", options.loss_type in LOSS_TYPES, f"one of {', '.join(LOSS_TYPES)}"),
              ("scale_rewards", options.scale_rewards in SCALE_REWARDS,
               f"one of {', '.join(SCALE_REWARDS)}"),
              ("importance_sampling_level", options.importance_sampling_level in IS_LEVELS,
               f"one of {', '.join(IS_LEVELS)}"),
              ("importance_sampling_mode", options.importance_sampling_mode in IS_MODES,
               f"one of {', '.join(IS_MODES)}"))
    for name, ok, expected in checks:
        if not ok:
            raise UserError(f"--grpo.{name} must be {expected}, got {options[name]!r}")
    if options.decode_from_pages and not options.page_size:
        raise UserError("--grpo.decode_from_pages needs pages: set --grpo.page_size")
    if options.decode_kernel not in DECODE_KERNELS:
        raise UserError(f"--grpo.decode_kernel must be one of {', '.join(DECODE_KERNELS)}, "
                        f"got {options.decode_kernel!r}")
    if options.decode_kernel != "batched" and not options.decode_from_pages:
        raise UserError(f"--grpo.decode_kernel={options.decode_kernel} needs "
                        f"--grpo.decode_from_pages")
    if options.shared_prefix_attention and (options.decode_kernel == "rpa"
                                            or not options.share_prompts):
        raise UserError("--grpo.shared_prefix_attention needs --grpo.decode_kernel=batched or "
                        "batched_vpu and --grpo.share_prompts")
    if options.importance_sampling_mode != "token_truncate" and not corrects_sampling(options):
        # Asked for by name, so not left out in silence as the default cap is.
        raise UserError(f"--grpo.importance_sampling_mode={options.importance_sampling_mode} "
                        f"needs the engine's log-probabilities to be the sampler's: "
                        f"--grpo.temperature=1, --grpo.top_p=1 and --grpo.importance_sampling_cap"
                        f" > 0 (got {options.temperature:g}, {options.top_p:g}, "
                        f"{options.importance_sampling_cap:g})")


def reward_weights(options, count: int) -> np.ndarray:
    text = options.reward_weights.strip()
    if not text:
        return np.ones(count)
    try:
        weights = np.asarray([float(w) for w in text.split(",")])
    except ValueError:
        raise UserError(f"--grpo.reward_weights={text!r} must be comma-separated numbers") \
            from None
    if len(weights) != count:
        raise UserError(f"--grpo.reward_weights has {len(weights)} weights for the {count} "
                        f"functions of --grpo.reward_funcs")
    return weights


# -------------------------------------------------------------- the loss (device)


class GRPOSums(NamedTuple):
    loss: jax.Array  # sum of the aggregated per-token losses, fp32 scalar
    weight: jax.Array  # its denominator: completions (grpo, dr_grpo) or tokens (bnpo, dapo)
    completions: jax.Array  # completions counted (real rows)
    tokens: jax.Array  # completion tokens with loss
    metrics: dict  # name -> sum: per token (TOKEN_METRICS), per completion, sum/count, or
    # a group's sums over the group's own count (GROUP/count: clip_ratio's)

    COUNT = "completions"  # what `weight` counts, for the logs' loss_<COUNT>
    PART = "policy_loss"  # the GRPO policy loss: logged under this name beside a total `loss`

    @property
    def count(self):
        return self.weight

    def means(self) -> dict:
        """Every sum over its own denominator: per-token metrics over tokens, per-reward
        means over the completions that function scored, a group's metrics over the
        group's count (GROUP/count), the rest over completions."""
        out = {"loss": self.loss / jnp.maximum(self.weight, 1.0)}
        completions, tokens = jnp.maximum(self.completions, 1.0), jnp.maximum(self.tokens, 1.0)
        for name, value in self.metrics.items():
            if name.endswith("/count"):
                continue
            if name.endswith("/sum"):
                count = self.metrics[name[:-len("/sum")] + "/count"]
                out[name[:-len("/sum")] + "/mean"] = value / jnp.maximum(count, 1.0)
            elif name.rsplit("/", 1)[0] + "/count" in self.metrics:
                count = self.metrics[name.rsplit("/", 1)[0] + "/count"]
                out[name] = value / jnp.maximum(count, 1.0)
            else:
                out[name] = value / (tokens if name in TOKEN_METRICS else completions)
        return out


class TokenGRPOSums(GRPOSums):
    COUNT = "tokens"  # bnpo, dapo: the loss is a mean over completion tokens


TOKEN_METRICS = ("kl", "entropy", "sampling/sampling_logp_difference/mean",
                 "sampling/importance_sampling_ratio/mean")


def grpo_sums(logps, old_logps, ref_logps, advantages, masks, valid, options,
              entropy=None, row_metrics=None, is_ratio=None, scored_logps=None) -> GRPOSums:
    """TRL's GRPO loss as sums. logps (N, T): the policy's log-probabilities of the
    sampled tokens (at the sampling temperature); old_logps (N, T) or None (one iteration:
    the ratio is 1, its gradient the policy gradient); ref_logps (N, T) or None (beta 0);
    advantages (N,); masks (N, T) the completion tokens; valid (N,) real rows; is_ratio
    (N, T) or None: the importance weights of the sampler's mismatch (rollouts.
    sampling_weights), which scale the clipped term (TRL's
    vllm_importance_sampling_correction);
    scored_logps (N, T) or None: the rollout's policy, scored by the program that scored
    ref_logps (see the KL below)."""
    eps_low = options.epsilon
    eps_high = options.epsilon_high or options.epsilon
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    log_ratio = logps - old
    if options.importance_sampling_level == "sequence":  # GSPO: (N, 1), one per completion
        log_ratio = jnp.sum(log_ratio * masks, axis=1, keepdims=True) / jnp.maximum(
            jnp.sum(masks, axis=1, keepdims=True), 1.0)
    ratio = jnp.exp(log_ratio)  # (N, T), or (N, 1) broadcast over the tokens
    a = advantages[:, None]
    per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    metrics = {}
    if is_ratio is not None:
        per_token = per_token * is_ratio
    if options.beta:
        # diff = ref - logps, the policy's part taken, where given, from the program that
        # scored the reference: ref - scored is exactly 0 while the policy is the
        # reference, and old - logps is 0 in value on one iteration. ref - logps across
        # two programs (the step's forward, the scoring one) differs in the last bits: a
        # zero-signal step had a gradient of 1e-9 to 4e-6, which Adam scales to a step.
        diff = ref_logps - logps if scored_logps is None else \
            (ref_logps - scored_logps) + (old - logps)
        kl = jnp.exp(diff) - diff - 1
        if options.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + options.beta * kl
        metrics["kl"] = jnp.sum(kl * masks)
    metrics.update(clip_ratio_sums(ratio, a, masks, valid, options))
    if entropy is not None:
        metrics["entropy"] = jnp.sum(entropy * masks)
    lengths = jnp.sum(masks, axis=1)
    completions = jnp.sum(valid)
    summed = jnp.sum(per_token * masks, axis=1)  # (N,)
    sums_type, weight = GRPOSums, completions
    if options.loss_type == "grpo":
        loss = jnp.sum(summed / jnp.maximum(lengths, 1.0))
    elif options.loss_type == "dr_grpo":
        loss = jnp.sum(summed) / options.max_new_tokens
    else:  # bnpo, dapo: a mean over the step's completion tokens
        loss, sums_type, weight = jnp.sum(summed), TokenGRPOSums, jnp.sum(lengths)
    for name, value in (row_metrics or {}).items():
        metrics[name] = jnp.sum(value * (1.0 if name.endswith(("/sum", "/count")) else valid))
    return sums_type(loss=loss, weight=weight, completions=completions,
                     tokens=jnp.sum(lengths), metrics=metrics)


def clip_ratio_sums(ratio, a, masks, valid, options) -> dict:
    """The clipped shares' sums and their count, as TRL's global_masked_mean counts them:
    of the completion tokens, or with one ratio a completion (GSPO: ratio (N, 1)) of the
    completions, each counted once whatever its length."""
    low = (ratio < 1 - options.epsilon) & (a < 0)
    high = (ratio > 1 + (options.epsilon_high or options.epsilon)) & (a > 0)
    counted = valid[:, None] if options.importance_sampling_level == "sequence" else masks
    return {"clip_ratio/low_mean": jnp.sum(low * counted),
            "clip_ratio/high_mean": jnp.sum(high * counted),
            "clip_ratio/region_mean": jnp.sum((low | high) * counted),
            "clip_ratio/count": jnp.sum(counted)}


# -------------------------------------------------------------- the trainer's objective


class GRPOObjective(Objective):
    """GRPO on rollouts of the live parameters. The reference (beta > 0): under LoRA the
    base with the adapters off, else a frozen copy of the starting parameters."""

    name = "grpo"
    rows = "prompts"
    takes_images = True  # rollouts prefill a prompt's images (rollouts.py)
    HELP = HELP

    @classmethod
    def get_default_config(cls) -> ConfigDict:
        return get_default_config()

    @classmethod
    def check_config(cls, config) -> None:
        data = config.train_dataset
        if data.type == "json" and data.json_dataset.path == "embedded":
            raise UserError("--objective=grpo makes rollouts from prompts: set --train_dataset."
                            "json_dataset.path to JSON lines with a prompt (and the fields your "
                            "reward functions read, e.g. answer; docs/rl.md)")
        check_options(config.grpo, data[loader_block(data)].seq_length)
        lora = config.get("lora")
        if lora is not None and lora.get("rank") and lora.get("dropout"):
            raise UserError(f"--lora.dropout={lora.dropout} does not act in --objective=grpo "
                            f"(its forward is the serving engine's, which has none): set it "
                            f"to 0")
        environments.load(config.grpo)  # the tools or environment it imports, at start

    def __init__(self, model, config, tokenizer):
        super().__init__(model, config, tokenizer)
        self.options = options = get_default_config(config.grpo.to_dict())
        self.rows_per_example = options.num_generations  # tokens/step: B x G rows
        self.completion_tokens = options.max_new_tokens
        if model.init_cache is None:
            raise UserError(f"--objective=grpo: the {model.name} model has no serving engine "
                            f"to make rollouts with")
        if options.routing_replay and model.router_loss is None:
            raise UserError(f"--grpo.routing_replay=True replays a mixture of experts' routing: "
                            f"the {model.name} model has no routers")
        self.environment, self.renderer = self._environment(model, config, tokenizer)
        self.reward_functions = rewards_lib.load(options.reward_funcs, options)
        self.weights = reward_weights(options, len(self.reward_functions))
        if not options.beta:
            self.reference = NO_REFERENCE
        else:
            self.reference = BASE if model.frozen is not None else COPY
        self._rollouts = None  # rollouts.Rollouts, made in prepare_run

    def _environment(self, model, config, tokenizer):
        """(a factory of one environment per episode, its ChatRenderer (None without a
        tokenizer: a plan)), or (None, None) for single-turn rollouts."""
        options = self.options
        loaded = environments.load(options)
        if loaded is None:
            return None, None
        factory, schemas = loaded
        flag = "--grpo.tools" if options.tools else "--grpo.environment"
        if tokenizer is None:  # a plan: no rollout, no conversation to render
            return factory, None
        renderer = make_renderer(flag, config.train_dataset.text_processor.chat_template,
                                 tokenizer, schemas, model.eos_token_id)
        return factory, renderer

    def token_logps(self, params, frozen, tokens, targets, reference: bool = False,
                    positions=None, routing=None, router_stats=False, images=None):
        """(log-probabilities of `targets` (N, T), entropies (N, T)) at the sampling
        temperature under the policy `params` (on the frozen base, for a variant), or the
        reference (the base with the adapters off, or the frozen copy). With the model's
        `loss_chunk_size` they are made from the hidden states a chunk of positions at a
        time (chunked_logps.py): never the (N, T, V) logits. `positions` (N, T): the
        tokens' places when they come in another order (zig-zag under sp); `images`: the
        rows' image inputs (N, ...), an image-text model's prompts'."""
        model = self.model
        if reference and model.frozen is not None:
            params = model.frozen.adapters_off(params)
        elif reference:
            params, frozen = frozen["reference"], {}
        base, temperature = frozen.get("base"), self.options.temperature
        kwargs = {"base": base, "return_hidden": bool(model.loss_chunk_size),
                  "positions": positions, "images": images}
        if routing is not None:  # (B, G, L, T, K) -> (L, N*T, K), as the forward replays it
            L, K = routing.shape[2], routing.shape[-1]
            kwargs["routing"] = jnp.moveaxis(rows(routing), 1, 0).reshape(L, -1, K)
        out = model.forward(params, tokens, router_stats=router_stats, **kwargs)
        if not model.loss_chunk_size:
            logps = token_logps(out.logits, targets, temperature)
        else:
            logps = chunked_token_logps(out.hidden, model.head(params, base), targets,
                                        temperature, model.loss_chunk_size)
        return logps if out.router_stats is None else (*logps, out.router_stats)

    def loss_fn(self, params, batch, rng, frozen):
        del rng  # the serving forward has no dropout
        tokens, targets = rows(batch["input_tokens"]), rows(batch["target_tokens"])
        positions = rows(batch["positions"]) if "positions" in batch else None
        router_loss = self.model.router_loss  # a mixture of experts: its router terms too
        logps, entropy, *stats = self.token_logps(params, frozen, tokens, targets,
                                                  positions=positions,
                                                  routing=batch.get("routing"),
                                                  router_stats=router_loss is not None,
                                                  images=image_rows(batch))
        old = rows(batch["old_logps"]) if "old_logps" in batch else None
        ref = rows(batch["ref_logps"]) if "ref_logps" in batch else None
        is_ratio = rows(batch["is_ratio"]) if "is_ratio" in batch else None
        masks = rows(batch["loss_masks"])
        scored = rows(batch["scored_logps"]) if "scored_logps" in batch else None
        sums = grpo_sums(logps, old, ref, rows(batch["advantages"]), masks,
                         rows(batch["valid"]), self.options, jax.lax.stop_gradient(entropy),
                         {k: rows(v) for k, v in batch.items() if k in ROW_METRICS
                          or k.startswith("rewards/")}, is_ratio, scored)
        if is_ratio is not None:  # the sampler against the training forward, per token
            sums.metrics["sampling/importance_sampling_ratio/mean"] = jnp.sum(is_ratio * masks)
            sums.metrics["sampling/sampling_logp_difference/mean"] = jnp.sum(
                rows(batch["logp_difference"]) * masks)
        if router_loss is None:
            return sums
        return with_router_loss(sums, stats[0], router_loss, fed_tokens(masks))

    def describe(self) -> str:
        o = self.options
        reference = {BASE: ", KL to the base (adapters off)", COPY: ", KL to a frozen copy",
                     NO_REFERENCE: ""}[self.reference]
        correction = f", importance weights {o.importance_sampling_mode} at " \
            f"{o.importance_sampling_cap:g}" if corrects_sampling(o) else ""
        level = ", sequence-level ratio (GSPO)" if o.importance_sampling_level == "sequence" \
            else ""
        return (f" | objective grpo ({o.loss_type}{level}, {o.num_generations} completions of <= "
                f"{o.max_new_tokens} tokens per prompt{reference}{correction})")

    def plan_rows(self) -> str:
        return f" prompts x {self.options.num_generations} completions"

    def rollout_cache(self, batch_size: int, seq_length: int):
        """A row for each of the step's completions (all processes' prompts x
        num_generations), of the row's length."""
        rows = batch_size * self.options.num_generations
        return jax.eval_shape(lambda: self.model.init_cache(rows, seq_length))

    def flops_per_token(self, seq_length: int) -> float:
        """The policy's forward and backward passes, and the scoring forwards made once per
        rollout (the reference's, the old policy's), spread over num_iterations steps.
        Generation is not counted (its time is logged apart: data/rollout/seconds)."""
        o = self.options
        reference = self.reference != NO_REFERENCE
        # The scoring program's policy forward: old_logps, importance weights, the KL's
        # scored_logps, and at temperature 1 the sampler-vs-trainer metrics (rollouts.py).
        policy = o.num_iterations > 1 or corrects_sampling(o) or reference or \
            o.temperature == 1
        scoring = reference + policy
        forward = self.model.forward_flops(seq_length)
        return self.model.flops_per_token(seq_length) + scoring * forward / o.num_iterations

    def prepare_run(self, run_dir, starting_params, state, place, print_fn) -> None:
        """The rollouts' engine, on the mesh the state lives on."""
        self._rollouts = Rollouts(self, state)

    def batches(self, dataset, place: Callable, live_state: Callable | None = None):
        """(device batch, metrics) per step: rollouts of `live_state()`'s parameters on the
        prompts of `dataset`; a batch of rollouts serves num_iterations steps."""
        return self._rollouts.batches(dataset, place, live_state)
