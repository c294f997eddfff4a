"""The data pipeline the trainer iterates: batches of packed rows, with exact state.

Layout. Row r of every global batch (r < batch_size B) is packed from its own stream of
documents: the documents in slots r, r+B, r+2B, ... of the source order (see
`sources.py`). Process p of P serves rows [p*B/P, (p+1)*B/P), so it reads and tokenizes
only its own streams' documents; the shares are disjoint, together they are the data,
and the global batch is the same whatever P is.

State. A stream's position is (slot, offset): the next row starts at token `offset` of
the document in `slot`. The data state is every stream's position plus what must not
change (batch size, sequence length, seed, number of documents), as JSON. Resuming
re-reads each stream from its slot, so it continues with exactly the next token, also
with a different number of processes. Documents read ahead and not yet used are simply
read again; nothing buffered needs saving.

Work. `reader.py` reads slots in windows, tokenizes them beside packing (a worker thread,
or `tokenizer_processes` worker processes) and packs batches ahead of the trainer in a
background thread. The results do not depend on window sizes or worker counts.

Mixtures (`mixture.py`) and token caches (`cache_reader.py`) are orders and sources like the
others: the layout, packing, state and shares above apply to them unchanged. What a row
holds is its row kind (`rows.py`), chosen once at loading: packed documents; packed
documents of a mixture, which adds its weights to the state and per-source counters to
each row; or preference pairs (`pairs.py`), one pair per row instead of packed
documents, with a counter of truncated pairs per row.

Evaluation (`for_eval=True`) is one pass in file order. Every process tokenizes the
whole eval set (it is small) so that all agree, without talking, on how many batches
there are; the last rows are padded with loss mask 0 and each process yields its rows.
"""

import bisect
import json
import logging
import time

import numpy as np

from easylm.data import options
from easylm.data.image_chats import (
    CachedImageChats,
    ImageChatProcessor,
    ImageChats,
    ImagePairs,
    image_chat_problems,
)
from easylm.data.mixture import load_mixture
from easylm.data.options import loader_block  # noqa: F401 (where callers look for it)
from easylm.data.pairs import Pairs, open_pairs
from easylm.data.prompts import Prompts, open_prompts
from easylm.data.reader import Prefetcher, WindowReader, prepare_records
from easylm.data.rows import Documents, MixtureDocuments
from easylm.data.sources import make_order, open_source
from easylm.errors import UserError

logger = logging.getLogger(__name__)
STATE_VERSION = 1
_MAX_WARNINGS = 10
# The row kinds whose states are marked (rows.py), in the order a mismatch is reported.
_MARKED_KINDS = (MixtureDocuments, Pairs, Prompts, ImageChats)


