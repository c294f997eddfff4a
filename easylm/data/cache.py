"""A token cache: tokenize a dataset once, then train from its token ids. This module
builds caches (and is the command); `cache_reader.py` reads and verifies them.

    python -m easylm.data.cache --tokenizer=DIR --output=web-cache \\
        --train_dataset.json_dataset.path='web/*.jsonl' [--processes=8]
    python -m easylm.data.cache --output=web-cache --verify
    ... --train_dataset.type=cache --train_dataset.cache.path=web-cache

A cache directory (local or an fsspec URL) holds:
  build.json               what is being built: source, tokenizer, text processor, shards
  shard-00000.tokens.npy   the shard's documents' token ids end to end (uint16 when the
                           vocabulary fits, else uint32)
  shard-00000.masks.npy    their loss masks, uint8 0/1
  shard-00000.offsets.npy  int64 (documents + 1,): document i is tokens[offsets[i]:offsets[i+1]]
  shard-00000.patches.npy, .images.npy, .image_offsets.npy   only in a cache of image
                           chats (--family): the images' encoded patches (cache_reader.py)
  shard-00000.json         written after the shard's files: counts, byte sizes, sha256s
  index.json               written last: build.json and every shard's entry

Shard i holds documents [i * shard_size, (i + 1) * shard_size) of the source in file
order. A document the pipeline would skip (malformed, empty) stays, with no tokens, so the
cache has the source's documents one for one: with the same loader options it gives the
batches of on-the-fly processing bit for bit (shuffle, packing, shares, exact state),
and a run can even switch between the two on resume. Worker processes build whole
shards; a build killed and run again keeps the shards whose .json is written and
rebuilds the rest, and since the files are deterministic the checksums match an
uninterrupted build. The reader checks every shard's size against the index when it
opens the cache and the shapes when it opens a shard; --verify checks the checksums.

Why .npy and not array_record or grain: numpy is here already, a memory-mapped .npy
gives a document as a zero-copy slice, and fsspec reads byte ranges of one anywhere;
array_record stores opaque byte records (a parse per document) behind its own file layer,
and grain brings its own sampler and checkpoint state, which would replace the exact
state of this pipeline rather than fit into it. No pickle: JSON and .npy (allow_pickle
off).
"""

import hashlib
import io
import json
import logging
import os
import sys
import time
from concurrent import futures

import fsspec
import numpy as np
from ml_collections import ConfigDict

from easylm import flags
from easylm.data import options
from easylm.data.cache_reader import (
    GRID,
    VERSION,
    image_identity,
    pair_settings,
    processor_settings,
    shard_name,
    tokenizer_identity,
    verify,
)
from easylm.data.image_chats import ImageChatProcessor
from easylm.data.images import image_chat_reader
from easylm.data.pairs import PreferenceProcessor
from easylm.data.reader import tokenize_records
from easylm.data.sources import open_source
from easylm.data.tokenizer import load_tokenizer
from easylm.errors import UserError, exit_on_user_error
from easylm.runtime import run_flags

logger = logging.getLogger(__name__)
_CHUNK = 256            # documents per tokenizer call while building


# ------------------------------------------------------------------------------- build


