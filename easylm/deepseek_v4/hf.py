"""The mapping between easylm DeepSeek-V4 parameters and the tensors of a deepseek_v4
directory. Our paths are the names transformers' save_pretrained writes (the released
checkpoint's, which transformers renames on load): the path with '.' for '/', kernels
transposed as `<module>.weight`, other leaves as they are (attn_sink, ape, hc_attn_fn,
gate.bias, gate.tid2eid), except

    lm_head/kernel (D, V)                          <->  head.weight (V, D)
    ffn/experts/gate_proj, up_proj (E, D, F)       <->  ffn.experts.<e>.w1, w3 .weight (F, D)
    ffn/experts/down_proj (E, F, D)                <->  ffn.experts.<e>.w2.weight (D, F)

A released file's top-level names (embed.weight, hc_head_fn, norm.weight, layers.<i>...)
are read as these. Multi-token-prediction layers (mtp.*, or layers past the last) are
skipped, as transformers skips them.
"""

import re

import jax
import numpy as np
from flax import traverse_util

from easylm.deepseek_v4.config import DeepseekV4Config
from easylm.deepseek_v4.model import DeepseekV4ForCausalLM
from easylm.errors import UserError
from easylm.models.decoder import relayout
from easylm.models.hf_checkpoint import HFTensors, some, to_numpy
from easylm.models.sigmoid_moe_hf import DTYPES, param_shapes

EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Our module paths (the checkpoint's) -> transformers' modules, as its conversion_mapping.py
# renames the checkpoint's on load, in order (HFAdapter.module_renames): the names PEFT
# adapters and --lora.target_modules use. The indexer sits inside the compressor there.
MODULE_RENAMES = ((r"/attn/indexer/weights_proj(?=/)", "/attn/indexer/scorer/weights_proj"),
                  (r"/attn/indexer/compressor/", "/attn/indexer/"),
                  (r"/attn/indexer/", "/self_attn/compressor/indexer/"),
                  (r"/attn/", "/self_attn/"), (r"/ffn/", "/mlp/"),
                  (r"/wq_a(?=/)", "/q_a_proj"), (r"/wq_b(?=/)", "/q_b_proj"),
                  (r"/wkv(?=/)", "/kv_proj"), (r"/wgate(?=/)", "/gate_proj"),
                  (r"/wo_a(?=/)", "/o_a_proj"), (r"/wo_b(?=/)", "/o_b_proj"),
                  (r"/shared_experts/w1(?=/)", "/shared_experts/gate_proj"),
                  (r"/shared_experts/w3(?=/)", "/shared_experts/up_proj"),
                  (r"/shared_experts/w2(?=/)", "/shared_experts/down_proj"))
_RELEASED = ((r"^embed\.weight$", "model.embed_tokens.weight"), (r"^norm\.weight$",
             "model.norm.weight"), (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
             (r"^layers\.", "model.layers."))


def hf_names(path: str, shape) -> list[tuple[str, bool]]:
    """Our path -> [(tensor name, transpose)]: one per expert for the experts."""
    *module, leaf = path.split("/")
    if module[-1:] == ["experts"]:
        return [(".".join(module + [str(e), EXPERT_NAMES[leaf], "weight"]), True)
                for e in range(shape[0])]
    if module == ["lm_head"]:
        return [("head.weight", True)]
    if leaf in ("kernel", "embedding"):
        return [(".".join(module + ["weight"]), leaf == "kernel")]
    return [(".".join(module + [leaf]), False)]


def to_hf(params, config: DeepseekV4Config):
    flat = traverse_util.flatten_dict(relayout(params, False), sep="/")
    for path, shape in param_shapes(config, DeepseekV4ForCausalLM).items():
        tensor = np.asarray(jax.device_get(flat[path]))
        if path.endswith("tid2eid"):
            tensor = np.rint(tensor).astype(np.int64)
        keys = hf_names(path, shape)
        parts = list(tensor) if len(keys) > 1 else [tensor]
        for (name, transpose), part in zip(keys, parts):
            yield name, (part.T if transpose else part)


def _ours(name: str) -> str:
    for pattern, replacement in _RELEASED:
        name = re.sub(pattern, replacement, name)
    return name


def from_hf(tensors, config: DeepseekV4Config, dtype=None, source="checkpoint", place=None):
    shapes = param_shapes(config, DeepseekV4ForCausalLM)
    expected = {path: hf_names(path, shape) for path, shape in shapes.items()}
    wanted = {name for names in expected.values() for name, _ in names}
    by_name = {_ours(n): n for n in tensors}
    layer = re.compile(r"model\.layers\.(\d+)\.")
    present = [n for n in by_name if not n.startswith("mtp.") and not (
        (m := layer.match(n)) and int(m.group(1)) >= config.num_hidden_layers)]
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {some(missing)}")
    unexpected = [n for n in present if n not in wanted
                  and not (config.tie_word_embeddings and n == "head.weight")]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): "
                        f"{some(unexpected)}")
    flat = {}
    for path, names in expected.items():
        parts = [to_numpy(tensors[by_name[n]]) for n, _ in names]
        parts = [np.ascontiguousarray(p.T) if t else p for p, (_, t) in zip(parts, names)]
        tensor = np.stack(parts) if len(parts) > 1 else parts[0]
        if tensor.shape != shapes[path]:
            raise UserError(f"{source}: tensor {names[0][0]} has shape {tensor.shape} as we "
                            f"lay it out, but the config implies {shapes[path]}")
        if path.endswith(("tid2eid", "gate/kernel", "gate/bias")) or not path.endswith(
                ("kernel", "embedding", "experts/gate_proj", "experts/up_proj",
                 "experts/down_proj")):
            tensor = tensor.astype(np.float32)  # kept fp32, as transformers keeps them
        elif dtype is not None:
            tensor = tensor.astype(dtype)
        flat[path] = tensor if place is None else place(tensor)
    return traverse_util.unflatten_dict(flat, sep="/")


def load_hf_params(directory: str, dtype: str = "keep", place=None):
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = DeepseekV4Config.read_hf(directory)
    return config, from_hf(HFTensors(directory), config, dtype=DTYPES[dtype],
                           source=directory, place=place)
