"""Packing one stream: overlapping rows, long documents, segments, padding, positions."""

import numpy as np

from easylm.data.packing import Stream, segment_positions


def docs(*lengths, start=100):
    """Documents with distinct token values; masks 1 except each document's first token."""
    out, value = [], start
    for n in lengths:
        tokens = np.arange(value, value + n, dtype=np.int32)
        masks = np.ones(n, np.float32)
        masks[0] = 0.0
        out.append((tokens, masks))
        value += n
    return out


def fill(stream, documents, B=1, first_slot=0):
    for i, (tokens, masks) in enumerate(documents):
        stream.push(first_slot + i * B, tokens, masks)


def test_rows_overlap_by_one_and_every_token_is_a_target_once():
    T = 8
    documents = docs(5, 3, 20, 1, 7)   # one longer than a row: split, not dropped
    stream = Stream(T, slot=0)
    fill(stream, documents)
    all_tokens = np.concatenate([t for t, _ in documents])
    targets = []
    while stream.has_row():
        tokens, masks, _ = stream.next_row()
        assert len(tokens) == T + 1
        targets.append(tokens[1:])
    targets = np.concatenate(targets)
    assert np.array_equal(targets, all_tokens[1:len(targets) + 1])
    assert len(all_tokens) - 1 - len(targets) < T   # only a partial row is left


def test_segments_and_positions_follow_documents():
    stream = Stream(6, slot=0)
    fill(stream, docs(3, 2, 9))
    tokens, masks, segments = stream.next_row()
    assert tokens.tolist() == [100, 101, 102, 103, 104, 105, 106]
    assert segments.tolist() == [1, 1, 1, 2, 2, 3, 3]
    assert masks.tolist() == [0, 1, 1, 0, 1, 0, 1]
    assert segment_positions(segments[None, :-1]).tolist() == [[0, 1, 2, 0, 1, 0]]
    _, _, segments = stream.next_row()   # the third document continues: one segment
    assert segments.tolist() == [1] * 7


def test_final_row_is_padded_with_no_loss():
    stream = Stream(6, slot=0)
    fill(stream, docs(4))
    assert not stream.has_row() and not stream.is_done()
    tokens, masks, segments = stream.next_row(pad_id=0)
    assert tokens.tolist() == [100, 101, 102, 103, 0, 0, 0]
    assert masks.tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert segments.tolist() == [1, 1, 1, 1, 0, 0, 0]
    assert stream.is_done()


def test_position_resumes_exactly():
    B, T = 4, 5
    documents = docs(3, 11, 2, 6, 9, 4)
    stream = Stream(T, slot=2)
    fill(stream, documents, B=B, first_slot=2)
    stream.next_row()
    stream.next_row()
    slot, offset = stream.position()
    assert (slot, offset) == (6, 7)     # 10 tokens consumed: 3 of slot 2, 7 of slot 6
    expected = [stream.next_row() for _ in range(3)]

    resumed = Stream(T, slot, offset)
    index = (slot - 2) // B
    fill(resumed, documents[index:], B=B, first_slot=slot)
    for want in expected:
        for a, b in zip(want, resumed.next_row()):
            assert np.array_equal(a, b)


def test_documents_below_the_position_and_empty_documents_are_ignored():
    stream = Stream(3, slot=8)
    stream.push(4, *docs(5)[0])                 # before the resume point
    stream.push(8, np.zeros(0, np.int32), np.zeros(0, np.float32))
    stream.push(12, *docs(4, start=7)[0])
    assert stream.position() == (12, 0)
    assert stream.next_row()[0].tolist() == [7, 8, 9, 10]
