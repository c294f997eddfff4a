"""The reading side of a token cache (`cache.py` builds them): the format's names, what
must match between a cache and a run, `CacheSource` (a cache as a source of documents)
and `verify`. The layout of a cache directory and why it is .npy are in `cache.py`.

A cache of image chats (built with --family, docs/vision.md) also holds each shard's
images as the model's image processor encoded them (`IMAGE_KINDS`); its documents are
(tokens, masks, [(patches (n, E) float32, grid)]), the whole chats, which the reader of
image chats fits to a run's rows (image_chats.CachedImageChats).
"""

import hashlib
import json
import os

import fsspec
import numpy as np
from ml_collections import ConfigDict

from easylm.data.text import TextProcessor
from easylm.errors import UserError

VERSION = 1
KINDS = ("tokens", "masks", "offsets")
# patches (all images' patches, float32 (n, E)); images (int64 (images, 5): patches, grid
# length k, grid[:k], zeros); image_offsets (int64 (documents + 1,)): document i's images
# are images[image_offsets[i]:image_offsets[i+1]].
IMAGE_KINDS = ("patches", "images", "image_offsets")
# A cache of image preference pairs (each document a pair's chosen side, then its
# rejected side) also holds sides: int64 (documents, 2): where the rejected side's tokens
# and images start in the document.
PAIR_KINDS = ("sides",)
GRID = 3   # the longest grid an image reader gives (Qwen3.5's (t, rows, cols))
_MAX_OPEN_SHARDS = 64   # memory maps / file handles kept open while reading


def tokenizer_identity(tokenizer):
    """What must match between a cache and a run: the whole tokenizer.json and the
    special tokens the text processor uses."""
    return dict(sha256=hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
                .hexdigest(), vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)


