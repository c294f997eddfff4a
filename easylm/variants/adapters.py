"""A family's LoRA adapters (easylm/variants/lora.py) beyond training: the LoraModel of its
model, reading adapters (a PEFT directory or a LoRA run's checkpoint), folding them into a
served base, and PEFT directories written and checked with peft. `Adapters(family)` for any
family whose parameter paths are Hugging Face's names (`ModelFamily.hf_param_shapes`):

    model/layers/3/self_attn/q_proj/kernel_lora_a (in, r)
        <->  base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (r, in)
    model/layers/3/self_attn/q_proj/kernel_lora_b (r, out)
        <->  base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight (out, r)

qwix adapts the matmul that reads a module's own kernel. A fused projection (LLaMA's
`--llama.fused_qkv/fused_mlp`) reads a concatenation of kernels instead, so a LoRA model
computes the family's `unfused` config: the same numbers, and every projection gets its
adapters. Adapters are read and written one layer at a time (PEFT's layout) and kept in
the layout the config says (scanned: stacked).
"""

import dataclasses
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from easylm import model_flags
from easylm.errors import UserError
from easylm.models.decoder import relayout
from easylm.models.family import (ModelFamily, hf_adapter, hf_param_shapes, layout, load_params,
                                  torch_reference)
from easylm.models.hf_checkpoint import (adapters_from_peft, expert_to_peft, peft_expert_names,
                                         peft_key, peft_target_modules, transposed)
from easylm.runtime import checkpoint
from easylm.variants import lora_variant as variant
from easylm.variants.lora import LoraConfig, LoraModel, read_peft, write_peft

# Unscanned or scanned (a period-1 stack, a pattern's slots, a later block's, the layers
# past the last repeat): where a layer's kernel may sit, for the regex a PEFT directory's
# modules make.
_ANY_LAYER = r"model/(layers(_from\d+)?/(\d+/|slot\d+/)?|tail\d+/)"


