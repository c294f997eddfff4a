"""Pack one stream of documents into rows of seq_length + 1 tokens.

Rows overlap by one token: a row holds tokens [s, s+T] of the stream and the next row
starts at s+T, so every token after the first is a target exactly once:
  input_tokens = row[:-1], target_tokens = row[1:], loss_masks = masks[1:].
A document longer than a row continues in the next row; none is dropped or cut short.
With segment ids, each document piece in a row gets its own id (1, 2, ...; 0 is
padding) and positions restart at 0 for each piece, so attention can stay inside a
document.

The stream's exact position is (slot, offset): the next row starts at token `offset`
of the document in `slot`. Documents without tokens never enter the queue. After a row,
`row_slots` are the slots of its segments 1, 2, ... and `finished` the slots of the
documents it completed (what a mixture counts per source).
"""

import collections

import numpy as np


class Stream:
    """Documents of one row of the batch: slots r, r+B, r+2B, ... in order."""

    def __init__(self, seq_length, slot, offset=0):
        self.row_length = seq_length + 1
        self.next_slot = slot        # the next slot to read into the queue
        self.offset = offset         # into the queue's first document
        self.queue = collections.deque()   # (slot, tokens, masks)
        self.available = 0           # tokens from the current position to the queue's end
        self.last_usable = slot      # the last slot that had tokens (to detect starvation)
        self.ended = None            # why no documents follow (a mixture source ran dry)
        self.row_slots, self.finished = [], []

    def push(self, slot, tokens, masks):
        if slot < self.next_slot or self.ended:   # read again: a window started earlier
            return
        self.next_slot = slot + 1    # the loader moves it on to the stream's next slot
        if len(tokens):
            self.last_usable = slot
            skip = self.offset if not self.queue and self.offset else 0
            self.queue.append((slot, tokens, masks))
            self.available += len(tokens) - skip

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
        if self.queue:
            return self.queue[0][0], self.offset
        return self.next_slot, self.offset

    def has_row(self):
        return self.available >= self.row_length

    def is_done(self):
        """For a finite pass: whether any target is left (a lone token has none)."""
        return self.available <= 1

    def next_row(self, pad_id=0):
        """tokens (T+1,), masks (T+1,), segments (T+1,); short rows are padded with
        pad_id, mask 0 and segment 0 (only at the end of a finite pass)."""
        tokens = np.full(self.row_length, pad_id, np.int32)
        masks = np.zeros(self.row_length, np.float32)
        segments = np.zeros(self.row_length, np.int32)
        filled, offset = 0, self.offset
        self.row_slots, self.finished = [], []
        for segment, (slot, doc_tokens, doc_masks) in enumerate(self.queue, 1):
            self.row_slots.append(slot)
            n = min(len(doc_tokens) - offset, self.row_length - filled)
            tokens[filled:filled + n] = doc_tokens[offset:offset + n]
            masks[filled:filled + n] = doc_masks[offset:offset + n]
            segments[filled:filled + n] = segment
            filled, offset = filled + n, 0
            if filled == self.row_length:
                break
        self._advance(min(self.row_length - 1, self.available))
        return tokens, masks, segments

    def _advance(self, n):
        self.available -= n
        n += self.offset
        while self.queue and n >= len(self.queue[0][1]):
            slot, tokens, _ = self.queue.popleft()
            self.finished.append(slot)
            n -= len(tokens)
        self.offset = n


def segment_positions(segments):
    """Positions that restart at 0 where the segment id changes. segments: (b, T)."""
    T = segments.shape[-1]
    index = np.broadcast_to(np.arange(T), segments.shape)
    starts = np.concatenate(
        [np.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return (index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)).astype(np.int32)
