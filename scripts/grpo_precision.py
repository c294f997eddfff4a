"""How far GRPO's fp32 gradient (with respect to the model's parameters) is from float64:
easylm's (the LLaMA forward, grpo.grpo_sums) and TRL 1.16's formulas on transformers'
LlamaForCausalLM, the same tiny random model and batch, token ratios away from 1 (an
old policy 0.3 nats away per token, both clip edges hit).

    JAX_PLATFORMS=cpu python scripts/grpo_precision.py

The reference is transformers' model in torch float64. easylm's "float64" run is not a
float64 reference: its model computes norms, rope and attention scores in fp32 by design
(decoder.py, attention.py), so it is printed beside the others, not used as the truth.
Prints one line per (loss_type, beta): the largest absolute gradient difference of each
run from the reference, over every parameter, and the largest |gradient|.
"""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from easylm.llama import hf
from easylm.llama.family import FAMILY
from easylm.objectives import grpo

jax.config.update("jax_enable_x64", True)
N, T, V = 8, 48, 512


def main():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1)).eval()
    directory = tempfile.mkdtemp()
    model.save_pretrained(directory)
    config, params = hf.load_hf_params(directory)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (N, T))
    targets = np.roll(ids, -1, 1)
    positions = np.arange(T)[None]
    masks = ((positions >= 16) & (positions < rng.integers(20, T + 1, N)[:, None])).astype(float)
    advantages = rng.normal(0, 1, N)
    with torch.no_grad():
        logits = model.double()(torch.tensor(ids)).logits.numpy()
    logps = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)),
                               targets[..., None], -1)[..., 0]
    old = logps - rng.normal(0, 0.3, logps.shape)
    ref = logps + rng.normal(0, 0.3, logps.shape)

    def easylm_grads(options, dtype):
        bound = FAMILY.bind(config, dtype, dtype)
        c = lambda x: jnp.asarray(x, dtype)  # noqa: E731

        def loss(p):
            out = bound.forward(p, jnp.asarray(ids)).logits.astype(dtype)
            lp = jnp.take_along_axis(out, jnp.asarray(targets)[..., None], -1)[..., 0] - \
                jax.nn.logsumexp(out, -1)
            sums = grpo.grpo_sums(lp, c(old), c(ref), c(advantages), c(masks),
                                  jnp.ones(N, dtype), options)
            return sums.loss / sums.weight

        grads = jax.grad(loss)(jax.tree.map(c, params))
        return dict(hf.to_hf(jax.tree.map(lambda g: np.asarray(g, np.float64), grads), config))

    def trl_grads(options, dtype):
        """TRL's _compute_loss (trl/trainer/grpo_trainer.py at f2cd577), token level."""
        m = model.to(dtype)
        m.zero_grad()
        out = m(torch.tensor(ids)).logits
        lp = torch.gather(out, -1, torch.tensor(targets)[..., None])[..., 0] - \
            torch.logsumexp(out, -1)
        o, r, a, mask = (torch.tensor(x, dtype=dtype)
                         for x in (old, ref, advantages[:, None], masks))
        coef_1 = torch.exp(lp - o)
        coef_2 = torch.clamp(coef_1, 1 - options.epsilon, 1 + options.epsilon_high)
        per_token = -torch.min(coef_1 * a, coef_2 * a)
        if options.beta:
            per_token = per_token + options.beta * (torch.exp(r - lp) - (r - lp) - 1) * coef_1
        if options.loss_type == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        else:  # dapo on one process: over the completion tokens
            loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        return {n: p.grad.double().numpy() for n, p in m.named_parameters()}

    for loss_type in ("dapo", "grpo"):
        for beta in (0.0, 0.04):
            options = grpo.get_default_config({"loss_type": loss_type, "beta": beta,
                                               "max_new_tokens": T, "epsilon_high": 0.28})
            truth = trl_grads(options, torch.float64)
            runs = {"easylm fp32": easylm_grads(options, jnp.float32),
                    "easylm 'float64'": easylm_grads(options, jnp.float64),
                    "TRL fp32": trl_grads(options, torch.float32)}
            names = [n for n in truth if n in runs["easylm fp32"]]
            errors = ", ".join(
                f"{run} {max(np.abs(g[n].reshape(truth[n].shape) - truth[n]).max() for n in names):.2e}"
                for run, g in runs.items())
            largest = max(np.abs(truth[n]).max() for n in names)
            print(f"{loss_type} beta={beta}: |grad - float64| {errors}; max |grad| {largest:.3f}")


if __name__ == "__main__":
    main()
