"""The LLaMA variants the tests hold against transformers: a tiny config of each, with
the switches that make it a variant, and a random transformers model of it."""

import torch
from transformers import AutoModelForCausalLM

from easylm.llama.config import LLaMAConfig

# On the debug preset (D=64, 4 heads of 16, 2 kv heads, 2 layers). Larger-than-default
# init (as the LLaMA parity tests use) so that attention is peaked and a wrong mask or
# a missing bias moves the logits far above the tolerance.
VARIANTS = {
    "llama_bias": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    # Qwen3's head_dim is not D / heads (Qwen3-0.6B: 128 x 16 heads on D=1024).
    "qwen3": dict(model_type="qwen3", head_dim=32),
    # A window shorter than the tests' sequences (48 positions; served: prompts plus 20).
    "mistral": dict(model_type="mistral", sliding_window=12),
}


def variant_config(name: str, **overrides) -> LLaMAConfig:
    fields = {**VARIANTS[name], **overrides}
    return LLaMAConfig.from_preset("debug", initializer_range=0.2, **fields)


def hf_variant(config: LLaMAConfig, seed: int = 0):
    """A random transformers model of `config`'s variant (its own class). transformers
    initialises biases to 0 and q/k norm weights to 1, which a model without them computes
    just as well; here they are random, so that a dropped bias or norm shows."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config.to_hf_config()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1.0, 0.5)
    return model