class DatasetFactory:

    HELP = options.HELP
    get_default_config = staticmethod(options.default_config)

    @classmethod
    def load_dataset(cls, config, tokenizer, for_eval=False, process_index=None,
                     process_count=None, pairs=False, section=None, prompts=0, images=None):
        """process_index/process_count default to JAX's; tests pass them to simulate hosts.
        pairs: the caller trains on preference pairs (batches of chosen_* and rejected_*
        rows); other callers get a clear error for preference data. prompts: > 0, rows are
        prompts for rollouts, leaving this many tokens of a row for the completion
        (prompts.py). images: an image-text model's `image_chats` object; with
        text_processor.chat=True, rows are chats with images (image_chats.py).
        section: the flags' name in messages (default: eval_dataset for_eval, else
        train_dataset)."""
        config = cls.get_default_config(config)
        section = section or ("eval_dataset" if for_eval else "train_dataset")
        loader = options.loader_options(config, section)
        shuffle = loader.shuffle and not for_eval
        if prompts:
            source, processor = open_prompts(config, loader, tokenizer, prompts,
                                             images if config.text_processor.chat else None)
            order = make_order(source, loader, shuffle, loader.seed)
            kind = Prompts(loader, order)
        elif images is not None and config.text_processor.chat \
                and not config.preference.enabled:
            _refuse_image_problems(config, loader)
            source, _ = open_source(config.type, loader, config.text_processor, tokenizer,
                                    loader.strict, images)
            processor = ImageChatProcessor(config.text_processor, tokenizer, images,
                                           loader.seq_length)
            if config.type == "cache":   # whole chats, tokenized: fitted as they are read
                source, processor = CachedImageChats(source, processor), None
            order = make_order(source, loader, shuffle, loader.seed)
            kind = ImageChats(loader, order, images)
        elif config.preference.enabled:
            if not pairs:
                raise UserError(f"--{section}.preference.enabled=True makes batches of "
                                f"preference pairs, which only a preference objective trains "
                                f"on; this command trains next-token prediction")
            order, processor, kind = _pair_batches(config, loader, tokenizer, shuffle, images)
        elif config.type == "mixture":
            order, processor = load_mixture(loader, config.text_processor, tokenizer, shuffle,
                                            for_eval)
            kind = MixtureDocuments(loader, order)
        else:
            source, processor = open_source(config.type, loader, config.text_processor,
                                            tokenizer, loader.strict)
            order = make_order(source, loader, shuffle, loader.seed)
            kind = Documents(loader, order)
        if process_index is None or process_count is None:
            import jax

            process_index, process_count = jax.process_index(), jax.process_count()
        dataset = Dataset(loader, order, processor, kind, tokenizer, for_eval, process_index,
                          process_count)
        if for_eval:
            dataset.require_a_usable_example(section)
        return dataset


def _pair_batches(config, loader, tokenizer, shuffle: bool, images):
    """(order, processor, kind) of preference pairs: text pairs, or image chats' pairs when
    `images` (an image-text model's `image_chats`) and text_processor.chat=True."""
    if images is not None and config.text_processor.chat:   # image pairs
        _refuse_image_problems(config, loader)
    else:
        images = None
    source, processor = open_pairs(config, loader, tokenizer, images)
    if config.type == "cache":   # whole image pairs: fitted as they are read
        source, processor = CachedImageChats(source, processor), None
    order = make_order(source, loader, shuffle, loader.seed)
    return order, processor, (Pairs(loader, order) if images is None
                              else ImagePairs(loader, order, images))


def _refuse_image_problems(config, loader):
    """The first reason image chats cannot be read from this source, as a UserError."""
    problems = image_chat_problems(config, loader)
    if problems:
        raise UserError(problems[0])


