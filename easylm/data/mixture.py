"""Weighted mixtures of sources: which source's next document fills each slot.

    --train_dataset.type=mixture --train_dataset.mixture.sources=mix.json

    [{"name": "web", "weight": 0.7, "path": "web/*.jsonl"},
     {"name": "sft", "weight": 0.2, "path": "sft.jsonl",
      "text_processor": {"fields": "[prompt],answer"}, "repeat": false},
     {"name": "books", "weight": 0.1, "type": "cache", "path": "books-cache"}]

A source is a json (default), huggingface or cache source with its path (and for
huggingface subset, split, data_files, streaming, shuffle_buffer_size), a weight, a
`name` for its counters, its own `text_processor` options on top of the run's
--train_dataset.text_processor.*, and `repeat` (default true; false: running out of
documents is an error). Each source keeps its own order: its own seeded shuffle and
epochs. docs/data.md has the whole format.

Sampling is per document and stratified, like Levanter's MixtureDataset. The mixture's
slots are cut into blocks of about BLOCK slots; the first b blocks hold exactly
N_k(b) = round(b * BLOCK * w_k) documents of source k (w: the weights over their sum), in a
seeded random order inside each block. So every run of whole blocks has each source's
share to within one document, a source with a tiny weight still comes up (once every
1 / (BLOCK * w_k) blocks), and the source of any slot is a formula: resuming at slot 10^9
costs one block's work, not a replay. Per document, not per batch row, because a row is a
stream of documents (packing.py): mixing documents keeps that layout, so the state is
still each row's (slot, offset) and every row sees every source. Weights are therefore
shares of documents; the per-source token counters show the token shares.

Changing the weights on resume starts a new segment of slots after the furthest slot a
row has reached; each source continues with its next unread document, so no document is
repeated or skipped, but batches after the change differ from any uninterrupted run.
"""

import json
import logging
import math
import os

import numpy as np
from ml_collections import ConfigDict

from easylm.data import options as dataset_options
from easylm.data.sources import make_order, open_source
from easylm.data.text import TextProcessor
from easylm.errors import UserError

logger = logging.getLogger(__name__)
BLOCK = 1024
_SOURCE_KEYS = ("name", "type", "weight", "repeat", "text_processor")
_OPTION_BLOCKS = {kind: block for kind, block in dataset_options.TYPES.items()
                  if kind != "mixture"}   # a mixture's source is one of the others
# What a source may set of its type's block; a huggingface configuration is `subset`
# because `name` names the source.
_OPTIONS = {"path": "path", "subset": "name", "split": "split", "data_files": "data_files",
            "streaming": "streaming", "shuffle_buffer_size": "shuffle_buffer_size"}


def load_mixture(loader, text_processor, tokenizer, shuffle, for_eval):
    """(MixtureOrder, one processor per source) for the --train_dataset.mixture.* block."""
    entries = parse_sources(loader.sources)
    defaults = dataset_options.default_config()
    orders, processors = [], []
    for i, entry in enumerate(entries):
        label = f"mixture source {entry['name']!r}"
        options = _updated(defaults[_OPTION_BLOCKS[entry["type"]]],
                           {_OPTIONS[k]: v for k, v in entry.items() if k in _OPTIONS}, label)
        processing = _updated(text_processor, entry.get("text_processor", {}),
                              f"{label}: text_processor")
        try:
            source, processor = open_source(entry["type"], options, processing, tokenizer,
                                            loader.strict)
        except UserError as e:
            raise UserError(f"{label}: {e}") from None
        if getattr(source, "streaming", False) and (for_eval or not entry["repeat"]):
            raise UserError(f"{label}: {'an eval mixture' if for_eval else 'repeat=false'} "
                            f"needs a source with a known length, not a streaming one")
        seed = int(np.random.SeedSequence([loader.seed, i]).generate_state(1)[0])
        orders.append(make_order(source, options, shuffle, seed))
        processors.append(processor)
    order = MixtureOrder([e["name"] for e in entries], orders, [e["weight"] for e in entries],
                         [e["repeat"] for e in entries], loader.seed, shuffle, for_eval)
    return order, processors