def processor_settings(text_processor, tokenizer):
    """The --train_dataset.text_processor.* options, and in chat mode the template they
    resolve to (a template file may change under the same flag)."""
    settings = dict(ConfigDict(text_processor).to_dict())
    if settings.get("chat"):
        template = TextProcessor(text_processor, tokenizer).chat_template
        settings["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()
    return settings


def image_identity(images):
    """What must match between a cache of image chats and a run: the image-text model's
    reader, its image processor's settings and its image tokens."""
    settings = images.image_processor.to_json_string()
    return dict(reader=f"{type(images).__module__}.{type(images).__qualname__}",
                image_processor_sha256=hashlib.sha256(settings.encode()).hexdigest(),
                image_token_id=images.image_token_id,
                patch_values=images.config.patch_values())


def pair_settings(preference):
    """What must match between a cache of pairs and a run: the pairs' fields."""
    return {k: v for k, v in ConfigDict(preference).to_dict().items() if k != "enabled"}


def kinds_of(index):
    """The files of each shard of a cache (its index or build settings)."""
    return (KINDS + (IMAGE_KINDS if index.get("images") else ())
            + (PAIR_KINDS if index.get("pairs") else ()))


def shard_name(shard, kind):
    return (f"shard-{shard:05d}.{kind}.npy" if kind in KINDS + IMAGE_KINDS + PAIR_KINDS
            else f"shard-{shard:05d}.json")



class CacheSource:
    """A finished token cache as a source (sources.py): document i is shard i //
    shard_size's document i % shard_size; records are ((tokens, masks), None)."""

    def __init__(self, path):
        self.path = path.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.path)
        self.local = "file" in np.atleast_1d(self.fs.protocol)
        self.index = self._read_index()
        self._shards = {}
        listing = {os.path.basename(entry["name"]): entry["size"]
                   for entry in self.fs.ls(self.root, detail=True)}
        counts = []
        self.kinds = kinds_of(self.index)
        for i, entry in enumerate(self.index["shards"]):
            for kind in self.kinds:
                name, expected = shard_name(i, kind), entry["files"][kind]["bytes"]
                if name not in listing:
                    raise UserError(f"token cache {path}: shard file {name} is missing")
                if listing[name] != expected:
                    raise UserError(f"token cache {path}: {name} has {listing[name]} bytes, "
                                    f"the index says {expected} (truncated or replaced; "
                                    f"rebuild the shard, check with --verify)")
            counts.append(entry["documents"])
        if sum(counts) != self.index["num_documents"]:
            raise UserError(f"token cache {path}: its shards hold {sum(counts)} documents, "
                            f"the index says {self.index['num_documents']}")
        self._first = np.cumsum([0] + counts)

    def _read_index(self):
        path = f"{self.root}/index.json"
        if not self.fs.exists(path):
            if self.fs.exists(f"{self.root}/build.json"):
                raise UserError(f"token cache {self.path} is not finished (no index.json); "
                                f"run python -m easylm.data.cache again with the same "
                                f"flags to finish it")
            raise UserError(f"{self.path} is not a token cache (no index.json); build one "
                            f"with python -m easylm.data.cache")
        try:
            with self.fs.open(path, "rb") as f:
                index = json.load(f)
            shards = index["shards"]
            assert all(len(s["files"]) == len(kinds_of(index)) for s in shards)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise UserError(f"token cache {self.path}: index.json is not a valid index; "
                            f"rebuild it with python -m easylm.data.cache") from None
        if index.get("version") != VERSION:
            raise UserError(f"token cache {self.path} has version {index.get('version')}, "
                            f"this easylm reads version {VERSION}; rebuild it")
        return index

    def check(self, tokenizer, text_processor, strict, images=None, preference=None):
        """A run must tokenize as the cache was built (and, for a cache of image chats,
        read images with the same model's reader: `images`; for a cache of pairs, read
        pairs with the same fields: `preference`, None for a run that reads no pairs); a
        mismatch names both."""
        self.check_images(images)
        self._check_text(tokenizer, text_processor, strict)
        built = self.index.get("pairs")
        if bool(built) != (preference is not None):
            raise UserError(f"token cache {self.path} holds " + (
                "preference pairs: read it with --train_dataset.preference.enabled=True"
                if built else "no preference pairs (built without "
                "--train_dataset.preference.enabled=True)"))
        if built and built != pair_settings(preference):
            key = next(k for k in built if built[k] != pair_settings(preference).get(k))
            raise UserError(f"token cache {self.path} was built with preference.{key}="
                            f"{built[key]!r} but this run has preference.{key}="
                            f"{pair_settings(preference).get(key)!r}")

    def check_images(self, images):
        """A cache of image chats is read by the image-text model's reader it was built
        with (`images`), and only a cache of image chats by one; else one line."""
        built = self.index.get("images")
        if built and images is None:
            raise UserError(f"token cache {self.path} holds image chats, which only the "
                            f"image-text model it was built for reads ({built['reader']}): "
                            f"give its --family and --load_checkpoint=hf::DIR, with "
                            f"text_processor.chat=True")
        if images is not None and not built:
            raise UserError(f"token cache {self.path} holds no images (built without "
                            f"--family); rebuild it with the image-text model's --family "
                            f"and --load_checkpoint to train on its image chats")
        if built and built != image_identity(images):
            now = image_identity(images)
            key = next(k for k in now if built.get(k) != now[k])
            raise UserError(f"token cache {self.path} was built for another image-text model "
                            f"or image processor ({key} {built.get(key)!r}, this run's has "
                            f"{now[key]!r}); pass the model it was built with, or rebuild "
                            f"the cache")

    def _check_text(self, tokenizer, text_processor, strict):
        now = tokenizer_identity(tokenizer)
        built = self.index["tokenizer"]
        if built != now:
            key = next(k for k in now if built.get(k) != now[k])
            raise UserError(f"token cache {self.path} was built with another tokenizer "
                            f"({key} {built.get(key)!r}, this run's --tokenizer has "
                            f"{now[key]!r}); pass the tokenizer it was built with, or "
                            f"rebuild the cache")
        built, now = self.index["text_processor"], processor_settings(text_processor,
                                                                      tokenizer)
        if built != now:
            key = next(k for k in sorted(set(built) | set(now)) if built.get(k) != now.get(k))
            raise UserError(f"token cache {self.path} was built with text_processor.{key}="
                            f"{built.get(key)!r} but this run has text_processor.{key}="
                            f"{now.get(key)!r}; pass the same --train_dataset.text_processor.* "
                            f"flags, or rebuild the cache")
        if strict and self.index["skipped"]:
            raise UserError(f"token cache {self.path} skipped {self.index['skipped']} bad "
                            f"documents when it was built, and this run has strict=True")

    def __len__(self):
        return int(self._first[-1])

    def read(self, ids):
        ids = np.asarray(ids, np.int64)
        shards = np.searchsorted(self._first, ids, side="right") - 1
        records = [None] * len(ids)
        for s in np.unique(shards):
            where = np.flatnonzero(shards == s)
            tokens, masks, offsets, *images = self._open(int(s))
            local = ids[where] - self._first[s]
            sides = images.pop() if self.index.get("pairs") else None
            for i, d, begin, end in zip(where.tolist(), local.tolist(),
                                        offsets[local].tolist(), offsets[local + 1].tolist()):
                document = (tokens[begin:end], masks[begin:end])
                if images:
                    document += (_images(*images, d),)
                if sides is not None:
                    document += (tuple(int(x) for x in sides[d]),)
                records[i] = (document, None)
        return records

    def _open(self, i):
        if i in self._shards:
            return self._shards[i]
        if len(self._shards) >= _MAX_OPEN_SHARDS:
            self._close_shard(next(iter(self._shards)))
        entry = self.index["shards"][i]
        expected = dict(tokens=((entry["tokens"],), self.index["dtype"]),
                        masks=((entry["tokens"],), "uint8"),
                        offsets=((entry["documents"] + 1,), "int64"))
        if self.index.get("images"):
            expected.update(
                patches=((entry.get("patches"), self.index["images"]["patch_values"]),
                         "float32"),
                images=((entry.get("images"), 2 + GRID), "int64"),
                image_offsets=((entry["documents"] + 1,), "int64"))
        expected["sides"] = ((entry["documents"], 2), "int64")
        arrays = []
        for kind in self.kinds:
            name = shard_name(i, kind)
            path = f"{self.root}/{name}"
            try:
                array = (np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)
                         if self.local else _RangeArray(self.fs, path))
            except ValueError as e:
                raise UserError(f"token cache {self.path}: {name} is not a valid .npy file "
                                f"({e})") from None
            if (array.shape, str(array.dtype)) != expected[kind]:
                raise UserError(f"token cache {self.path}: {name} holds {array.shape} "
                                f"{array.dtype}, the index says {expected[kind][0]} "
                                f"{expected[kind][1]}; rebuild the cache")
            arrays.append(array)
        offsets = np.asarray(arrays[2][0:entry["documents"] + 1])
        if offsets[0] != 0 or offsets[-1] != entry["tokens"] or (np.diff(offsets) < 0).any():
            raise UserError(f"token cache {self.path}: {shard_name(i, 'offsets')} does not "
                            f"describe {entry['tokens']} tokens; rebuild the cache")
        self._shards[i] = arrays[0], arrays[1], offsets
        if self.index.get("images"):
            self._shards[i] += self._image_table(i, *arrays[3:6], entry["documents"])
        if self.index.get("pairs"):
            sides = np.asarray(arrays[-1][0:entry["documents"]])
            if isinstance(arrays[-1], _RangeArray):
                arrays[-1].close()
            if (sides < 0).any() or (sides[:, 0] > np.diff(offsets)).any():
                raise UserError(f"token cache {self.path}: {shard_name(i, 'sides')} does not "
                                f"split its documents; rebuild the cache")
            self._shards[i] += (sides,)
        return self._shards[i]

    def _image_table(self, i, patches, table, image_offsets, documents):
        """(patches, the images' table, where each image's patches start, each document's
        first image) of shard i, the small ones in memory, after checking they agree."""
        table = np.asarray(table[0:len(table)])
        image_offsets = np.asarray(image_offsets[0:documents + 1])
        starts = np.concatenate([[0], np.cumsum(table[:, 0])])
        if image_offsets[0] != 0 or image_offsets[-1] != len(table) or \
                (np.diff(image_offsets) < 0).any() or starts[-1] != len(patches) or \
                (table < 0).any() or (table[:, 1] > GRID).any():
            raise UserError(f"token cache {self.path}: shard {i}'s image files do not "
                            f"describe its {len(table)} images; rebuild the cache")
        return patches, table, starts, image_offsets

    def _close_shard(self, i):
        shard = self._shards.pop(i)
        for array in shard[:2] + shard[3:4]:
            if isinstance(array, _RangeArray):
                array.close()

    def close(self):
        for i in list(self._shards):
            self._close_shard(i)