class Dataset:

    def __init__(self, config, order, processor, kind, tokenizer, for_eval, process_index,
                 process_count):
        """processor: what the reader tokenizes records with (a TextProcessor, one per
        source of a mixture, None for a token cache, or a PreferenceProcessor); kind: what
        a row holds (rows.py)."""
        self.config, self.order, self.processor, self.kind = config, order, processor, kind
        self._tokenizer = tokenizer
        self.for_eval = for_eval
        self.process_index, self.process_count = process_index, process_count
        B = config.batch_size
        if B <= 0 or config.seq_length <= 0:
            raise UserError(f"batch_size and seq_length must be positive, got {B} and "
                            f"{config.seq_length}")
        if B % process_count:
            raise UserError(f"batch_size={B} is not divisible by the {process_count} "
                            f"processes")
        local = B // process_count
        self.rows = range(process_index * local, (process_index + 1) * local)
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                           if i is not None)
        self._positions = {r: (r, 0) for r in range(B)}
        self.mixture = getattr(order, "names", None)   # the sources of a mixture
        self.pairs = isinstance(kind, Pairs)   # for the preview, which shows pairs apart
        self._counts = kind.new_counts(B)   # per row, kept in the state
        self._batches = 0
        self._skipped = 0
        self._skip_slots = []   # the slots skipped, in order: batches count those behind them
        self._first_skip = None
        self._prefetcher = None

    @property
    def seq_length(self):
        return self.config.seq_length

    @property
    def batch_size(self):
        return self.config.batch_size

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def vocab_size(self):
        return len(self._tokenizer)

    def __iter__(self):
        return self.iterate()

    def iterate(self, place=None):
        """Yields (batch, metrics), produced a few batches ahead in a background thread.
        `place` (the trainer's host->device transfer) runs in that thread too, so batches
        arrive already on the devices. The state (get_state_dict) counts only the batches
        yielded, however far ahead the thread is."""
        self.close()
        if self.for_eval:   # every process packs all rows; see the module docstring
            positions, batches = {r: (r, 0) for r in range(self.batch_size)}, 0
            counts = np.zeros_like(self._counts)
        else:
            positions, batches = {r: self._positions[r] for r in self.rows}, self._batches
            counts = self._counts.copy()
        generator = self._generate(positions, batches, counts)
        prefetcher = Prefetcher(generator if place is None else _placed(generator, place))
        self._prefetcher = prefetcher
        try:
            for batch, metrics, state in prefetcher:
                if state is not None:
                    positions, counts = state
                    self._positions.update(positions)
                    self._counts[self.rows.start:self.rows.stop] = counts
                    self._batches += 1
                yield batch, metrics
        finally:
            prefetcher.close()

    def close(self):
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def require_a_usable_example(self, section):
        """Refuses a single pass in which no example makes a row: an eval set of the wrong
        kind (text for a preference objective, pairs for next-token training) would have
        every example skipped and evaluate nothing, where the train set stops the run. Reads
        until the first usable example: a window for good data, the whole pass for bad."""
        examples, first_skip, lo, window = 0, None, 0, 64
        while records := self.order.read(np.arange(lo, lo + window), single_pass=True):
            for document in prepare_records(records, self.processor):
                if isinstance(document, tuple) and len(document[0]):
                    return
                examples += document is not None   # None: a blank line
                first_skip = first_skip or (document if isinstance(document, str) else None)
            if len(records) < window:
                break
            lo += window
        why = f"all {examples} were skipped, the first: {first_skip}" if first_skip else \
            f"its {examples} examples have no tokens"
        raise UserError(f"--{section} has no usable example: {why}")

    # -- state -------------------------------------------------------------------------

    def _fixed(self):
        return dict(version=STATE_VERSION, batch_size=self.config.batch_size,
                    seq_length=self.config.seq_length, shuffle=self.order.shuffle,
                    seed=self.config.seed, num_documents=self.order.num_documents)

    def get_state_dict(self):
        """JSON-serialisable. With several real JAX processes every process must call it
        (it gathers all streams); with simulated ones, merge with merge_state_dicts."""
        state = dict(self._fixed(), batches=self._batches,
                     streams={str(r): list(self._positions[r]) for r in self.rows})
        state.update(self.kind.state())
        if self.kind.counters:
            state[self.kind.counters] = {str(r): self._counts[r].tolist() for r in self.rows}
        import jax

        if self.process_count > 1 and jax.process_count() == self.process_count:
            state = merge_state_dicts(_allgather_json(state))
        return state

    def load_state_dict(self, state):
        self.close()
        fixed = self._fixed()
        for key in ("version", "batch_size", "seq_length", "shuffle", "seed"):
            if state.get(key) != fixed[key]:
                raise UserError(f"the data state was saved with {key}={state.get(key)!r} "
                                f"but this run has {key}={fixed[key]!r}")
        for kind in _MARKED_KINDS:
            saved = state.get(kind.marker) not in (None, False)
            if saved != isinstance(self.kind, kind):
                raise UserError(kind.saved_from_it if saved else kind.not_saved_from_it)
        self.kind.restore(state)
        missing = [r for r in self.rows if str(r) not in state["streams"]]
        if missing:
            raise UserError(f"the data state has no position for rows {missing[:8]} of "
                            f"process {self.process_index}; merge the states of all "
                            f"processes (merge_state_dicts)")
        self._positions = {int(r): tuple(p) for r, p in state["streams"].items()}
        for r, counts in state.get(self.kind.counters, {}).items():
            self._counts[int(r)] = counts
        self._batches = state["batches"]

    # -- production (runs in the background thread) ------------------------------------

    def _generate(self, positions, batches, counts):
        """Yields (batch, metrics, (positions, counts) of this process's rows after the
        batch); counts (the kind's, rows first) is updated in place for the rows served."""
        B, T, kind = self.config.batch_size, self.config.seq_length, self.kind
        streams = {r: kind.stream(slot, offset) for r, (slot, offset) in positions.items()}
        served = slice(self.rows.start, self.rows.stop)
        reader = WindowReader(self.order, self.processor, streams, B, self.config,
                              single_pass=self.for_eval, skip=self._skip,
                              skipped=self._skipped_so_far)
        busy, tokens = 0.0, 0
        row_tokens = kind.rows_per_example * T
        try:
            while True:
                t = time.perf_counter()
                for stream in streams.values():
                    while not stream.has_row():
                        if stream.ended:
                            raise UserError(f"{stream.ended} (making batch {batches + 1})")
                        if not reader.fill():
                            break
                if self.for_eval and all(s.is_done() for s in streams.values()):
                    return
                batch = kind.make_batch(streams, self.rows, counts, self.pad_id)
                batches += 1
                tokens += len(self.rows) * row_tokens
                after = {r: s.position() for r, s in streams.items()}
                frontier = min(slot for slot, _ in after.values())
                metrics = dict(
                    dataset_batches=batches,
                    dataset_total_tokens=batches * B * row_tokens,
                    dataset_epoch=self.order.epoch(frontier),
                    dataset_skipped_documents=bisect.bisect_left(self._skip_slots, frontier),
                    **kind.metrics(counts[served], frontier),
                )
                busy += time.perf_counter() - t
                metrics["dataset_tokens_per_second"] = tokens / max(busy, 1e-9)
                state = None if self.for_eval else (
                    {r: after[r] for r in self.rows}, counts[served].copy())
                yield batch, metrics, state
        finally:
            reader.close()

    def _skip(self, message, slot):
        if self.config.strict:
            raise UserError(message)
        self._skipped += 1
        bisect.insort(self._skip_slots, slot)
        self._first_skip = self._first_skip or message
        if self._skipped <= _MAX_WARNINGS:
            logger.warning("skipped %s%s", message,
                           " (further skips are only counted)" if self._skipped ==
                           _MAX_WARNINGS else "")


    def _skipped_so_far(self):
        if not self._skipped:
            return ""
        return f"{self._skipped} skips so far, the first: {self._first_skip}"


