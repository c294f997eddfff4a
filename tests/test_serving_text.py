"""TextStream: incremental detokenization."""

from serving_utils import tokenizer  # noqa: F401 (a fixture)

from easylm.serving.text import TextStream


def test_text_stream_matches_whole_decode_and_holds_back_stop_prefixes(tokenizer):
    text = "Héllo wörld 🙂 and ünïcödé."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer)
    pieces = []
    for token in ids:
        assert not stream.add(token)
        pieces.append(stream.take())
        assert "\ufffd" not in pieces[-1]  # half a character is never handed out
    stream.finish()
    pieces.append(stream.take(final=True))
    assert "".join(pieces) == text
    stream = TextStream(tokenizer, stop=["wör"])
    taken = ""
    for token in ids:
        stopped = stream.add(token)
        taken += stream.take()
        assert "w" not in taken  # a possible start of the stop string is held back
        if stopped:
            break
    assert stopped and taken + stream.take(final=True) == "Héllo "