def _open_for_build(dataset_config, tokenizer, shard_size, images=None):
    """(config, loader options, source, processor, the cache's settings) of a build,
    after checking the source can be cached. `images`: an image-text model's reader of
    image chats, whose chats the cache then holds with their images' patches."""
    config = options.default_config(dataset_config)
    if config.type not in ("json", "huggingface"):
        raise UserError(f"python -m easylm.data.cache builds from --train_dataset.type=json "
                        f"or huggingface, not {config.type!r}")
    pairs = bool(config.preference.enabled)
    if pairs and images is None:
        raise UserError("a token cache holds preference pairs only of image chats (built "
                        "with the image-text model's --family); train on text pairs from "
                        "their json or huggingface source")
    if shard_size <= 0:
        raise UserError(f"--shard_size must be positive, got {shard_size}")
    loader = options.loader_options(config)
    source, processor = open_source(config.type, loader, config.text_processor, tokenizer,
                                    loader.strict)
    if images is not None:
        if not config.text_processor.chat:
            raise UserError("--family caches image chats: set "
                            "--train_dataset.text_processor.chat=True")
        processor = PreferenceProcessor(config.preference, config.text_processor, tokenizer,
                                        None, images) if pairs else \
            ImageChatProcessor(config.text_processor, tokenizer, images, None)
    if getattr(source, "streaming", False):
        raise UserError("a token cache needs a source with a known length; set "
                        "huggingface_dataset.streaming=False")
    vocab = max(len(tokenizer), 1 + max(tokenizer.all_special_ids or [0]))
    settings = dict(
        version=VERSION, source=dict(type=config.type, **loader.to_dict()),
        tokenizer=tokenizer_identity(tokenizer),
        text_processor=processor_settings(config.text_processor, tokenizer),
        num_documents=len(source), shard_size=shard_size,
        dtype="uint16" if vocab <= 1 << 16 else "uint32")
    if images is not None:
        settings["images"] = image_identity(images)
    if pairs:   # whole pairs: each the chosen side's tokens, then the rejected side's
        settings["pairs"] = pair_settings(config.preference)
    for key in ("seq_length", "batch_size", "shuffle", "seed", "segment_ids",
                "tokenizer_processes", "tokenizer_parallel_batch_size",
                "tokenizer_parallel_chunk_size"):
        settings["source"].pop(key)   # reading options: the cache serves any of them
    return config, loader, source, processor, settings


def build(dataset_config, tokenizer, output, shard_size=65536, processes=1, progress=True,
          images=None):
    """Builds (or finishes) the cache of the json or map-style huggingface dataset that
    `dataset_config` (a DatasetFactory config) names (image chats with `images`, an
    image-text model's reader). Returns the index."""
    config, loader, source, processor, settings = _open_for_build(dataset_config, tokenizer,
                                                                  shard_size, images)
    fs, root = fsspec.core.url_to_fs(output)
    fs.makedirs(root, exist_ok=True)
    _start_or_resume(fs, root, output, settings)
    num_shards = -(-settings["num_documents"] // shard_size)
    done = {i: entry for i in range(num_shards)
            if (entry := _finished_shard(fs, root, i)) is not None}
    todo = [i for i in range(num_shards) if i not in done]
    start, started = time.time(), None
    work = _ShardWriter(processor, settings, loader.strict, fs, root)

    def records(i):
        return source.read(np.arange(i * shard_size,
                                     min((i + 1) * shard_size, settings["num_documents"])))

    from tqdm import tqdm

    bar = tqdm(total=num_shards, initial=len(done), desc=f"building {output}", unit="shard",
               disable=None if progress else True)
    try:
        if processes <= 1:
            for i in todo:
                done[i] = work(i, records(i))
                bar.update()
        else:
            started = _build_in_processes(work, todo, records, processes, done, bar)
    finally:
        bar.close()
        source.close()
    shards = [done[i] for i in range(num_shards)]
    index = dict(settings, shards=shards, documents=settings["num_documents"],
                 tokens=sum(s["tokens"] for s in shards),
                 skipped=sum(s["skipped"] for s in shards),
                 **({"pictures": sum(s["images"] for s in shards),
                     "image_tokens": sum(s["image_tokens"] for s in shards)}
                    if images is not None else {}),
                 build_seconds=time.time() - start, built_shards=len(todo),
                 start_seconds=started - start if started else 0.0)
    _write_json(fs, f"{root}/index.json", {k: v for k, v in index.items()
                                           if k not in _RUN_ONLY})
    return index


def _image_arrays(images, patch_values):
    """The image files' arrays of a shard (cache_reader.IMAGE_KINDS) from each document's
    encodings `images` ([(patches, grid)] each), and the shard's counts of them."""
    flat = [image for document in images for image in document]
    table = np.zeros((len(flat), 2 + GRID), np.int64)
    for k, (patches, grid) in enumerate(flat):
        table[k, :2 + len(grid)] = (len(patches), len(grid), *grid)
    patches = (np.concatenate([p for p, _ in flat]).astype(np.float32) if flat
               else np.zeros((0, patch_values), np.float32))
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in images])]).astype(np.int64)
    return (dict(patches=patches, images=table, image_offsets=offsets),
            dict(images=len(flat), patches=len(patches)))


