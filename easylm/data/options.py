"""The --train_dataset.* (and --eval_dataset.*) flags: their defaults, their help, and
which block of them a dataset's `type` reads.

`type` selects one block of loader options (json_dataset.*, huggingface_dataset.*,
cache.* or mixture.*); `text_processor.*` and `preference.*` apply to every type. Each
block has its own copy of the loader options (EasyLM keeps them per type).
"""

from ml_collections import ConfigDict

from easylm.data.pairs import PreferenceProcessor
from easylm.data.text import TextProcessor
from easylm.errors import UserError

TYPES = {"json": "json_dataset", "huggingface": "huggingface_dataset", "cache": "cache",
         "mixture": "mixture"}   # --train_dataset.type -> its block of options

LOADER_HELP = {
    "seq_length": "tokens per row; documents are packed into rows and split across them",
    "batch_size": "rows per batch, over all processes together",
    "shuffle": "a fresh seeded permutation of the documents every epoch",
    "seed": "seed of the shuffle",
    "segment_ids": "also yield segment_ids and positions so attention stays in a document",
    "strict": "a malformed or empty line is an error instead of a counted warning",
    "tokenizer_processes": "1: tokenize in a thread beside packing; more: worker processes",
    "tokenizer_parallel_batch_size": "documents read and tokenized per window",
    "tokenizer_parallel_chunk_size": "documents per task of a tokenizer worker",
}

TOKENIZING = ("tokenizer_processes", "tokenizer_parallel_batch_size",
              "tokenizer_parallel_chunk_size")   # not for a token cache: nothing to tokenize

HELP = {
    "type": "json, huggingface, cache or mixture: which of json_dataset.*, "
            "huggingface_dataset.*, cache.*, mixture.* is used",
    "json_dataset.path": "JSON-lines files: 'embedded', a path, a glob, a comma-separated "
                         "list; local or fsspec URLs (gs://...)",
    "huggingface_dataset.path": "a save_to_disk directory, a builder such as json (with "
                                "data_files), or a dataset name in the local cache",
    "huggingface_dataset.name": "the dataset's configuration name",
    "huggingface_dataset.split": "the split to read",
    "huggingface_dataset.data_files": "comma-separated files for a builder such as json",
    "huggingface_dataset.streaming": "iterate without downloading/preparing it all first",
    "huggingface_dataset.shuffle_buffer_size": "shuffle buffer of a streaming dataset",
    "cache.path": "a token cache directory written by python -m easylm.data.cache (local "
                  "or an fsspec URL)",
    "mixture.sources": "the mixture's sources, weights and per-source options: a .json "
                       "or .yaml file, or the JSON itself (see docs/data.md)",
    **{f"text_processor.{k}": v for k, v in TextProcessor.HELP.items()},
    **{f"preference.{k}": v for k, v in PreferenceProcessor.HELP.items()},
    **{f"{block}.{k}": v for k, v in LOADER_HELP.items() for block in TYPES.values()
       if block != "cache" or k not in TOKENIZING},
    "cache.strict": "refuse a cache whose build skipped malformed or empty documents",
}


def _loader_config(config, tokenizes=True):
    """Options shared by the source types."""
    config.seq_length = 1024
    config.batch_size = 8
    config.shuffle = False
    config.seed = 0
    config.segment_ids = False
    config.strict = False
    if tokenizes:
        config.tokenizer_processes = 1
        config.tokenizer_parallel_batch_size = 1024
        config.tokenizer_parallel_chunk_size = 64
    return config


def default_config(updates=None):
    """The dataset flags' defaults, with `updates` (a dict or ConfigDict) on top."""
    config = ConfigDict()
    config.type = "json"
    config.text_processor = TextProcessor.get_default_config()
    config.preference = PreferenceProcessor.get_default_config()
    config.json_dataset = _loader_config(ConfigDict())
    config.json_dataset.path = "embedded"
    config.huggingface_dataset = _loader_config(ConfigDict())
    config.huggingface_dataset.path = ""
    config.huggingface_dataset.name = ""
    config.huggingface_dataset.split = "train"
    config.huggingface_dataset.data_files = ""
    config.huggingface_dataset.streaming = False
    config.huggingface_dataset.shuffle_buffer_size = 10000
    config.cache = _loader_config(ConfigDict(), tokenizes=False)
    config.cache.path = ""
    config.mixture = _loader_config(ConfigDict())
    config.mixture.sources = ""
    if updates is not None:
        config.update(ConfigDict(updates).copy_and_resolve_references())
    return config


def loader_block(config) -> str:
    """The block of options a dataset config's `type` selects (e.g. 'json_dataset')."""
    return TYPES.get(config.type, "json_dataset")


def loader_options(config, section="train_dataset"):
    """The block of options `config.type` reads, after refusing options set in a block it
    does not read (they would be ignored: --train_dataset.type=cache with
    --train_dataset.json_dataset.seq_length=128 would train on the cache's default rows).

    The flags given cannot be told from the defaults once parsed, so an option counts as
    set when it differs from its default; the trainer's derived defaults (rows no longer
    than the model takes, eval rows like the train rows, the demo's) change the selected
    block only. `section` names the flags in messages (train_dataset, eval_dataset)."""
    if config.type not in TYPES:
        raise UserError(f"unknown dataset type {config.type!r}; expected {', '.join(TYPES)}")
    block = TYPES[config.type]
    defaults = default_config()
    for other in TYPES.values():
        if other == block:
            continue
        changed = next((key for key in config[other] if key in defaults[other]
                        and config[other][key] != defaults[other][key]), None)
        if changed is not None:
            raise UserError(f"--{section}.{other}.{changed} is set but --{section}.type="
                            f"{config.type} reads --{section}.{block}.*")
    return config[block]
