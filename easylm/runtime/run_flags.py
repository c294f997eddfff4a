"""The flags every command that runs a model shares, with one default and one help text each:
--seed, --mesh_dim, --dtype, --param_dtype, --load_checkpoint, --tokenizer.

The trainer, `python -m easylm.bench`, the server and `python -m easylm.llama.eval` each
take the subset they read:

    config.update(run_flags.get_default_config("mesh_dim", "dtype", mesh_dim="1,1,-1"))
    help_text.update(run_flags.help_entries("mesh_dim", "dtype", mesh_dim=NOTE))

Where a command's meaning differs (the server keeps its parameters in --dtype; its mesh
puts every device on mp), the shared text stays and the command adds only the
difference, a note after it, so that a flag reads the same everywhere.
"""

from ml_collections import ConfigDict

DEFAULTS = {
    "seed": 42,
    "mesh_dim": "1,-1,1",
    "dtype": "auto",
    "param_dtype": "fp32",
    "load_checkpoint": "",
    "tokenizer": "embedded",
}

HELP = {
    "seed": "random seed: parameter initialisation and the per-step RNG",
    "mesh_dim": "device mesh dp,fsdp,mp, or named sizes of dp,fsdp,sp,ep,mp (dp=1,fsdp=2,"
                "ep=4; unnamed axes 1); one entry may be -1 (all remaining devices)",
    "dtype": "compute dtype: bf16, fp16, fp32, or auto (bf16 on GPU/TPU, fp32 on CPU)",
    "param_dtype": "dtype the parameters (and their updates) are kept in: fp32, bf16, fp16, "
                   "or auto (as --dtype)",
    "load_checkpoint": "the model's weights: params::DIR (parameters), trainstate::DIR "
                       "(a train state), trainstate_params::DIR (the parameters of a train "
                       "state) or hf::DIR (a Hugging Face model directory, converted as it "
                       "loads; its config.json gives the model's shape)",
    "tokenizer": "'embedded', a tokenizer directory, a tokenizer.json or a SentencePiece .model",
}


def get_default_config(*names: str, **defaults) -> ConfigDict:
    """The flags `names`, in that order, with their shared defaults; `defaults` sets those a
    command sets otherwise (bench's seed, the server's mesh)."""
    _check(names, defaults)
    return ConfigDict({name: defaults.get(name, DEFAULTS[name]) for name in names})


def help_text(name: str, note: str = "") -> str:
    """The shared help of `--name`, and a command's `note` on how its meaning differs."""
    return f"{HELP[name]}; {note}" if note else HELP[name]


def help_entries(*names: str, **notes: str) -> dict:
    """{name: help} of the flags `names`; `notes` as in `help_text`."""
    _check(names, notes)
    return {name: help_text(name, notes.get(name, "")) for name in names}


def _check(names, given: dict):
    unknown = [name for name in (*names, *given) if name not in DEFAULTS]
    if unknown or set(given) - set(names):
        raise ValueError(f"run flags {sorted(DEFAULTS)}; got {list(names)} and "
                         f"{sorted(given)}")
