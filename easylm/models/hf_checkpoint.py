"""Reading and writing Hugging Face checkpoint directories, one tensor at a time.

Model-agnostic: a model family's converter maps names; this module only moves
tensors.

Reading: `HFTensors(directory)` is a lazy mapping from tensor name to numpy
array over `*.safetensors` (sharded with an index or not) or
`pytorch_model*.bin` files. A tensor is read when it is looked up, so a
converter never holds the source model and its output at once.
`.bin` files are opened with `torch.load(weights_only=True, mmap=True)`:
anything that needs pickle globals beyond plain tensors is refused.
"""

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from easylm.errors import UserError


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise UserError(f"{directory}: no such directory")
    if not os.path.isfile(path):
        raise UserError(f"{directory}: no config.json; expected a Hugging Face model directory")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object of config fields, got a "
                        f"{type(config).__name__}")
    return config


def config_fields(hf: dict, path: str, defaults: dict, ints=(), must_be=None, model=""):
    """`get(name)`: config.json's value of `name`, else `defaults`' where the file has none
    or null. Checked first, each a UserError naming `path` and the key: every key of
    `must_be` the file sets has the value `model` implements; every name in `ints` is an
    integer."""
    get = lambda name: hf[name] if hf.get(name) is not None else defaults.get(name)
    for name, expected in (must_be or {}).items():
        if hf.get(name, expected) != expected:
            raise UserError(f"{path}: {name}={hf[name]!r} is not supported ({model} "
                            f"implements {name}={expected!r})")
    for name in ints:
        value = get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"{path}: {name} must be an integer, got {value!r}")
    return get


def text_model(hf: dict, path: str, text_type: str, tied: bool) -> dict:
    """The text model's fields of a multimodal config.json: its `text_config` (whose own
    model_type, when given, must be `text_type`), with the file's tie_word_embeddings
    (`tied` where it has none) and model_type `text_type`. The towers that read images or
    audio are not this model."""
    text = hf.get("text_config") or {}
    if not isinstance(text, dict):
        raise UserError(f"{path}: text_config must be an object, got {text!r}")
    if text.get("model_type", text_type) != text_type:
        raise UserError(f"{path}: text_config.model_type is {text['model_type']!r}, "
                        f"expected {text_type!r}")
    return {"tie_word_embeddings": hf.get("tie_word_embeddings", tied), **text,
            "model_type": text_type}


