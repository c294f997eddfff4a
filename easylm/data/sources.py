"""Where documents come from, and in which order.

A source holds documents; an order says which document fills each *slot*. Slots are
numbered 0, 1, 2, ... across epochs (slot s is in epoch s // N), so the loader can ask
for any slots it likes and get the same answer on every host and after every restart.

- `JsonSource`: JSON-lines files (a path, a glob, or a comma-separated list of them;
  local or any fsspec URL such as gs://). Opening indexes every line's byte offset, so a
  process reads only the lines it is given.
- `HuggingfaceSource`: a `datasets` dataset (a `save_to_disk` directory, a builder with
  data_files, or a name already in the local cache), map-style or streaming.
- `IndexedOrder`: a fresh seeded permutation per epoch over a source with a length.
- `StreamingOrder`: reads a streaming dataset front to back, shuffled by its seeded
  buffer; going back (after a restart) re-reads the epoch up to that slot.
- `open_source`, `make_order`: a block of --train_dataset.* options -> a source (a token
  cache's is `cache_reader.CacheSource`) and its order.

A record is (raw, where): raw is a JSON line (bytes) or a dict; `where` names the file
and line (or the row) for error messages.
"""

import glob as globlib
import os

import fsspec
import numpy as np

from easylm.data.cache_reader import CacheSource
from easylm.data.text import TextProcessor
from easylm.errors import UserError

_CHUNK = 1 << 24


def expand_paths(spec):
    """'a.jsonl,dir/*.jsonl' -> the matching files, each glob sorted."""
    if spec == "embedded":
        from easylm.data import embedded

        return [embedded.CORPUS_PATH]
    paths = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        fs, path = fsspec.core.url_to_fs(entry)
        if globlib.has_magic(entry):
            matches = sorted(fs.glob(path))
            if not matches:
                raise UserError(f"no files match {entry!r}")
            paths += [fs.unstrip_protocol(m) if "://" in entry else m for m in matches]
        elif not fs.exists(path):
            raise UserError(f"data file {entry!r} does not exist")
        elif fs.isdir(path):
            raise UserError(f"{entry!r} is a directory; give files or a glob like "
                            f"{entry.rstrip('/')}/*.jsonl")
        else:
            paths.append(entry)
    if not paths:
        raise UserError("json_dataset.path is empty; give a file, a glob or 'embedded'")
    return paths


class JsonSource:
    """JSON-lines files; document i is the i-th line over all files in order."""

    def __init__(self, spec):
        self.paths = expand_paths(spec)
        self._files = [fsspec.core.url_to_fs(p) for p in self.paths]
        self._starts, self._sizes = zip(*(self._index(p, fs, path)
                                          for p, (fs, path) in zip(self.paths, self._files)))
        self._first = np.cumsum([0] + [len(s) for s in self._starts])
        self._handles = {}

    @staticmethod
    def _index(name, fs, path):
        """Byte offsets where each line starts, found by one pass over the file."""
        newlines, size = [], 0
        with fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                newlines.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + size)
                size += len(chunk)
        if size == 0:
            raise UserError(f"data file {name!r} is empty")
        starts = np.concatenate([[0]] + [n + 1 for n in newlines]).astype(np.int64)
        return starts[starts < size], size

    def __len__(self):
        return int(self._first[-1])

    def read(self, ids):
        """Records for document ids, read in file order for locality."""
        records = [None] * len(ids)
        for k in np.argsort(ids, kind="stable"):
            records[k] = self._read_one(int(ids[k]))
        return records

    def _read_one(self, i):
        f = int(np.searchsorted(self._first, i, side="right")) - 1
        line = i - int(self._first[f])
        starts = self._starts[f]
        begin = int(starts[line])
        end = int(starts[line + 1]) if line + 1 < len(starts) else self._sizes[f]
        if f not in self._handles:
            fs, path = self._files[f]
            self._handles[f] = fs.open(path, "rb")
        handle = self._handles[f]
        handle.seek(begin)
        return handle.read(end - begin).rstrip(b"\r\n"), f"{self.paths[f]}:{line + 1}"

    def close(self):
        for handle in self._handles.values():
            handle.close()
        self._handles = {}