def _updated(config, values, label):
    """A copy of `config` with `values`, each of the type of the option it replaces."""
    config = ConfigDict(config.to_dict())
    for key, value in values.items():
        if key == "data_files" and isinstance(value, list):
            value = ",".join(map(str, value))
        kind = type(config[key])
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if key == "add_bos_token" and isinstance(value, bool):  # auto/true/false, once a bool
            value = str(value).lower()
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise UserError(f"{label}: {key} must be {kind.__name__}, got {value!r}")
        config[key] = value
    return config


def parse_sources(spec):
    """The sources of --train_dataset.mixture.sources (a .json/.yaml file or JSON text),
    checked: [{'name', 'type', 'weight', 'repeat', ...options}]."""
    if not spec.strip():
        raise UserError("--train_dataset.type=mixture needs mixture.sources: a .json or "
                        ".yaml file of sources, or the JSON itself")
    where = "--train_dataset.mixture.sources"
    if spec.lstrip()[:1] in "[{":
        text = spec
    else:
        import fsspec

        where = spec
        try:
            with fsspec.open(spec, "r", encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise UserError(f"mixture file {spec!r} does not exist") from None
    try:
        if os.path.splitext(spec)[1] in (".yaml", ".yml"):
            import yaml

            entries = yaml.safe_load(text)
        else:
            entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: malformed JSON ({e.msg} at line {e.lineno} column "
                        f"{e.colno})") from None
    except Exception as e:  # yaml's errors have no common base worth importing
        raise UserError(f"{where}: malformed YAML ({' '.join(str(e).split())})") from None
    if isinstance(entries, dict) and set(entries) == {"sources"}:
        entries = entries["sources"]
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: expected a non-empty list of sources (or "
                        f"{{\"sources\": [...]}})")
    checked = [_check_source(i, entry, where) for i, entry in enumerate(entries)]
    names = [e["name"] for e in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise UserError(f"{where}: two sources are named {duplicate!r}; names must differ")
    if sum(e["weight"] for e in checked) <= 0:
        raise UserError(f"{where}: the weights sum to 0; give at least one source a "
                        f"positive weight")
    return checked


def _check_source(i, entry, where):
    if not isinstance(entry, dict):
        raise UserError(f"{where}: source {i} is {type(entry).__name__}, expected an object "
                        f"with path and weight")
    name = entry.get("name", f"source{i}")
    label = f"{where}: source {i} ({name!r})"
    kind = entry.get("type", "json")
    if kind not in _OPTION_BLOCKS:
        raise UserError(f"{label}: unknown type {kind!r}; expected json, huggingface or cache")
    allowed = _SOURCE_KEYS + (tuple(_OPTIONS) if kind == "huggingface" else ("path",))
    unknown = [k for k in entry if k not in allowed]
    if unknown:
        raise UserError(f"{label}: unknown key {unknown[0]!r} for a {kind} source; expected "
                        f"some of {', '.join(allowed)}")
    if not entry.get("path"):
        raise UserError(f"{label}: no path")
    weight = entry.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise UserError(f"{label}: weight must be a number, got {weight!r}")
    if not math.isfinite(weight) or weight < 0:
        raise UserError(f"{label}: weight {weight!r} is negative or not finite")
    repeat = entry.get("repeat", True)
    if not isinstance(repeat, bool):
        raise UserError(f"{label}: repeat must be true or false, got {repeat!r}")
    processing = entry.get("text_processor", {})
    if not isinstance(processing, dict) or any(k not in TextProcessor.HELP for k in processing):
        bad = processing if not isinstance(processing, dict) else next(
            k for k in processing if k not in TextProcessor.HELP)
        raise UserError(f"{label}: text_processor has {bad!r}; expected an object with some "
                        f"of {', '.join(TextProcessor.HELP)}")
    return dict(entry, name=str(name), type=kind, weight=float(weight), repeat=repeat)


class _Segment:
    """Slots from `start` on, mixed with `weights`; source k's first document in the
    segment is its document `base[k]`."""

    def __init__(self, start, weights, base):
        self.start = int(start)
        self.weights = np.asarray(weights, np.float64)
        self.base = np.asarray(base, np.int64)

    def before(self, blocks):
        """(len(blocks), K): documents of each source in the segment's first `blocks`."""
        return np.floor(np.multiply.outer(np.asarray(blocks, np.float64),
                                          BLOCK * self.weights) + 0.5).astype(np.int64)


class _Sources(list):
    def close(self):
        for source in self:
            source.close()


class MixtureOrder:
    """An order over several sources' orders. In training, slot -> (source, the source's
    slot) as the module docstring says; for evaluation (one pass) the sources one after
    another, each once."""

    def __init__(self, names, orders, weights, repeat, seed, shuffle, for_eval):
        self.names, self.orders, self.repeat = names, orders, repeat
        self.seed, self.shuffle, self.for_eval = seed, shuffle, for_eval
        self.weights = np.asarray(weights, np.float64) / sum(weights)
        self.segments = [_Segment(0, self.weights, np.zeros(len(orders)))]
        self.source = _Sources(order.source for order in orders)
        self._blocks = {}

    @property
    def num_documents(self):
        sizes = [order.num_documents for order in self.orders]
        return None if None in sizes else sum(sizes)

    # -- where slots come from ------------------------------------------------------------

    def locate(self, slots):
        """(source, the source's own slot) arrays for an array of slots."""
        slots = np.asarray(slots, np.int64)
        sources, inner = np.zeros(len(slots), np.int64), np.zeros(len(slots), np.int64)
        if self.for_eval:
            first = np.cumsum([0] + [order.num_documents for order in self.orders])
            sources[:] = np.searchsorted(first, slots, side="right") - 1
            return sources, slots - first[sources]
        starts = [segment.start for segment in self.segments]
        which = np.searchsorted(starts, slots, side="right") - 1
        for g in np.unique(which):
            segment, where = self.segments[g], np.flatnonzero(which == g)
            offsets = slots[where] - segment.start
            blocks, before = self._blocks_around(segment, offsets.min(), offsets.max())
            ends = before.sum(1)                   # the first slot of each block
            b = np.searchsorted(ends, offsets, side="right") - 1
            for i in np.unique(b):
                here = where[b == i]
                order, rank = self._block(g, segment, int(blocks[i]))
                position = slots[here] - segment.start - ends[i]
                sources[here] = order[position]
                inner[here] = segment.base[order[position]] + before[i, order[position]] + \
                    rank[position]
        return sources, inner

    def counts_before(self, slot):
        """(K,): documents of each source in the slots before `slot`."""
        if self.for_eval:
            first = np.cumsum([0] + [order.num_documents for order in self.orders])
            return np.clip(slot - first[:-1], 0, np.diff(first))
        g = int(np.searchsorted([s.start for s in self.segments], slot, side="right")) - 1
        return self._counts_before(g, slot)

    def _counts_before(self, g, slot):
        segment = self.segments[g]
        offset = slot - segment.start
        blocks, before = self._blocks_around(segment, offset, offset)
        ends = before.sum(1)
        i = int(np.searchsorted(ends, offset, side="right")) - 1
        order, _ = self._block(g, segment, int(blocks[i]))
        return segment.base + before[i] + np.bincount(order[:offset - ends[i]],
                                                      minlength=len(self.orders))

    @staticmethod
    def _blocks_around(segment, lo, hi):
        """Block numbers that may hold offsets lo..hi of the segment, and the documents of
        each source before each of them. A block holds BLOCK slots give or take K/2."""
        K = len(segment.weights)
        blocks = np.arange(max(0, (lo - K) // BLOCK - 1), (hi + K) // BLOCK + 2)
        return blocks, segment.before(blocks)

    def _block(self, g, segment, b):
        """(source of each slot of block b, the slot's rank among its source's)."""
        key = (g, b)
        if key not in self._blocks:
            if len(self._blocks) > 16:
                self._blocks.pop(next(iter(self._blocks)))
            counts = np.diff(segment.before([b, b + 1]), axis=0)[0]
            order = np.repeat(np.arange(len(counts)), counts)
            np.random.default_rng([self.seed, g, b]).shuffle(order)
            rank = np.zeros(len(order), np.int64)
            for k in range(len(counts)):
                rank[order == k] = np.arange(counts[k])
            self._blocks[key] = order, rank
        return self._blocks[key]

    # -- the order interface (sources.py) ----------------------------------------------

    def read(self, slots, single_pass=False):
        """Records (raw, where, source) for slots; a source with repeat=false that has run
        out gives a UserError in place of a record."""
        slots = np.asarray(slots, np.int64)
        if single_pass:
            slots = slots[slots < self.num_documents]
        sources, inner = self.locate(slots)
        records = [None] * len(slots)
        for k in np.unique(sources):
            where, order = np.flatnonzero(sources == k), self.orders[k]
            if not self.repeat[k]:
                dry = inner[where] >= order.num_documents
                error = UserError(f"mixture source {self.names[k]!r} ran dry: its "
                                  f"{order.num_documents} documents are used up and it has "
                                  f"repeat=false")
                for i in where[dry]:
                    records[i] = (error, self.names[k], k)
                where = where[~dry]
            for i, record in zip(where, order.read(inner[where])):
                records[i] = (*record, k)
        return records

    def epoch(self, slot):
        """Whole passes over every source (with weight) before `slot`."""
        epochs = [e for e, w in zip(self.source_epochs(slot), self.segments[-1].weights)
                  if w > 0]
        return min(epochs) if epochs else 0

    def source_epochs(self, slot):
        return [int(c // order.num_documents) if order.num_documents else 0
                for c, order in zip(self.counts_before(slot), self.orders)]

    # -- counters -------------------------------------------------------------------------

    def count(self, counts, streams, segments):
        """Adds the last row of each stream to counts[row] (sources, 2): documents finished
        and target tokens. segments[row]: that row's segment ids."""
        rows, slots, columns, amounts = [], [], [], []
        for r, stream in streams.items():
            n = len(stream.row_slots)
            tokens = np.bincount(segments[r][1:], minlength=n + 1)[1:]   # targets only
            rows += [r] * (n + len(stream.finished))
            slots += stream.row_slots + stream.finished
            columns += [1] * n + [0] * len(stream.finished)
            amounts += tokens.tolist() + [1] * len(stream.finished)
        if slots:
            sources, _ = self.locate(slots)
            np.add.at(counts, (np.asarray(rows), sources, np.asarray(columns)), amounts)

    def metrics(self, counts, frontier):
        """Per-source counters of these rows' counts, epochs at slot `frontier`."""
        totals = counts.sum(0)
        metrics = {}
        for k, (name, epoch) in enumerate(zip(self.names, self.source_epochs(frontier))):
            metrics[f"source/{name}/documents"] = int(totals[k, 0])
            metrics[f"source/{name}/tokens"] = int(totals[k, 1])
            metrics[f"source/{name}/epoch"] = epoch
        return metrics

    # -- state ----------------------------------------------------------------------------

    def state_dict(self):
        return dict(block=BLOCK, sources=list(self.names),
                    num_documents=[order.num_documents for order in self.orders],
                    segments=[dict(start=s.start, weights=s.weights.tolist(),
                                   base=s.base.tolist()) for s in self.segments])

    def load_state_dict(self, state, positions):
        """positions: every row's [slot, offset]; the new weights, if they changed, start
        after the furthest."""
        if state["sources"] != self.names:
            raise UserError(f"the data state was saved with mixture sources "
                            f"{state['sources']} but this run has {self.names}")
        if state["block"] != BLOCK:
            raise UserError(f"the data state was saved with mixture blocks of "
                            f"{state['block']} documents, this version uses {BLOCK}")
        for name, saved, order in zip(self.names, state["num_documents"], self.orders):
            if saved is not None and order.num_documents is None:
                order.num_documents = saved   # a streaming source's learnt epoch size
            elif saved is not None and saved != order.num_documents:
                raise UserError(f"the data changed: mixture source {name!r} had {saved} "
                                f"documents when the state was saved, it now has "
                                f"{order.num_documents}")
        self.segments = [_Segment(s["start"], s["weights"], s["base"])
                         for s in state["segments"]]
        self._blocks = {}
        last = self.segments[-1]
        if np.array_equal(last.weights, self.weights):
            return
        start = max(last.start, 1 + max(slot for slot, _ in positions))
        base = self._counts_before(len(self.segments) - 1, start)
        if start == last.start:   # nothing was read with the last weights
            self.segments.pop()
        self.segments.append(_Segment(start, self.weights, base))
        logger.warning("mixture weights changed from %s to %s: slots from %d on use the new "
                       "ones; each source continues with its next document",
                       np.round(last.weights, 4).tolist(), np.round(self.weights, 4).tolist(),
                       start)
