"""`load_tokenizer(spec)`: the one way easylm turns a `--tokenizer` flag into a tokenizer.

`spec` is `embedded` (the small tokenizer shipped in `easylm/data/embedded/`), a
directory saved by `transformers` (`tokenizer.json`, `tokenizer_config.json`, ...), a
`tokenizer.json` file, or a SentencePiece `.model` file. Nothing is fetched from a hub.
"""

import os
import shutil
import tempfile

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from easylm.errors import UserError

_EXPECTED = ("expected 'embedded', a tokenizer directory, a tokenizer.json file "
             "or a SentencePiece .model file")
# A bare tokenizer.json does not say which token is BOS or EOS; these are the usual names.
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>")


def load_tokenizer(spec: str = "embedded") -> PreTrainedTokenizerFast:
    if spec == "embedded":
        from easylm.data import embedded

        return embedded.load_tokenizer()
    if not os.path.exists(spec):
        raise UserError(f"tokenizer {spec!r} does not exist; {_EXPECTED}")
    if os.path.isdir(spec):
        tokenizer = _from_directory(spec)
    elif spec.endswith(".model"):
        tokenizer = _from_sentencepiece(spec)
    elif spec.endswith(".json"):
        tokenizer = _from_json(spec)
    else:
        raise UserError(f"tokenizer {spec!r} is a file but not .json or .model; {_EXPECTED}")
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise UserError(f"tokenizer {spec!r} has no fast (Rust) version: got "
                        f"{type(tokenizer).__name__}")
    return tokenizer


_DIRECTORY_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _from_directory(directory):
    if not any(os.path.exists(os.path.join(directory, f)) for f in _DIRECTORY_FILES):
        raise UserError(f"tokenizer directory {directory!r} has none of "
                        f"{', '.join(_DIRECTORY_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from directory {directory!r}: "
                        f"{str(e).splitlines()[0]}") from None


def _from_sentencepiece(path):
    # transformers converts a SentencePiece model to a fast tokenizer when it finds
    # one named tokenizer.model in a directory.
    with tempfile.TemporaryDirectory() as directory:
        shutil.copy(path, os.path.join(directory, "tokenizer.model"))
        return _from_directory(directory)


def _from_json(path):
    if os.path.exists(os.path.join(os.path.dirname(path) or ".", "tokenizer_config.json")):
        return _from_directory(os.path.dirname(path) or ".")
    try:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as e:  # the Rust parser raises its own exception type
        raise UserError(f"cannot read tokenizer file {path!r}: {e}") from None
    vocab = tokenizer.get_vocab()
    for attribute, names in (("bos_token", _BOS_NAMES), ("eos_token", _EOS_NAMES),
                             ("pad_token", _PAD_NAMES)):
        found = next((name for name in names if name in vocab), None)
        if found is not None:
            setattr(tokenizer, attribute, found)
    return tokenizer
