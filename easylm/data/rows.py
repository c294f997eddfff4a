"""What one row of a batch holds: the row kinds.

`Dataset` (dataset.py) owns what every kind shares: the layout (row r reads slots r, r+B,
r+2B, ...), the reader, each row's (slot, offset), the state, evaluation's single pass.
A row kind, chosen once when the dataset is loaded, owns what differs:

    stream(slot, offset)   the stream that fills one row from its documents (the
                           interface of packing.Stream: push_run, skip_to, has_row,
                           is_done, position, next_row; a finite pass pads its last rows)
    rows_per_example       rows of seq_length tokens the model reads per batch row
    new_counts(B)          per-row counters kept in the state (an array, first axis rows)
    make_batch(streams, served, counts, pad_id)
                           the next row of every stream -> the batch of the rows this
                           process serves; adds the rows to `counts`
    metrics(counts, frontier)
                           what the kind adds to each batch's metrics
    marker, counters       the state entries that say "saved from this kind" and hold its
                           counters (None: none); state() is the marker's entry
    restore(state)         checks a saved state against this run's data

Kinds: `Documents` (packed text), `MixtureDocuments` (packed text from a weighted
mixture, counted per source), `pairs.Pairs` (one preference pair per row). A new kind
(GRPO's prompts) is one class like these, chosen in DatasetFactory.load_dataset.
"""

import numpy as np

from easylm.data.packing import Stream, segment_positions
from easylm.errors import UserError


class Documents:
    """Packed text: each row is the next seq_length + 1 tokens of its stream of documents
    (packing.py)."""

    marker = counters = None   # a state without a mixture or pairs entry is one of these
    rows_per_example = 1

    def __init__(self, config, order):
        self.seq_length, self.segment_ids = config.seq_length, config.segment_ids
        self.order = order

    def new_counts(self, batch_size):
        return np.zeros((batch_size, 0, 2), np.int64)   # no counters

    def stream(self, slot, offset):
        return Stream(self.seq_length, slot, offset)

    def make_batch(self, streams, served, counts, pad_id):
        rows = {r: s.next_row(pad_id, self.segment_ids) for r, s in streams.items()}
        return make_batch([rows[r] for r in served], self.segment_ids)

    def metrics(self, counts, frontier):
        return {}

    def state(self):
        return {}

    def restore(self, state):
        restore_size(self.order, state)


class MixtureDocuments(Documents):
    """Packed text from a mixture (mixture.py): each row also counts, per source, the
    documents it finished and its target tokens; the state keeps the mixture's sources
    and weights."""

    marker, counters = "mixture", "source_counts"
    saved_from_it = "the data state was saved from a mixture but this run's dataset is not one"
    not_saved_from_it = ("the data state was not saved from a mixture but this run's dataset "
                         "is one")

    def new_counts(self, batch_size):
        return np.zeros((batch_size, len(self.order.names), 2), np.int64)

    def stream(self, slot, offset):
        return Stream(self.seq_length, slot, offset, track=True)

    def make_batch(self, streams, served, counts, pad_id):
        # Segment ids whether or not the batch has them: the counters count by segment.
        rows = {r: s.next_row(pad_id, True) for r, s in streams.items()}
        batch = make_batch([rows[r] for r in served], self.segment_ids)
        self.order.count(counts, streams, {r: row[2] for r, row in rows.items()})
        return batch

    def metrics(self, counts, frontier):
        return self.order.metrics(counts, frontier)

    def state(self):
        return {"mixture": self.order.state_dict()}

    def restore(self, state):
        """Checks each source's size, and may change the weights."""
        self.order.load_state_dict(state["mixture"], state["streams"].values())


def make_batch(rows, with_segments):
    """Packed rows (tokens, masks, segments) -> input_tokens, target_tokens, loss_masks
    (b, T) and, with_segments, segment_ids and positions."""
    tokens, masks = (np.stack(x) for x in list(zip(*rows))[:2])   # (b, T+1) each
    batch = dict(input_tokens=tokens[:, :-1], target_tokens=tokens[:, 1:],
                 loss_masks=masks[:, 1:])
    if with_segments:
        segments = np.stack([row[2] for row in rows])
        batch["segment_ids"] = segments[:, :-1]
        batch["positions"] = segment_positions(segments[:, :-1])
    return batch


def restore_size(order, state):
    """A plain source's document count must be the saved one (a streaming source learns
    its epoch size from the state)."""
    saved, now = state.get("num_documents"), order.num_documents
    if saved is not None and now is not None and saved != now:
        raise UserError(f"the data changed: the state was saved with {saved} "
                        f"documents, the source now has {now}")
    if saved is not None and now is None:
        order.num_documents = saved