def _images(patches, table, starts, image_offsets, d):
    """[(patches (n, E) float32, grid)] of a shard's document d."""
    rows = range(int(image_offsets[d]), int(image_offsets[d + 1]))
    return [(np.asarray(patches[int(starts[k]):int(starts[k + 1])], np.float32),
             tuple(int(g) for g in table[k, 2:2 + table[k, 1]])) for k in rows]


class _RangeArray:
    """A .npy file on any fsspec filesystem, read by byte range: array[a:b] (rows)."""

    def __init__(self, fs, path):
        self.file = fs.open(path, "rb")
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}
        version = np.lib.format.read_magic(self.file)
        if version not in read_header:
            raise ValueError(f".npy version {version}")
        self.shape, _, self.dtype = read_header[version](self.file)
        self.start = self.file.tell()

    def __getitem__(self, key):
        begin, end, _ = key.indices(self.shape[0])
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.file.seek(self.start + begin * row)
        data = self.file.read(max(0, end - begin) * row)
        return np.frombuffer(data, self.dtype).reshape(-1, *self.shape[1:])

    def __len__(self):
        return self.shape[0]

    def close(self):
        self.file.close()


# ------------------------------------------------------------------------------- verify


def verify(path):
    """Reads every file of the cache and checks counts and checksums; returns the index."""
    source = CacheSource(path)
    try:
        for i, entry in enumerate(source.index["shards"]):
            for kind in source.kinds:
                name = shard_name(i, kind)
                with source.fs.open(f"{source.root}/{name}", "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                if digest != entry["files"][kind]["sha256"]:
                    raise UserError(f"token cache {path}: {name} has sha256 {digest[:12]}..., "
                                    f"the index says {entry['files'][kind]['sha256'][:12]}...; "
                                    f"rebuild the cache")
            source._open(i)                 # shapes and offsets against the index
            source._close_shard(i)
    finally:
        source.close()
    return source.index

