"""Keeping the trainer fed: windows of documents tokenized in parallel, batches made ahead.

`WindowReader` reads slots in windows (all slots lo..hi of the streams it serves) and
hands each stream its tokenized documents in slot order. Tokenizing runs beside packing:
in one worker thread (Rust releases the GIL, so it overlaps) or, with
`tokenizer_processes > 1`, in spawned worker processes (JAX and fork do not mix).
`Prefetcher` runs the batch generator in a background thread a few batches ahead.
Neither changes what is produced, only when. Records that are documents already (from a
token cache) and a dry mixture source's UserError skip the tokenizer.
"""

import multiprocessing
import os
import queue
import threading
from concurrent import futures

import numpy as np

from easylm.data.text import parse_json_line
from easylm.errors import UserError

_PREFETCH_WINDOWS = 2      # windows being tokenized while one is packed
_PREFETCH_BATCHES = 2
_CACHED_PER_STREAM = 64


class WindowReader:

    def __init__(self, order, processor, streams, batch_size, config, single_pass, skip,
                 skipped=None):
        """streams: {row: Stream}; skip(message, slot) is called for each unusable document;
        skipped() says how many were skipped, and the first (or '' if none was).
        processor: a TextProcessor; for a mixture a list, one per source (None for a token
        cache); None when nothing needs tokenizing."""
        self.order, self.streams, self.B = order, streams, batch_size
        self.single_pass, self.skip, self.skipped = single_pass, skip, skipped
        self.chunk_size = config.get("tokenizer_parallel_chunk_size", 1)   # none: a cache
        self.start = np.full(batch_size, np.iinfo(np.int64).max)
        for r, stream in streams.items():
            self.start[r] = stream.next_slot
        self.lo = int(self.start.min())
        # Wide enough that each window holds about tokenizer_parallel_batch_size documents
        # of these streams; from a token cache (nothing to tokenize) at least
        # _CACHED_PER_STREAM per stream, so that packing works on long runs of documents.
        per_window = config.get("tokenizer_parallel_batch_size", 0)
        cached = processor is None or (isinstance(processor, list) and not any(processor))
        if cached:
            per_window = max(per_window, _CACHED_PER_STREAM * len(streams))
        self.width = -(-per_window // len(streams)) * batch_size
        self.exhausted = False
        self.pending = []   # windows being tokenized: (end slot, slots, documents, chunks)
        if cached:
            self.executor = None   # no tokenizer in the loop
        elif config.tokenizer_processes > 1:
            self.executor = futures.ProcessPoolExecutor(
                config.tokenizer_processes, multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(processor,))
            self.processor = None   # the workers hold it
        else:
            self.executor = futures.ThreadPoolExecutor(1)
            self.processor = processor

    def fill(self):
        """Give the streams one more window of documents; False once a single pass ends."""
        while len(self.pending) < _PREFETCH_WINDOWS and not self.exhausted:
            self._submit()
        if not self.pending:
            return False
        hi, slots, documents, chunks = self.pending.pop(0)
        for indices, chunk in chunks:
            for i, document in zip(indices, chunk.result()):
                documents[i] = document
        runs = {r: [] for r in self.streams}   # each stream's documents: one push each
        for slot, document in zip(slots, documents):
            if type(document) is tuple:
                runs[slot % self.B].append((slot, document))
            elif isinstance(document, str):
                self.skip(document, slot)
            elif isinstance(document, UserError):
                r = slot % self.B
                self.streams[r].push_run(runs[r])
                runs[r] = []
                self.streams[r].end(slot, str(document))
        for r, run in runs.items():
            self.streams[r].push_run(run)
        for r, stream in self.streams.items():
            stream.skip_to(hi + (r - hi) % self.B)   # the stream's first slot >= hi
        self._check_starvation(hi)
        return True

    def _submit(self):
        lo, hi = self.lo, self.lo + self.width
        slots = np.arange(lo, hi)
        slots = slots[slots >= self.start[slots % self.B]]   # only our streams, resumed
        records = self.order.read(slots, single_pass=self.single_pass)
        if len(records) < len(slots):
            self.exhausted = True
            slots = slots[:len(records)]
        self.lo = hi
        documents, text = _split(records, tokenize=self.executor is not None)
        chunks = [(indices, self.executor.submit(
                      tokenize_records, [records[i] for i in indices], self.processor))
                  for indices in (text[i:i + self.chunk_size]
                                  for i in range(0, len(text), self.chunk_size))]
        self.pending.append((hi, slots.tolist(), documents, chunks))

    def _check_starvation(self, hi):
        n = self.order.num_documents
        if n is None:
            return
        for r, stream in self.streams.items():
            if not stream.has_row() and not stream.ended and \
                    hi - stream.last_usable > self.B * n + self.width:
                skipped = self.skipped() if self.skipped else ""
                if not skipped:
                    raise UserError(f"row {r} of the batch found no usable document in a whole "
                                    f"epoch ({n} documents); the data has too few usable "
                                    f"documents for batch_size={self.B}")
                if self.B == 1:
                    raise UserError(f"no usable document in a whole epoch of {n}: all were "
                                    f"skipped ({skipped}): fix the data")
                # Row r reads only slots r, r+B, ...: bad lines in step with B starve it,
                # and shuffling helps; when no row has found a usable document (plain text
                # for a preference objective) nothing but the data can.
                others = any(s.has_row() for k, s in self.streams.items() if k != r)
                shuffle = "" if self.order.shuffle or not others else (
                    ", or set shuffle=True so that every row draws from all documents")
                raise UserError(f"no usable document for row {r} of the batch: it reads "
                                f"documents {r}, {r + self.B}, {r + 2 * self.B}, ... of each "
                                f"epoch ({len(range(r, n, self.B))} of the {n}), and all were "
                                f"skipped ({skipped}): fix the data{shuffle}")

    def close(self):
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self.order.source.close()


_WORKER_PROCESSOR = None


def _init_worker(processor):
    global _WORKER_PROCESSOR
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # the workers are the parallelism
    _WORKER_PROCESSOR = processor


def tokenize_records(records, processor=None):
    """records: [(raw, where)] -> one tokenized document (or None / skip reason) each.
    A mixture's records are (raw, where, source) and `processor` a list, one per source."""
    processor = processor or _WORKER_PROCESSOR
    if isinstance(processor, list):
        groups = {}
        for i, (_, _, source) in enumerate(records):
            groups.setdefault(source, []).append(i)
        documents = [None] * len(records)
        for source, indices in groups.items():
            results = tokenize_records([records[i][:2] for i in indices], processor[source])
            for i, document in zip(indices, results):
                documents[i] = document
        return documents
    examples = [(parse_json_line(raw, where) if isinstance(raw, bytes) else raw, where)
                for raw, where in records]
    return processor.process(examples)


def prepare_records(records, processor):
    """What the loader makes of records, done in this thread (for the preview)."""
    documents, text = _split(records)
    if text:
        for i, document in zip(text, tokenize_records([records[i] for i in text], processor)):
            documents[i] = document
    return documents


def _split(records, tokenize=True):
    """(each record's document as far as known, indices of the records to tokenize): a
    cache's (tokens, masks) and a dry source's UserError are final already."""
    documents = [record[0] for record in records]
    if not tokenize:
        return documents, []
    return documents, [i for i, raw in enumerate(documents) if isinstance(raw, (bytes, dict))]


class Prefetcher:
    """Runs a generator in a background thread, a few items ahead of the consumer."""

    _END = object()

    def __init__(self, generator):
        self.queue = queue.Queue(_PREFETCH_BATCHES)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(generator,), daemon=True)
        self.thread.start()

    def _run(self, generator):
        try:
            for item in generator:
                if not self._put(item):
                    break
        except BaseException as e:  # re-raised in the consumer's thread
            self._put(e)
        finally:
            generator.close()
            self._put(self._END)

    def _put(self, item):
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        while True:
            item = self.queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self):
        self.stop.set()
        self.thread.join()
        while not self.queue.empty():   # so that a stale consumer ends instead of waiting
            self.queue.get_nowait()
        self.queue.put(self._END)