def _start_or_resume(fs, root, output, settings):
    path = f"{root}/build.json"
    if fs.exists(path):
        with fs.open(path, "rb") as f:
            previous = json.load(f)
        if previous != settings:
            key, was, now = _first_difference(previous, settings)
            raise UserError(f"{output} holds a cache build with other settings ({key} was "
                            f"{was!r}, now {now!r}); use another --output, or delete it")
    else:
        _write_json(fs, path, settings)


def _first_difference(a, b, prefix=""):
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            found = _first_difference(x, y, f"{prefix}{key}.")
            if found:
                return found
        elif x != y:
            return f"{prefix}{key}", x, y
    return None


def _finished_shard(fs, root, i):
    """The shard's entry if its .json was written and its files have the sizes it
    says; None means build it (again)."""
    try:
        with fs.open(f"{root}/{shard_name(i, 'json')}", "rb") as f:
            entry = json.load(f)
        if all(fs.size(f"{root}/{shard_name(i, kind)}") == entry["files"][kind]["bytes"]
               for kind in entry["files"]):
            return entry
    except (FileNotFoundError, ValueError, KeyError):   # not written, or cut off
        pass
    return None


def _build_in_processes(work, todo, records, processes, done, bar):
    """The parent reads each shard's records, spawned workers tokenize and write it;
    at most `processes` + 1 shards are in flight, so memory stays bounded. Returns when
    the last worker that got a shard had started (spawned, tokenizer loaded)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")   # JAX and fork do not mix
    with futures.ProcessPoolExecutor(processes, context, initializer=_init_worker,
                                     initargs=(work,)) as executor:
        pending, queue, started = {}, list(todo), 0.0
        try:
            while queue or pending:
                while queue and len(pending) <= processes:
                    i = queue.pop(0)
                    pending[executor.submit(_work_in_worker, i, records(i))] = i
                finished, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
                for future in finished:
                    done[pending.pop(future)], ready = future.result()
                    started = max(started, ready)
                    bar.update()
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
    return started


_WORKER = _READY = None
_RUN_ONLY = ("build_seconds", "built_shards", "start_seconds")   # not in index.json


def _init_worker(work):
    global _WORKER, _READY
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # the workers are the parallelism
    _WORKER, _READY = work, time.time()   # wall clock: comparable across processes


def _work_in_worker(i, records):
    return _WORKER(i, records), _READY


class _ShardWriter:
    """Tokenizes one shard's records and writes its files, then its .json."""

    def __init__(self, processor, settings, strict, fs, root):
        self.processor, self.dtype, self.strict = processor, settings["dtype"], strict
        self.images, self.pairs = settings.get("images"), settings.get("pairs")
        self.fs, self.root = fs, root

    def __call__(self, shard, records):
        tokens, masks, lengths, images, skipped, first_skip = [], [], [], [], 0, None
        sides = []   # a cache of pairs: where each document's rejected side starts
        for i in range(0, len(records), _CHUNK):
            for document in tokenize_records(records[i:i + _CHUNK], self.processor):
                if isinstance(document, tuple):
                    tokens.append(document[0])
                    masks.append(document[1])
                    lengths.append(len(document[0]))
                    images.append(document[2] if self.images else [])
                    sides.append(document[3] if self.pairs else None)
                    continue
                if isinstance(document, str):
                    if self.strict:
                        raise UserError(document)
                    skipped += 1
                    first_skip = first_skip or document
                lengths.append(0)   # kept, empty, so that slots stay the source's
                images.append([])
                sides.append(np.zeros(2, np.int64))
        tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
        masks = np.concatenate(masks) if masks else np.zeros(0, np.float32)
        limit = np.iinfo(self.dtype).max
        if len(tokens) and (tokens.min() < 0 or tokens.max() > limit):
            raise UserError(f"token id {int(tokens.max())} does not fit the cache's "
                            f"{self.dtype} (the tokenizer's vocabulary decided the dtype); "
                            f"check <|id|> markers in text_processor.fields")
        if len(masks) and not np.isin(masks, (0.0, 1.0)).all():
            raise UserError("a loss mask other than 0 or 1 cannot be cached as uint8")
        arrays = dict(tokens=tokens.astype(self.dtype), masks=masks.astype(np.uint8),
                      offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        counts = {}
        if self.images:
            more, counts = _image_arrays(images, self.images["patch_values"])
            arrays.update(more)
            counts["image_tokens"] = int((arrays["tokens"] == self.images["image_token_id"])
                                         .sum())
        if self.pairs:
            arrays["sides"] = np.asarray(sides, np.int64).reshape(len(lengths), 2)
        files = {}
        for kind, array in arrays.items():
            buffer = io.BytesIO()
            np.save(buffer, array, allow_pickle=False)
            data = buffer.getvalue()
            self.fs.pipe_file(f"{self.root}/{shard_name(shard, kind)}", data)
            files[kind] = dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        entry = dict(shard=shard, documents=len(lengths), tokens=len(tokens),
                     skipped=skipped, **counts, files=files)
        _write_json(self.fs, f"{self.root}/{shard_name(shard, 'json')}", entry)
        if skipped:
            logger.warning("shard %d: skipped %d documents (kept empty), the first: %s",
                           shard, skipped, first_skip)
        return entry


def _write_json(fs, path, obj):
    """Whole or not at all: a kill while writing leaves no half file under `path`."""
    fs.pipe_file(path + ".tmp", json.dumps(obj, indent=1).encode())
    fs.mv(path + ".tmp", path)



# ------------------------------------------------------------------------------- command

USAGE = ("usage: python -m easylm.data.cache --output=DIR [--train_dataset.*=...] "
         "[--tokenizer=...] [--processes=N] [--shard_size=N] [--verify]")


def default_config():
    config = ConfigDict()
    config.train_dataset = options.default_config()
    config.tokenizer = run_flags.DEFAULTS["tokenizer"]
    config.output = ""
    config.processes = 0
    config.shard_size = 65536
    config.verify = False
    config.family = ""
    config.load_checkpoint = ""
    return config


def help_text():
    return {"tokenizer": run_flags.help_text("tokenizer"),
            "output": "the cache directory (local or an fsspec URL); a build killed "
                      "half-way continues when run again",
            "processes": "worker processes that tokenize shards (0: one per CPU)",
            "shard_size": "documents per shard",
            "verify": "only check the cache in --output: every file's size, shape and "
                      "sha256 against its index",
            "family": "an image-text model's family (e.g. qwen3_5_vl): the cache then holds "
                      "image chats, their images encoded by its image processor",
            "load_checkpoint": "with --family: hf::DIR, the model whose config.json and "
                               "image processor encode the images",
            **{f"train_dataset.{k}": v for k, v in options.HELP.items()}}


@exit_on_user_error
def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    c = flags.parse(default_config(), help_text(), argv or sys.argv, USAGE)
    if not c.output:
        raise UserError("--output is required: the directory of the cache")
    if c.verify:
        index = verify(c.output)
        print(f"{c.output}: {len(index['shards'])} shards, {index['documents']:,} documents, "
              f"{index['tokens']:,} tokens{_image_counts(index)}; sizes, shapes and "
              f"checksums match the index")
        return
    processes = c.processes or os.cpu_count()
    images = image_chat_reader(c.family, c.load_checkpoint, c.tokenizer)
    index = build(c.train_dataset, load_tokenizer(c.tokenizer), c.output, c.shard_size,
                  processes, images=images)
    started = (f", {index['start_seconds']:.1f} s of them starting workers"
               if index["start_seconds"] else "")
    workers = f"{processes} process" + ("es" if processes > 1 else "")
    print(f"{c.output}: {len(index['shards'])} shards ({index['built_shards']} built now, "
          f"{workers}), {index['documents']:,} documents ({index['skipped']} skipped), "
          f"{index['tokens']:,} tokens{_image_counts(index)}, {index['dtype']}; "
          f"{index['build_seconds']:.1f} s{started}")


def _image_counts(index):
    """', N images (M image tokens)' of a cache of image chats, else ''."""
    if not index.get("images"):
        return ""
    return f", {index['pictures']:,} images ({index['image_tokens']:,} image tokens)"


if __name__ == "__main__":
    main()
