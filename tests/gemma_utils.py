"""Tiny Gemma 3 models for the tests: our config, and a random transformers
`Gemma3ForCausalLM` of it whose norm weights are random (transformers starts them at 0,
where a norm missing its (1 + w) would compute the same)."""

import numpy as np
import torch
from transformers import Gemma3ForCausalLM

from easylm.gemma.config import GemmaConfig
from easylm.gemma.family import FAMILY
from easylm.gemma.hf import from_hf
from numerics import fp32_rel

SEQ = 40  # longer than the debug window (8): sliding layers drop keys


def tiny_config(**overrides) -> GemmaConfig:
    """The debug preset (D=64, 4 heads of 16 over 2 kv heads; layers sliding, global,
    sliding, global; window 8) with every switch away from its neutral value: a
    query_pre_attn_scalar other than head_dim, linear rope scaling on the global layers,
    a local rope base other than the global one. Larger-than-default init, so attention is
    peaked and a wrong mask or rotary moves the logits far above the tolerance."""
    fields = dict(initializer_range=0.2, query_pre_attn_scalar=24.0, rope_scaling_factor=2.0)
    return FAMILY.from_preset("debug", **{**fields, **overrides})


def hf_model(config: GemmaConfig, seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config.to_hf_config()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.5)
    return model


def params_of(model: Gemma3ForCausalLM, config: GemmaConfig):
    """Our parameters holding `model`'s tensors (numpy, fp32)."""
    return from_hf({k: v.detach().numpy() for k, v in model.state_dict().items()}, config)


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


def forward_rel(config: GemmaConfig, seq_length: int) -> float:
    """Relative tolerance of the logits (tests/numerics.py): per layer eleven reductions in
    sequence (input norm, q/k/v projections, q/k norms, scores, their weighted sum, the
    output projection, post-attention norm, pre-MLP norm, gate/up, down, post-MLP norm: the
    norms' mean squares are sums too), then the final norm and the head; the widest over
    the width, the MLP width or the keys."""
    terms = max(config.hidden_size, config.intermediate_size, seq_length)
    return fp32_rel(terms, 12 * config.num_hidden_layers + 2)