class HuggingfaceSource:
    """A `datasets` dataset; rows are dicts."""

    def __init__(self, config):
        import datasets

        self.name = config.path + (f"[{config.split}]" if config.split else "")
        self.streaming = config.streaming
        saved = any(os.path.exists(os.path.join(config.path, f))
                    for f in ("dataset_dict.json", "state.json"))
        try:
            if saved:  # written by save_to_disk
                dataset = datasets.load_from_disk(config.path)
                if isinstance(dataset, datasets.DatasetDict):
                    dataset = dataset[config.split or "train"]
                if self.streaming:
                    dataset = dataset.to_iterable_dataset()
            else:
                dataset = datasets.load_dataset(
                    config.path, config.name or None, split=config.split or None,
                    data_files=[f.strip() for f in config.data_files.split(",")]
                    if config.data_files else None,
                    streaming=self.streaming)
        except (FileNotFoundError, ValueError, KeyError, ConnectionError) as e:
            raise UserError(f"cannot load huggingface_dataset.path={config.path!r} "
                            f"(name={config.name!r}, split={config.split!r}): "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            raise UserError(f"huggingface_dataset.path={config.path!r} has splits "
                            f"{sorted(dataset)}; choose one with huggingface_dataset.split")
        self.dataset = dataset
        if not self.streaming and len(dataset) == 0:
            raise UserError(f"huggingface dataset {self.name} has no rows")

    def __len__(self):
        return len(self.dataset)

    def read(self, ids):
        columns = self.dataset[[int(i) for i in ids]]
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        return [(row, f"{self.name} row {i}") for row, i in zip(rows, ids)]

    def close(self):
        pass


class IndexedOrder:
    """Slot s holds document perm_e[s % N] of epoch e = s // N (identity if not shuffled)."""

    def __init__(self, source, shuffle, seed):
        self.source, self.shuffle, self.seed = source, shuffle, seed
        self.num_documents = len(source)
        self._permutations = {}

    def epoch(self, slot):
        return slot // self.num_documents

    def read(self, slots, single_pass=False):
        """Records for slots (ascending); with single_pass, only those of epoch 0."""
        slots = np.asarray(slots, np.int64)
        if single_pass:
            slots = slots[slots < self.num_documents]
        epochs, positions = np.divmod(slots, self.num_documents)
        ids = positions.copy()
        if self.shuffle:
            for e in np.unique(epochs):
                ids[epochs == e] = self._permutation(int(e))[positions[epochs == e]]
        return self.source.read(ids)

    def _permutation(self, epoch):
        if epoch not in self._permutations:
            self._permutations = {k: v for k, v in self._permutations.items() if k >= epoch - 1}
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_documents)
        return self._permutations[epoch]


class StreamingOrder:
    """Slots in reading order of a streaming dataset, epoch after epoch. The epoch size is
    learnt at the end of the first pass (and kept in the data state)."""

    def __init__(self, source, shuffle, seed, buffer_size, num_documents=None):
        self.source, self.shuffle, self.seed = source, shuffle, seed
        self.buffer_size, self.num_documents = buffer_size, num_documents
        self._rows, self._next = None, 0

    def epoch(self, slot):
        return slot // self.num_documents if self.num_documents else 0

    def read(self, slots, single_pass=False):
        records = []
        for slot in slots:
            if self._rows is None or slot < self._next:
                self._restart(slot)
            while self._next < slot:
                self._step()
            record = self._step()
            if single_pass and self._epoch > 0:
                break
            records.append(record)
        return records

    def _restart(self, slot):
        epoch, skip = (divmod(slot, self.num_documents) if self.num_documents else (0, slot))
        self._epoch, self._next = epoch, slot - skip
        self._rows = self._epoch_rows(epoch)

    def _epoch_rows(self, epoch):
        dataset = self.source.dataset
        if self.shuffle:
            dataset = dataset.shuffle(seed=self.seed, buffer_size=self.buffer_size)
            dataset.set_epoch(epoch)
        return enumerate(dataset)

    def _step(self):
        for _ in range(2):
            row = next(self._rows, None)
            if row is not None:
                i, example = row
                self._next += 1
                return example, f"{self.source.name} row {i} (epoch {self._epoch})"
            if self.num_documents is None:
                if self._next == 0:
                    raise UserError(f"huggingface dataset {self.source.name} has no rows")
                self.num_documents = self._next
            self._epoch += 1
            self._rows = self._epoch_rows(self._epoch)
        raise UserError(f"huggingface dataset {self.source.name} has no rows")


def open_source(kind, options, text_processor, tokenizer, strict, images=None,
                preference=None):
    """(source, what tokenizes its records) for a json, huggingface or cache block of
    options; a token cache needs no tokenizing once its settings match the run's (and a
    cache of image chats was built for `images`, the run's image-text model's reader; a
    cache of pairs with the run's `preference` options)."""
    if kind == "json":
        return JsonSource(options.path), TextProcessor(text_processor, tokenizer)
    if kind == "huggingface":
        if not options.path:
            raise UserError("--train_dataset.type=huggingface needs huggingface_dataset.path")
        return HuggingfaceSource(options), TextProcessor(text_processor, tokenizer)
    if kind == "cache":
        if not options.path:
            raise UserError("--train_dataset.type=cache needs cache.path (a directory written "
                            "by python -m easylm.data.cache)")
        source = CacheSource(options.path)
        source.check(tokenizer, text_processor, strict, images, preference)
        return source, None
    raise UserError(f"unknown source type {kind!r}; expected json, huggingface or cache")


def make_order(source, options, shuffle, seed):
    if getattr(source, "streaming", False):
        return StreamingOrder(source, shuffle, seed, options.shuffle_buffer_size)
    return IndexedOrder(source, shuffle, seed)
