"""The mapping between easylm parameters of a sigmoid_moe_decoder.py family (DeepSeek-V3,
GLM-4.5) and transformers' tensors: our paths are HF's names with '/' for '.'
(easylm/models/hf_checkpoint.py `hf_key`, kernels transposed), except

    mlp/router/kernel (D, E)                <->  mlp.gate.weight (E, D)
    mlp/e_score_correction_bias (E,)        <->  mlp.gate.e_score_correction_bias
    mlp/experts/gate_proj, up_proj (E, D, F) <-> mlp.experts.<e>.gate_proj.weight (F, D) ...
    mlp/experts/down_proj (E, F, D)         <->  mlp.experts.<e>.down_proj.weight (D, F)

(the per-expert names save_pretrained writes; transformers 5 fuses them on load).
Multi-token-prediction layers (model.layers.<L and above>), which transformers does not
load either, are skipped. `lm` is the family's causal LM: its attention's names are its own;
`names` a family's own map of the MoE's (MiniMax-M2's, Mixtral's layout).
"""

import re
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from easylm.errors import UserError
from easylm.models.decoder import relayout
from easylm.models.hf_checkpoint import HFTensors, hf_key, some, to_numpy
from easylm.runtime.dtypes import cast_names

DTYPES = cast_names(("bf16", "fp32"))


def param_shapes(config, lm: type) -> dict[str, tuple[int, ...]]:
    """Our parameters' shapes, layers one by one."""
    module = lm(config.replace(scan_layers=False))
    shapes = jax.eval_shape(module.init_params, jax.random.PRNGKey(0))
    return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


def hf_names(path: str, shape) -> list[tuple[str, bool]]:
    """Our path -> [(HF tensor name, transpose)]: one per expert for the experts."""
    *module, leaf = path.split("/")
    if module[-1:] == ["experts"]:
        return [(".".join(module + [str(e), leaf, "weight"]), True) for e in range(shape[0])]
    if module[-1:] == ["router"]:
        return [(".".join(module[:-1] + ["gate", "weight"]), True)]
    if leaf == "e_score_correction_bias":
        return [(".".join(module + ["gate", leaf]), False)]
    return [hf_key(path)]


def to_hf(params, config, lm: type, names=hf_names) -> Iterator[tuple[str, np.ndarray]]:
    flat = traverse_util.flatten_dict(relayout(params, False), sep="/")
    for path, shape in param_shapes(config, lm).items():
        tensor = np.asarray(jax.device_get(flat[path]))
        keys = names(path, shape)
        parts = list(tensor) if len(keys) > 1 else [tensor]
        for (name, transpose), part in zip(keys, parts):
            yield name, (part.T if transpose else part)


def from_hf(tensors: Mapping, config, dtype=None, source="checkpoint", place=None, *,
            lm: type, names=hf_names):
    shapes = param_shapes(config, lm)
    expected = {path: names(path, shape) for path, shape in shapes.items()}
    wanted = {name for names in expected.values() for name, _ in names}
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    present = [n for n in tensors if not ((m := mtp.match(n))
                                          and int(m.group(1)) >= config.num_hidden_layers)]
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {some(missing)}")
    unexpected = [n for n in present if n not in wanted
                  and not (config.tie_word_embeddings and n == "lm_head.weight")]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): "
                        f"{some(unexpected)}")
    flat = {}
    for path, names in expected.items():
        parts = [to_numpy(tensors[n]) for n, _ in names]
        parts = [np.ascontiguousarray(p.T) if t else p for p, (_, t) in zip(parts, names)]
        tensor = np.stack(parts) if len(parts) > 1 else parts[0]
        if tensor.shape != shapes[path]:
            raise UserError(f"{source}: tensor {names[0][0]} has shape {tensor.shape} as we "
                            f"lay it out, but the config implies {shapes[path]}")
        tensor = tensor if dtype is None else tensor.astype(dtype)
        if path.endswith(("e_score_correction_bias", "router/kernel")):
            tensor = tensor.astype(np.float32)  # kept fp32, as transformers keeps them
        flat[path] = tensor if place is None else place(tensor)
    return traverse_util.unflatten_dict(flat, sep="/")


def load_hf_params(directory: str, dtype: str = "keep", place=None, *, config_class: type,
                   lm: type, names=hf_names):
    """(config, parameters) of a checkpoint directory, its config a `config_class`."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    config = config_class.read_hf(directory)
    return config, from_hf(HFTensors(directory), config, dtype=DTYPES[dtype],
                           source=directory, place=place, lm=lm, names=names)