class Adapters:
    """LoRA adapters on `family`'s model."""

    def __init__(self, family: ModelFamily):
        self.family = family

    def lora_model(self, config, lora: LoraConfig, dtype=jnp.float32,
                   param_dtype=jnp.float32) -> LoraModel:
        """The LoraModel of `config` with adapters on --lora.target_modules' kernels and
        the config's `lora_targets` (an image-text model's trained vision side)."""
        module = self.family.module_class(config.unfused(), dtype=dtype,
                                          param_dtype=param_dtype)
        extra = config.lora_targets()
        if extra:
            lora = dataclasses.replace(lora, target_modules=f"(?:{lora.target_modules})|"
                                                            f"(?:{extra})")
        return LoraModel(module, lora, dtype, names=self.family.hf and self._hf)

    def _hf(self, path: str) -> str:
        """Our path as transformers' module path (HFAdapter.module_path)."""
        return hf_adapter(self.family).module_path(path)

    def _ours(self, paths) -> dict[str, str]:
        """{transformers' module path: ours} of the modules holding `paths` (ours)."""
        modules = {path.rsplit("/", 1)[0] for path in paths}
        return {self._hf(module + "/x")[:-2]: module for module in modules}

    def load_base(self, lm: LoraModel, config, spec: str, mesh):
        """The frozen base of `lm` from `spec`, in its shards of `mesh`, stored as it trains."""
        rules = self.family.partition_rules(config)
        return variant.load_base(lm, spec, mesh, lambda spec, abstract: load_params(
            self.family, spec, config, abstract, rules), rules)

    # ------------------------------------------------------------- PEFT names

    def to_peft(self, adapters):
        """Yield (PEFT name, numpy tensor) for `adapters` (either layout), one layer at a
        time; an expert stack's A and B as PEFT's target_parameters (hf_checkpoint.py)."""
        flat = _one_by_one(adapters)
        targets = {path.rsplit("_", 2)[0] for path in flat}
        for path, tensor in flat.items():
            if path.endswith("/kernel_lora_a") or path.endswith("/kernel_lora_b"):
                tensor = np.asarray(jax.device_get(tensor)).T
                yield peft_key(self._hf(path)), np.ascontiguousarray(tensor)
            elif path.endswith("_lora_a"):
                target = path.removesuffix("_lora_a")
                module, name = target.rsplit("/", 1)
                adapted = [t.rsplit("/", 1)[1] for t in targets if t.startswith(module + "/")]
                a, b = (np.asarray(jax.device_get(flat[target + leaf]), np.float32)
                        for leaf in ("_lora_a", "_lora_b"))
                b = self._gate_up_columns(b, to_hf=True) if name == "gate_up_proj" else b
                if hf_adapter(self.family).experts_in_first:
                    a, b = transposed(a, b)
                yield from zip(peft_expert_names(self._hf(target), adapted),
                               expert_to_peft(a, b))

    def _gate_up_columns(self, b, to_hf: bool):
        """B (E, r, 2F) of gate_up_proj, ours [gate | up] <-> the family's HF column order."""
        if not hf_adapter(self.family).gate_up_interleaved:
            return b
        half = b.shape[-1] // 2
        if to_hf:  # gate_f, up_f -> columns 2f, 2f + 1
            return b.reshape(*b.shape[:-1], 2, half).swapaxes(-1, -2).reshape(b.shape)
        return b.reshape(*b.shape[:-1], half, 2).swapaxes(-1, -2).reshape(b.shape)

    def from_peft(self, tensors, config, rank: int, source: str = "adapter"):
        """(adapters in `config`'s layout, target_modules regex selecting exactly the kernels
        they adapt) from PEFT-named tensors. With scanned layers every layer must carry the
        same adapters (a scan has one layer's parameters)."""
        ours = hf_param_shapes(self.family, config)
        shapes = {self._hf(path): shape for path, shape in ours.items()}
        modules = self._ours(ours)
        flat = {}
        for path, adapter in adapters_from_peft(tensors, shapes, rank, source,
                                                hf_adapter(self.family).experts_in_first).items():
            module, leaf = path.rsplit("/", 1)
            flat[modules.get(module, module) + "/" + leaf] = adapter
        for path in [path for path in flat if path.endswith("/gate_up_proj_lora_b")]:
            flat[path] = self._gate_up_columns(flat[path], to_hf=False)
        kernels = sorted({path.rsplit("_", 2)[0] for path in flat})
        pattern = self._kernels_pattern(kernels, config, source)
        return layout(self.family, traverse_util.unflatten_dict(flat, sep="/"), config), pattern

    def _kernels_pattern(self, kernels: list[str], config, source: str) -> str:
        """A regex (re.search) selecting exactly these unscanned kernel paths, written per
        layer position when every layer that has a kernel has its adapters (Gemma 4's
        KV-shared layers have no k_proj), so that it fits scanned paths."""
        per_layer, other = _by_layer(kernels)
        having, _ = _by_layer(hf_param_shapes(self.family, config))
        uneven = [rest for rest, layers in per_layer.items() if layers != having.get(rest)]
        if uneven and config.scan_layers:
            raise UserError(f"{source} adapts {uneven[0]} in some layers only, which scanned "
                            f"layers (--{self.family.name}.scan_layers=True) cannot hold; load "
                            f"it unscanned")
        exact = [re.escape(path) for path in other]
        if uneven:
            exact += [re.escape(path) for path in kernels if path.startswith("model/layers/")]
        elif per_layer:
            inner = "|".join(re.escape(rest) for rest in sorted(per_layer))
            exact.append(rf"{_ANY_LAYER}({inner})")
        return "^(" + "|".join(exact) + ")$"

    # ---------------------------------------------------------- PEFT directories

    def save_peft(self, directory: str, lm: LoraModel, adapters, config,
                  base_model: str = "") -> None:
        """`adapters` as a PEFT directory that `peft.PeftModel.from_pretrained` loads onto
        transformers' model of the same base."""
        targets = {path.rsplit("_", 2)[0] for path in _one_by_one(adapters)}
        kernels = sorted(path for path in targets if path.endswith("/kernel"))
        every = [path for path in hf_param_shapes(self.family, config) if path.endswith("/kernel")]
        # Full names (model.layers.0.mlp.experts.gate_up_proj): PEFT matches a name's ending,
        # and a shorter one could take in layers these adapters leave alone.
        experts = sorted(self._hf(path).replace("/", ".") for path in targets - set(kernels))
        modules = peft_target_modules([self._hf(k) for k in kernels],
                                      [self._hf(k) for k in every]) if kernels else []
        write_peft(directory, self.to_peft(adapters), lm.config, modules, base_model,
                   target_parameters=experts)

    def load_peft(self, directory: str, config) -> tuple[LoraConfig, dict]:
        """(LoraConfig, adapters) from a PEFT directory (ours or peft's own), shaped for
        `config` (scanned or not); the config selects the modules the file adapts."""
        lora, tensors = read_peft(directory)
        adapters, pattern = self.from_peft(tensors, config, lora.rank, source=directory)
        return dataclasses.replace(lora, target_modules=pattern), adapters

    def read_adapters(self, spec: str, config) -> tuple[LoraConfig, dict, dict]:
        """(LoraConfig, adapters on one device, the run's checkpoint metadata ({} for PEFT))
        from a PEFT directory or a LoRA run's checkpoint (DIR or params::DIR): read in the
        layout they were stored in, returned in `config`'s (serve, eval and convert all read
        adapters here)."""
        lora, adapters, metadata = variant.read_adapters(
            spec, lambda directory: self.load_peft(directory, config))
        return lora, layout(self.family, adapters, config), metadata

    # ----------------------------------------------------------------- merging

    def merge_into(self, spec: str, base_spec: str, config, params, mesh):
        """`params` (float, sharded, read from `base_spec`) with the adapters at `spec`
        folded into their kernels: the server's --lora_checkpoint. Refused unless the base is
        the one a LoRA run's adapters were trained on."""
        lora, adapters, metadata = self.read_adapters(spec, config)
        family = self.family

        def as_the_run(metadata):
            run_config = model_flags.config_from_metadata(
                family, metadata[model_flags.metadata_key(family)], spec)
            run_lm = self.lora_model(run_config, lora,
                                     dtype=jnp.dtype(metadata["frozen"].get("dtype", "float32")))
            return variant.stored_as_the_run(
                run_lm, params, lambda p: layout(family, p, run_config),
                lambda: self.load_base(run_lm, run_config, base_spec, mesh))

        return variant.merge_into(spec, base_spec, params, self.lora_model(config, lora),
                                  adapters, metadata, as_the_run)

    def load_lora(self, spec: str, metadata: dict, base_spec: str = ""):
        """(config, LoraModel, frozen base as the run stored it, adapters, the base's spec) of
        a LoRA run's checkpoint, on one device; the base checked against the run's
        fingerprint."""
        from easylm.runtime.sharding import make_mesh

        _, directory = checkpoint.parse_load_spec(spec)
        config = model_flags.config_from_metadata(
            self.family, metadata[model_flags.metadata_key(self.family)], directory)
        recorded = metadata.get("frozen") or {}
        base_spec = base_spec or recorded.get("source", "")
        if base_spec in ("", "init"):
            raise UserError(f"{directory}: the run's base was drawn at random, not loaded; give "
                            f"it with --lora_base")
        lora, adapters, _ = self.read_adapters(directory, config)  # in the run's own layout
        lm = self.lora_model(config, lora, dtype=jnp.dtype(recorded.get("dtype", "float32")))
        mesh = make_mesh("1,1,1", devices=jax.devices()[:1])
        with jax.set_mesh(mesh):
            frozen = self.load_base(lm, config, base_spec, mesh)
        if recorded.get("fingerprint"):
            variant.check_base(directory, recorded, base_spec, lm, frozen,
                               fix="give the run's base with --lora_base")
        return config, lm, frozen, adapters, base_spec

    def merged_params(self, spec: str, metadata: dict, base_spec: str = ""):
        """(config, the run's base as its source holds it with W + s·A·B folded into each
        adapted kernel) on the host. The source is read again, in its own dtypes: what the
        run stored (bf16, quantized) is not the model PEFT adapts, and rounding it moved the
        merged logits 0.15 from PEFT's on an fp32 base. Each adapted kernel is merged in fp32
        and stored back in its dtype; every other tensor is the source's, bit for bit."""
        config, lm, _, adapters, source = self.load_lora(spec, metadata, base_spec)
        return config, lm.merge(self.source_params(source, config), jax.device_get(adapters))

    def source_params(self, spec: str, config):
        """The parameters at `spec` (hf::, params:: or trainstate_params::) on the host, laid
        out as `config` says, each in the dtype it is stored in."""
        kind, directory = checkpoint.parse_load_spec(spec, ("hf", "params", "trainstate_params"))
        if kind == "hf":
            params = hf_adapter(self.family).read_params(directory, config)
        else:
            params = jax.device_get(checkpoint.load_stored_params(spec))
        return layout(self.family, params, config)

    # -------------------------------------------------------------- exporting

    def export_adapter(self, FLAGS, output_dir: str, metadata: dict) -> None:
        """convert_easylm_to_hf --lora_mode=adapter: the PEFT directory, verified with peft."""
        config, lm, frozen, adapters, source = self.load_lora(FLAGS.load_checkpoint, metadata,
                                                              FLAGS.lora_base)
        kind, _, path = source.partition("::")
        partial = output_dir + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            # adapter_config.json's base_model_name_or_path: an hf:: base's directory, which
            # peft loads by itself; none for an easylm checkpoint, which it cannot.
            self.save_peft(partial, lm, jax.device_get(adapters), config,
                           base_model=os.path.abspath(path) if kind == "hf" else "")
            if FLAGS.verify:
                diff = self.verify_peft(lm, frozen, adapters, config, partial)
                print(f"verify: max |logit difference| vs peft = {diff:.3g}")
                if not diff <= FLAGS.verify_tolerance:
                    raise UserError(f"verification failed: max |logit difference| {diff:.3g} "
                                    f"exceeds --verify_tolerance={FLAGS.verify_tolerance}")
            os.replace(partial, output_dir)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        print(f"wrote {output_dir}")

    def verify_peft(self, lm: LoraModel, frozen, adapters, config, directory: str) -> float:
        """Max |logits(HF base + PEFT adapter) - logits(ours)| on fixed sequences, in fp32."""
        import torch
        from peft import PeftModel

        base = jax.device_get(lm.dequantized_base(frozen))
        model = PeftModel.from_pretrained(torch_reference(self.family, config, base),
                                          directory).eval()
        ids = np.random.RandomState(0).randint(0, config.vocab_size, (2, 32))
        with torch.no_grad():
            theirs = model(torch.tensor(ids)).logits.numpy()
        # Ours on the same float base in fp32 (whatever the run computed in): what is
        # compared is the adapters.
        fp32 = self.lora_model(config, dataclasses.replace(lm.config, base_dtype="fp32"))
        ours = fp32.apply(fp32.store_base(base), adapters, jnp.asarray(ids))
        return float(np.abs(np.asarray(ours) - theirs).max())


def _by_layer(paths) -> tuple[dict[str, set[int]], list[str]]:
    """({path within a layer: the layers holding it}, the paths outside the layers) of
    unscanned paths."""
    per_layer, other = {}, []
    for path in paths:
        if path.startswith("model/layers/"):
            _, _, index, rest = path.split("/", 3)
            per_layer.setdefault(rest, set()).add(int(index))
        else:
            other.append(path)
    return per_layer, other


def _one_by_one(adapters) -> dict:
    """{unscanned adapter path (model/layers/<i>/...): array}."""
    return traverse_util.flatten_dict(relayout(adapters, False), sep="/")

