"""FinalText: the streamed text is the decode's text, cut before the first stop string, whatever the
commits' boundaries; partial characters and possible stop-string beginnings wait for the next commit."""

from __future__ import annotations

import pytest

from refusion.models.backend import Backbone
from refusion.serve.text import FinalText


@pytest.fixture(scope="module")
def tokenizer():
    return Backbone.from_pretrained("tiny-ar").tokenizer


def stream(tokenizer, ids, stop, sizes):
    text, pieces, at = FinalText(tokenizer, stop), [], 0
    for n in sizes:
        pieces.append(text.add(ids[at: at + n]))
        at += n
        if text.stopped:
            return pieces, text
    pieces.append(text.finish())
    return pieces, text


@pytest.mark.parametrize("sizes", [[1] * 40, [3] * 14, [40]])
def test_the_pieces_are_the_text_cut_at_the_first_stop_string(tokenizer, sizes):
    full = "Total: 12 apples. Done: yes.\n"
    ids = tokenizer.encode(full, add_special_tokens=False) + [tokenizer.eos_token_id]
    pieces, text = stream(tokenizer, ids, [". D", "yes"], sizes)
    assert "".join(pieces) == "Total: 12 apples" and text.stopped
    pieces, text = stream(tokenizer, ids, [], sizes)
    assert "".join(pieces) == full and not text.stopped


def test_a_possible_stop_string_and_a_partial_character_wait(tokenizer):
    ids = tokenizer.encode("ab\u00e9x", add_special_tokens=False)
    text = FinalText(tokenizer, ["xz"])
    sent = [text.add([t]) for t in ids]
    assert "\ufffd" not in "".join(sent)  # a half-decoded character never goes out
    assert "".join(sent) == "ab\u00e9"  # "x" may start "xz": held back
    assert text.finish() == "x"
