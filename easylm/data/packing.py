"""Pack one stream of documents into rows of seq_length + 1 tokens.

Rows overlap by one token: a row holds tokens [s, s+T] of the stream and the next row
starts at s+T, so every token after the first is a target exactly once:
  input_tokens = row[:-1], target_tokens = row[1:], loss_masks = masks[1:].
A document longer than a row continues in the next row; none is dropped or cut short.
With segment ids, each document piece in a row gets its own id (1, 2, ...; 0 is
padding) and positions restart at 0 for each piece, so attention can stay inside a
document.

The stream's exact position is (slot, offset): the next row starts at token `offset`
of the document in `slot`. Documents without tokens never enter the queue. With
`track`, after a row `row_slots` are the slots of its segments 1, 2, ... and `finished`
the slots of the documents it completed (what a mixture counts per source).
"""

import collections

import numpy as np


class Stream:
    """Documents of one row of the batch: slots r, r+B, r+2B, ... in order. They queue
    as runs (many documents in one array, as the loader pushes a window's worth), so a
    row is cut with a few numpy calls however short the documents are."""

    def __init__(self, seq_length, slot, offset=0, track=False):
        """track: keep row_slots and finished (what a mixture counts) after each row."""
        self.row_length = seq_length + 1
        self.track = track
        self.next_slot = slot        # the next slot to read into the queue
        self.offset = offset         # into the first document pushed (when resuming)
        self.queue = collections.deque()   # runs: (slots (n,), starts (n+1,), tokens, masks)
        self.head = 0                # the token of queue[0] where the next row starts
        self.done = 0                # documents of queue[0] already reported finished
        self.available = 0           # tokens from the current position to the queue's end
        self.last_usable = slot      # the last slot that had tokens (to detect starvation)
        self.ended = None            # why no documents follow (a mixture source ran dry)
        self.row_slots, self.finished = [], []

    def push(self, slot, tokens, masks):
        self.push_run([(slot, (tokens, masks))])

    def push_run(self, documents):
        """documents: [(slot, (tokens, masks))] in slot order. Slots read before (a window
        started earlier) and empty documents are dropped."""
        if self.ended or not documents:
            return
        if documents[0][0] < self.next_slot:
            documents = [d for d in documents if d[0] >= self.next_slot]
            if not documents:
                return
        self.next_slot = documents[-1][0] + 1   # the loader moves it on to the next slot
        lengths = [len(document[0]) for _, document in documents]
        if 0 in lengths:
            documents = [d for d, n in zip(documents, lengths) if n]
            lengths = [n for n in lengths if n]
            if not documents:
                return
        self.last_usable = documents[-1][0]
        starts = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        run = (np.fromiter((slot for slot, _ in documents), np.int64, len(documents)), starts,
               np.concatenate([document[0] for _, document in documents]),
               np.concatenate([document[1] for _, document in documents]))
        if not self.queue:
            self.head, self.offset = self.offset, 0
        self.available += len(run[2]) - (self.head if not self.queue else 0)
        self.queue.append(run)

    def end(self, slot, reason):
        """No documents from `slot` on; the loader raises `reason` once the rows before
        it are used up."""
        if slot >= self.next_slot and not self.ended:
            self.ended = reason

    def skip_to(self, slot):
        """No more documents below `slot` (the loader read its window up to there)."""
        self.next_slot = max(self.next_slot, slot)

    def position(self):
        """(slot, offset) of the next row's first token."""
        if not self.queue:
            return self.next_slot, self.offset
        slots, starts = self.queue[0][:2]
        d = int(starts.searchsorted(self.head, "right")) - 1
        return int(slots[d]), self.head - int(starts[d])

    def has_row(self):
        return self.available >= self.row_length

    def is_done(self):
        """For a finite pass: whether any target is left (a lone token has none)."""
        return self.available <= 1

    def next_row(self, pad_id=0, segments=True):
        """tokens (T+1,), masks (T+1,), segments (T+1,) or, if not asked for, None; short
        rows are padded with pad_id, mask 0 and segment 0 (only at the end of a finite
        pass)."""
        tokens, masks, lengths = [], [], []
        need, head = self.row_length, self.head
        self.row_slots = []
        for slots, starts, run_tokens, run_masks in self.queue:
            n = min(len(run_tokens) - head, need)
            tokens.append(run_tokens[head:head + n])
            masks.append(run_masks[head:head + n])
            if segments or self.track:
                first = int(starts.searchsorted(head, "right")) - 1
                last = int(starts.searchsorted(head + n))   # documents first..last-1
                bounds = starts[first:last + 1].copy()
                bounds[0], bounds[-1] = head, head + n
                lengths.append(bounds[1:] - bounds[:-1])
                if self.track:
                    self.row_slots += slots[first:last].tolist()
            need, head = need - n, 0
            if not need:
                break
        ids = None
        if segments:
            lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
            ids = np.arange(1, len(lengths) + 1, dtype=np.int32).repeat(lengths)
        if need:
            tokens.append(np.full(need, pad_id, np.int32))
            masks.append(np.zeros(need, np.float32))
            if segments:
                ids = np.concatenate([ids, np.zeros(need, np.int32)])
        self._advance(min(self.row_length - 1, self.available))
        return (np.concatenate(tokens, dtype=np.int32),
                np.concatenate(masks, dtype=np.float32), ids)

    def _advance(self, n):
        self.available -= n
        head = self.head + n
        self.finished = []
        while self.queue:
            slots, starts, run_tokens, _ = self.queue[0]
            if head < len(run_tokens):
                if self.track:
                    d = int(starts.searchsorted(head, "right")) - 1
                    self.finished += slots[self.done:d].tolist()
                    self.done = d
                break
            if self.track:
                self.finished += slots[self.done:].tolist()
            head -= len(run_tokens)
            self.queue.popleft()
            self.done = 0
        self.head = head


def segment_positions(segments):
    """Positions that restart at 0 where the segment id changes. segments: (b, T)."""
    T = segments.shape[-1]
    index = np.broadcast_to(np.arange(T), segments.shape)
    starts = np.concatenate(
        [np.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)