def first_int(value) -> int | None:
    """A token id field of config.json: an int, or a list of them whose first counts (a
    model with several EOS ids), or None."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def layer_types(hf: dict, path: str, allowed) -> list | None:
    """config.json's `layer_types` (None where absent), each one of `allowed`."""
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or set(types) - set(allowed)):
        raise UserError(f"{path}: layer_types must be a list of {' or '.join(allowed)}, got "
                        f"{types!r}")
    return types


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def _open_safetensors(path: str):
    """safe_open, a damaged file (a bad header, truncated, not safetensors at all) being
    a UserError that names it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="np")
    except (SafetensorError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a readable safetensors file ({reason})") from None


class HFTensors(Mapping):
    """name -> numpy array, read lazily from a HF checkpoint directory."""

    def __init__(self, directory: str):
        self.directory = directory
        self._bin_cache: dict[str, dict] = {}
        self._file_of = self._index()

    def _index(self) -> dict[str, str]:
        files = sorted(os.listdir(self.directory))
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if index_name in files:
                path = os.path.join(self.directory, index_name)
                index = _read_json(path)
                weight_map = index.get("weight_map") if isinstance(index, dict) else None
                if not isinstance(weight_map, dict):
                    raise UserError(f"{path}: expected a JSON object with a 'weight_map' object")
                missing = sorted({v for v in weight_map.values() if v not in files})
                if missing:
                    raise UserError(f"{self.directory}: {index_name} names missing file(s): {', '.join(missing)}")
                return dict(weight_map)
        shards = [f for f in files if f.endswith(".safetensors")] or [
            f for f in files if f.startswith("pytorch_model") and f.endswith(".bin")
        ]
        if not shards:
            raise UserError(f"{self.directory}: no *.safetensors or pytorch_model*.bin weight files")
        file_of = {}
        for shard in shards:
            for name in self._names_in(shard):
                file_of[name] = shard
        return file_of

    def _names_in(self, shard: str) -> list[str]:
        if shard.endswith(".safetensors"):
            with _open_safetensors(os.path.join(self.directory, shard)) as f:
                return list(f.keys())
        return list(self._load_bin(shard))

    def _load_bin(self, shard: str) -> dict:
        if shard not in self._bin_cache:
            import pickle

            import torch

            path = os.path.join(self.directory, shard)
            try:
                # mmap: tensors stay on disk until read; weights_only: no pickled code runs.
                self._bin_cache[shard] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except pickle.UnpicklingError as e:
                reason = str(e).strip().splitlines()[0]
                raise UserError(f"{path}: refused, it needs pickle globals beyond plain tensors ({reason})")
            except RuntimeError as e:
                raise UserError(f"{path}: not a readable PyTorch checkpoint ({str(e).splitlines()[0]})")
        return self._bin_cache[shard]

    def __getitem__(self, name: str) -> np.ndarray:
        shard = self._file_of[name]
        if shard.endswith(".safetensors"):
            from safetensors import SafetensorError

            path = os.path.join(self.directory, shard)
            with _open_safetensors(path) as f:
                try:
                    return f.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise UserError(f"{path}: cannot read tensor {name} ({e})") from None
        return to_numpy(self._load_bin(shard)[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name) -> bool:
        return name in self._file_of


class RenamedTensors(Mapping):
    """`tensors` under the names a model reads: `rename(name)` is a stored tensor's name
    here, or None to leave it out (a multimodal checkpoint's vision tower, say)."""

    def __init__(self, tensors: Mapping, rename):
        self.tensors, self.names = tensors, {}
        for name in tensors:
            key = rename(name)
            if key is not None:
                self.names[key] = name

    def __getitem__(self, name):
        return self.tensors[self.names[name]]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class PerExpertTensors(Mapping):
    """`tensors` whose fused experts (transformers 5's `...experts.gate_up_proj`, gate's
    outputs first, and `...experts.down_proj`, as save_pretrained writes them for a model
    without a per-expert conversion: Mistral 4, Llama 4) read under the per-expert names
    `...experts.<e>.{gate,up,down}_proj.weight` (out, in). The fused stacks are (E, out,
    in), or with `in_out` (E, in, out) (Llama 4's)."""

    def __init__(self, tensors: Mapping, in_out: bool = False):
        self.tensors, self.in_out, self.names = tensors, in_out, {}
        for name in tensors:
            fused = _FUSED.match(name)
            if not fused:
                self.names[name] = (name, None, None)
                continue
            prefix, kind = fused.groups()
            leaves = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for e in range(tensors[name].shape[0]):
                for part, leaf in enumerate(leaves):
                    self.names[f"{prefix}.{e}.{leaf}.weight"] = (name, e, part if
                                                                 len(leaves) > 1 else None)

    def __getitem__(self, key):
        name, e, part = self.names[key]
        tensor = self.tensors[name]
        if e is None:
            return tensor
        one = to_numpy(tensor[e])  # (out, in), or (in, out) with in_out
        one = one.T if self.in_out else one
        if part is not None:  # gate's rows, then up's
            half = one.shape[0] // 2
            one = one[half:] if part else one[:half]
        return np.ascontiguousarray(one)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def fuse_experts(named: Iterable, in_out: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(name, tensor) pairs with the per-expert ones (`...experts.<e>.<leaf>.weight`, a
    layer's together) fused as `PerExpertTensors` reads them: one gate_up_proj and one
    down_proj a layer, written once the layer's experts have passed."""
    prefix, leaves = None, {}

    def fused():
        gate_up = [np.concatenate([leaves["gate_proj"][e], leaves["up_proj"][e]])
                   for e in sorted(leaves["gate_proj"])]
        down = [leaves["down_proj"][e] for e in sorted(leaves["down_proj"])]
        for kind, stack in (("gate_up_proj", np.stack(gate_up)), ("down_proj", np.stack(down))):
            yield f"{prefix}.{kind}", stack.transpose(0, 2, 1) if in_out else stack  # (E, ...)

    for name, tensor in named:
        match = _PER_EXPERT.match(name)
        if prefix is not None and (not match or match.group(1) != prefix):
            yield from fused()
            prefix, leaves = None, {}
        if not match:
            yield name, tensor
            continue
        prefix, e, leaf = match.groups()
        leaves.setdefault(leaf, {})[int(e)] = tensor
    if prefix is not None:
        yield from fused()


def causal_lm_class(directory: str):
    """transformers' class for DIR's config.json: its `architectures`' first, which
    AutoModelForCausalLM does not map for every model (Mistral4ForCausalLM in 5.25)."""
    import transformers

    names = read_config(directory).get("architectures") or [""]
    return getattr(transformers, names[0], None) or transformers.AutoModelForCausalLM


def to_numpy(tensor) -> np.ndarray:
    """A numpy array from numpy/jax/torch, keeping bfloat16 as ml_dtypes' bfloat16."""
    if hasattr(tensor, "detach"):  # torch
        tensor = tensor.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import torch

            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    return np.asarray(tensor)


def write_safetensors(
    tensors: Iterable[tuple[str, np.ndarray]], directory: str, max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Write (name, array) pairs as `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`, holding at most one shard in memory."""
    from safetensors.numpy import save_file

    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"shard-{len(shards):05d}.tmp"
            save_file(current, os.path.join(directory, name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    for name, array in tensors:
        array = np.ascontiguousarray(array)
        if size and size + array.nbytes > max_shard_bytes:
            flush()
        current[name] = array
        size += array.nbytes
        total += array.nbytes
    flush()

    weight_map, files = {}, []
    for i, (tmp_name, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        if len(shards) == 1:
            final = "model.safetensors"
        os.replace(os.path.join(directory, tmp_name), os.path.join(directory, final))
        files.append(final)
        weight_map.update({n: final for n in names})
    if len(shards) > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


# ------------------------------------------- HF names of a family's parameters
# Families whose parameter paths are HF's module names with '/' (LLaMA, Gemma) map with
# one rule: model/layers/3/self_attn/q_proj/kernel <-> model.layers.3.self_attn.q_proj.weight,
# kernels transposed (Flax's Dense is (in, out), torch's Linear (out, in)).


def hf_key(path: str) -> tuple[str, bool]:
    """A '/'-joined parameter path -> (HF tensor name, whether to transpose)."""
    *module, leaf = path.split("/")
    return ".".join(module + ["bias" if leaf == "bias" else "weight"]), leaf == "kernel"


def some(names, limit: int = 8) -> str:
    """The first `limit` names, and how many more."""
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def params_from_hf(tensors: Mapping, shapes: dict, source: str, dtype=None, place=None,
                   ignored=lambda name: False, name_of=hf_key) -> dict:
    """{path: array} for every path of `shapes` ({'/'-path: shape}) from HF-named tensors
    (numpy, torch, or array-like): missing tensors, unexpected ones (unless `ignored`) and
    shape mismatches are UserErrors that name them. `place` (e.g. jax.device_put) moves
    each as it is converted, so its host copy can go before the next is read. `name_of`:
    a path's (HF name, transposed), `hf_key`'s rule unless a family names some otherwise."""
    expected = {name_of(path)[0]: path for path in shapes}
    missing = [key for key in expected if key not in tensors]
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensor(s): {some(missing)}")
    unexpected = [key for key in tensors if key not in expected and not ignored(key)]
    if unexpected:
        raise UserError(f"{source} has {len(unexpected)} unexpected tensor(s): {some(unexpected)}")
    flat = {}
    for key, path in expected.items():
        tensor = to_numpy(tensors[key])
        _, transpose = name_of(path)
        if transpose:  # `place` copies anyway: no contiguous host copy first
            tensor = tensor.T if place else np.ascontiguousarray(tensor.T)
        if tensor.shape != shapes[path]:
            want = shapes[path][::-1] if transpose else shapes[path]
            got = tensor.shape[::-1] if transpose else tensor.shape
            raise UserError(f"{source}: tensor {key} has shape {got}, but the config implies {want}")
        tensor = tensor if dtype is None else tensor.astype(dtype)
        flat[path] = tensor if place is None else place(tensor)
        del tensor
    return flat


# ------------------------------------------------- PEFT names of LoRA adapters
# Adapters (easylm/variants/lora.py) map to the names PEFT writes for the HF model,
# transposed like kernels:
#   model/layers/3/self_attn/q_proj/kernel_lora_a (in, r)
#       <->  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (r, in)

PEFT_PREFIX = "base_model.model."
PEFT_ADAPTERS = {"kernel_lora_a": "lora_A", "kernel_lora_b": "lora_B"}


def hf_module(path: str) -> str:
    """model/layers/0/self_attn/q_proj/kernel -> model.layers.0.self_attn.q_proj"""
    return hf_key(path)[0].rsplit(".", 1)[0]


def renamed(path: str, prefixes) -> str:
    """`path` with the longest of the (old, new) `prefixes` it starts with made new
    (HFAdapter.module_prefixes: our paths -> transformers' module paths, or swapped back)."""
    matches = [(old, new) for old, new in prefixes if path.startswith(old)]
    if not matches:
        return path
    old, new = max(matches, key=lambda pair: len(pair[0]))
    return new + path[len(old):]


def peft_key(path: str) -> str:
    """An (unscanned) adapter path -> PEFT's tensor name (the tensor is transposed)."""
    *module, leaf = path.split("/")
    return PEFT_PREFIX + ".".join(module + [PEFT_ADAPTERS[leaf], "weight"])


def peft_target_modules(kernels, all_kernels) -> list[str]:
    """PEFT's `target_modules` for adapters on `kernels` (paths) of a model with
    `all_kernels`: module names (q_proj, ...) when they select exactly these kernels, as
    PEFT matches them (any module whose name ends with one, a kernel's module's parents
    too: Gemma 4's vision q_proj holds the Linear q_proj.linear), else the full module
    names."""
    modules = {hf_module(path) for path in kernels}
    names = sorted({module.rsplit(".", 1)[-1] for module in modules})
    every = {".".join(parts[:i]) for parts in (hf_module(p).split(".") for p in all_kernels)
             for i in range(1, len(parts) + 1)}
    if {m for m in every if m.rsplit(".", 1)[-1] in names} == modules:
        return names
    return sorted(modules)


# Expert adapters (easylm/models/moe.py's EXPERT_ADAPTERS: per expert e, A_e (in, r) and
# B_e (r, out) on transformers' fused gate_up_proj or down_proj) are PEFT's
# `target_parameters` (its ParamWrapper, peft 0.21), one (r*E, in) A and (out, r*E) B:
#   model/layers/3/mlp/experts/down_proj_lora_a (E, F, r)
#       <->  base_model.model.model.layers.3.mlp.experts.lora_A.weight (r*E, F),
#            row e*r + j = A_e[:, j]
#   model/layers/3/mlp/experts/down_proj_lora_b (E, r, D)
#       <->  base_model.model.model.layers.3.mlp.experts.lora_B.weight (D, r*E),
#            column j*E + e = B_e[j]
# Two adapted parameters of one module nest: the one transformers declares first
# (gate_up_proj) is the inner wrapper's, `...mlp.experts.base_layer.lora_A.weight`.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")  # transformers' order in its Experts


def peft_expert_names(path: str, adapted: Iterable[str]) -> tuple[str, str]:
    """PEFT's (lora_A, lora_B) names of expert adapter target `path`
    (model/layers/3/mlp/experts/down_proj) whose module has `adapted` targets adapted."""
    module, name = path.rsplit("/", 1)
    order = [p for p in EXPERT_PARAMETERS if p in adapted]
    inner = ".base_layer" * (len(order) - 1 - order.index(name))
    prefix = PEFT_PREFIX + module.replace("/", ".") + inner
    return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"


def expert_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A (E, in, r), B (E, r, out) -> PEFT's lora_A (r*E, in), lora_B (out, r*E)."""
    E, inputs, r = a.shape
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(E * r, inputs)),
            np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[2], r * E)))


def expert_from_peft(lora_a: np.ndarray, lora_b: np.ndarray, experts: int):
    """`expert_to_peft` undone: (A (E, in, r), B (E, r, out))."""
    rows, inputs = lora_a.shape
    r = rows // experts
    return (np.ascontiguousarray(lora_a.reshape(experts, r, inputs).transpose(0, 2, 1)),
            np.ascontiguousarray(lora_b.reshape(lora_b.shape[0], r, experts).transpose(2, 1, 0)))


def transposed(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The LoRA of a stack's transpose: (A (E, in, r), B (E, r, out)) -> (B^T, A^T), for
    stacks that PEFT reads the other way round (`HFAdapter.experts_in_first`)."""
    return b.swapaxes(1, 2), a.swapaxes(1, 2)


def _expert_adapters(tensors: Mapping, shapes: dict, rank: int, source: str,
                     in_first: bool) -> dict:
    """{expert adapter path: array} of the PEFT tensors in `tensors` on expert modules
    (taken out of `tensors`). Which parameter a lone wrapper adapts is read from its
    shapes: gate_up_proj's A takes D inputs and its B gives 2F, down_proj's F and D (the
    other way round `in_first`, `transposed`)."""
    out = {}
    for stack in [path for path in shapes if path.endswith("/experts/gate_proj")]:
        E, D, F = shapes[stack]
        module = stack.removesuffix("/gate_proj")
        prefix = PEFT_PREFIX + module.replace("/", ".")
        found = {inner: (tensors.pop(f"{prefix}{inner}.lora_A.weight", None),
                         tensors.pop(f"{prefix}{inner}.lora_B.weight", None))
                 for inner in ("", ".base_layer")}
        for inner, (lora_a, lora_b) in found.items():
            if lora_a is None and lora_b is None:
                continue
            if lora_a is None or lora_b is None:
                raise UserError(f"{source}: {prefix}{inner} needs lora_A and lora_B")
            lora_a, lora_b = to_numpy(lora_a), to_numpy(lora_b)
            fits = {"gate_up_proj": (D, 2 * F), "down_proj": (F, D)}
            fits = {name: ((rank * E, o), (i, rank * E)) if in_first else
                    ((rank * E, i), (o, rank * E)) for name, (i, o) in fits.items()}
            name = next((n for n, want in fits.items()
                         if (lora_a.shape, lora_b.shape) == want), None)
            if name is None:
                raise UserError(f"{source}: {prefix}{inner} has lora_A {lora_a.shape} and "
                                f"lora_B {lora_b.shape}, which fit neither gate_up_proj nor "
                                f"down_proj of {E} experts at rank {rank}")
            a, b = expert_from_peft(lora_a, lora_b, E)
            a, b = transposed(a, b) if in_first else (a, b)
            out[f"{module}/{name}_lora_a"], out[f"{module}/{name}_lora_b"] = a, b
    return out


def adapters_from_peft(tensors: Mapping, shapes: dict, rank: int, source: str,
                       experts_in_first: bool = False) -> dict:
    """{adapter path: array} from PEFT-named tensors on a model of (unscanned) parameter
    `shapes`: each one A or B of rank `rank` on one of its kernels or expert stacks (B of
    gate_up_proj in transformers' column order: the family reorders it), both for every
    adapted one; anything else is a UserError naming it."""
    kernels = {hf_module(path): path for path in shapes if path.endswith("/kernel")}
    tensors = dict(tensors)
    adapters, bad = _expert_adapters(tensors, shapes, rank, source, experts_in_first), []
    for name, tensor in tensors.items():
        module, _, kind = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        path = kernels.get(module)
        if not name.startswith(PEFT_PREFIX) or path is None or kind not in ("A.weight", "B.weight"):
            bad.append(name)
            continue
        inputs, outputs = shapes[path]
        leaf = "kernel_lora_a" if kind == "A.weight" else "kernel_lora_b"
        want = (rank, inputs) if leaf == "kernel_lora_a" else (outputs, rank)
        tensor = to_numpy(tensor)
        if tensor.shape != want:
            raise UserError(f"{source}: tensor {name} has shape {tensor.shape}, but rank "
                            f"{rank} on this model's {module} implies {want}")
        adapters[path.removesuffix("kernel") + leaf] = np.ascontiguousarray(tensor.T)
    if bad:
        raise UserError(f"{source} has {len(bad)} tensor(s) that are no LoRA adapter of this "
                        f"model's kernels: {some(sorted(bad))}")
    kernel_paths = sorted({path.rsplit("_", 2)[0] for path in adapters})
    lonely = [p for p in kernel_paths if not {p + "_lora_a", p + "_lora_b"} <= set(adapters)]
    if not kernel_paths or lonely:
        raise UserError(f"{source}: every adapted module needs lora_A and lora_B; "
                        f"{'none found' if not kernel_paths else 'missing for ' + some(lonely)}")
    return adapters
