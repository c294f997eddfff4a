"""EasyLM's own flag names, so that its users' scripts run as written: each one an
`Alias` (easylm/flags.py) rewritten into today's flags with EasyLM's meaning.

EasyLM's examples/pretrain_llama_7b.sh and serve_llama_7b.sh pass, beside the flags
both programs share (--mesh_dim, --optimizer.*, --train_dataset.*, --logger.*, ...):

    --load_llama_config='7b'           a preset (EasyLM's size, or ours), or a JSON config
    --update_llama_config=''           EasyLM's "dict(name=value, ...)" string, or JSON
    --tokenizer.vocab_file=X.model     a SentencePiece model: --tokenizer=X.model
    --llama.scan_attention, --llama.remat_block
    --input_length=1024 --seq_length=2048 --lm_server.batch_size=4 --lm_server.port=35009
    --lm_server.pre_compile='all'      (serving)

`--load_dataset_state` is a trainer flag of its own (easylm/training/options.py).
"""

import ast
import json
import os

from easylm.errors import UserError
from easylm.flags import Alias

# EasyLM's LLaMAConfig names where ours differ (the rest are the same, HF's).
_RENAMED = {"max_sequence_length": "max_position_embeddings"}
# EasyLM's --llama.remat_block (a jax.checkpoint_policies name) -> our remat_policy.
_REMAT = {"": "none", "everything_saveable": "none", "nothing_saveable": "nothing_saveable",
          "dots_saveable": "checkpoint_dots", "checkpoint_dots": "checkpoint_dots",
          "checkpoint_dots_with_no_batch_dims": "checkpoint_dots_with_no_batch_dims"}
# EasyLM's lm_server.* that are ours without the prefix.
_SERVER = ("host", "port", "batch_size", "chat_prepend_text", "chat_user_prefix",
           "chat_user_suffix", "chat_lm_prefix", "chat_lm_suffix")


def train_aliases(family) -> list[Alias]:
    return _model_aliases(family) + [_tokenizer_alias()]


def serve_aliases(family) -> list[Alias]:
    def input_length(value, given):
        if "seq_length" not in given:
            raise UserError("--input_length needs --seq_length (EasyLM's pair: generation "
                            "gets seq_length - input_length tokens)")
        return {"max_tokens": _int("seq_length", given["seq_length"]) -
                _int("input_length", value)}

    def pre_compile(value, given):
        return {"pre_compile": bool(value.strip())}

    server = [Alias(f"lm_server.{name}", f"--{name}", lambda v, g, n=name: {n: v})
              for name in _SERVER]
    return _model_aliases(family) + [_tokenizer_alias()] + [
        Alias("input_length", "the longest prompt: --max_tokens=seq_length - input_length "
                              "(prompts may use any room left)", input_length),
        Alias("lm_server.pre_compile", "--pre_compile: 'all' or any task list compiles every "
                                       "bucket at start, '' none", pre_compile),
    ] + server


def _tokenizer_alias() -> Alias:
    return Alias("tokenizer.vocab_file", "--tokenizer: a SentencePiece .model, loaded as "
                                         "EasyLM's LLaMA tokenizer", lambda v, g: {"tokenizer": v})


def _model_aliases(family) -> list[Alias]:
    name = family.name
    fields = {f for f in family.config_class.__dataclass_fields__}

    def load_config(value, given):
        if not value:
            return {}
        if value.endswith(".json") or os.path.isfile(value):
            return _config_file(family, value)
        for preset in (value, f"{name}_{value}"):  # EasyLM's '7b' is our 'llama_7b'
            if preset in family.presets:
                return {f"{name}.base_model": preset}
        raise UserError(f"--load_{name}_config={value!r} is neither a preset "
                        f"({', '.join(family.presets)}; EasyLM's sizes 1b, 3b, 7b, 13b, 30b, "
                        f"65b too) nor a JSON config file")

    def update_config(value, given):
        return _fields(family, _dict_string(f"update_{name}_config", value))

    aliases = [Alias(f"load_{name}_config", f"--{name}.base_model (EasyLM's sizes: 7b is "
                                            f"{name}_7b), or a JSON config: its --{name}.* "
                                            f"fields", load_config),
               Alias(f"update_{name}_config", f"--{name}.* fields from EasyLM's "
                                              f"\"dict(name=value, ...)\" or JSON",
                     update_config)]
    if "attention" in fields:
        aliases.append(Alias(f"{name}.scan_attention", f"EasyLM's blockwise attention: "
                             f"memory-efficient attention is --{name}.attention=auto (cuDNN "
                             f"flash attention on GPU), the default",
                             lambda v, g: _scan_attention(name, v)))
    if "remat_policy" in fields:
        aliases.append(Alias(f"{name}.remat_block", f"--{name}.remat_policy (EasyLM's "
                             f"policy names: {', '.join(n for n in _REMAT if n)})",
                             lambda v, g: _remat(name, v)))
    return aliases


def _scan_attention(name: str, value: str) -> dict:
    return {f"{name}.attention": "auto"} if _bool(f"{name}.scan_attention", value) else {}


def _remat(name: str, value: str) -> dict:
    if value not in _REMAT:
        raise UserError(f"--{name}.remat_block={value!r} is not one of "
                        f"{', '.join(repr(n) for n in _REMAT)}")
    return {f"{name}.remat_policy": _REMAT[value]}


def _fields(family, values: dict) -> dict:
    """{--<family>.FIELD: value} of EasyLM config fields; one not ours is refused."""
    name, out = family.name, {}
    known = family.config_class.__dataclass_fields__
    for key, value in values.items():
        if key == "scan_attention":
            out.update(_scan_attention(name, str(value)))
        elif key == "remat_block":
            out.update(_remat(name, value))
        elif _RENAMED.get(key, key) in known:
            if value is not None:
                out[f"{name}.{_RENAMED.get(key, key)}"] = value
        else:
            raise UserError(f"EasyLM config field {key!r} has no --{name}.* counterpart")
    return out


def _config_file(family, path: str) -> dict:
    """A JSON config: HF's config.json (it has model_type), read as the family reads one,
    or EasyLM's LLaMAConfig fields on EasyLM's default shape (our <family>_7b)."""
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--load_{family.name}_config={path}: {e}") from None
    if not isinstance(values, dict):
        raise UserError(f"--load_{family.name}_config={path}: expected a JSON object")
    if "model_type" in values:
        config = family.config_class.from_hf_config(values)
        return _fields(family, {k: getattr(config, k) for k in values
                                if k in family.config_class.__dataclass_fields__})
    base = f"{family.name}_7b"
    preset = {f"{family.name}.base_model": base} if base in family.presets else {}
    return {**preset, **_fields(family, values)}


def _dict_string(flag: str, value: str) -> dict:
    """EasyLM's "dict(a=1, b='x')" (literals only), JSON, or '' (nothing)."""
    value = value.strip()
    if not value:
        return {}
    try:
        if value.startswith("dict("):
            call = ast.parse(value, mode="eval").body
            if call.args:
                raise ValueError("positional arguments")
            return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError("not an object")
        return parsed
    except (SyntaxError, ValueError) as e:
        raise UserError(f"--{flag}={value!r}: expected \"dict(name=value, ...)\" or a JSON "
                        f"object ({e})") from None


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UserError(f"--{flag}={value!r} is not an integer") from None


def _bool(flag: str, value: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0", ""):
        return False
    raise UserError(f"--{flag}={value!r} is not true or false")