_PER_ROW = ("streams", *(kind.counters for kind in _MARKED_KINDS if kind.counters))   # by row


def merge_state_dicts(states):
    """One state from the states of all processes (each holds its own rows)."""
    merged = dict(states[0], **{key: {} for key in _PER_ROW if key in states[0]})
    for state in states:
        for key in ("version", "batch_size", "seq_length", "shuffle", "seed", "batches"):
            if state[key] != merged[key]:
                raise UserError(f"data states of different processes disagree on {key}: "
                                f"{merged[key]!r} vs {state[key]!r}")
        merged["num_documents"] = merged["num_documents"] or state["num_documents"]
        for key in _PER_ROW:
            merged.get(key, {}).update(state.get(key, {}))
    return merged


def _allgather_json(obj):
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).ravel()
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(data)] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n])) for row, n in zip(gathered, lengths)]


def _placed(generator, place):
    try:
        for batch, metrics, state in generator:
            yield place(batch), metrics, state
    finally:
        generator.close()


def make_global_batch(batch, mesh):
    """This process's rows -> global jax.Arrays, rows split over the batch axes (dp, fsdp,
    ep); any rank (a preference batch's per-pair reference log-probabilities are (b,))."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from easylm.runtime.sharding import BATCH_AXES

    def sharding(x):  # rows split, every other axis whole
        return NamedSharding(mesh, P(BATCH_AXES, *(None,) * (x.ndim - 1)))

    return {k: jax.make_array_from_process_local_data(sharding(v), v) for k, v in batch.items()}
