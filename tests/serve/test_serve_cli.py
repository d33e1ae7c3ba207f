"""The serve and loadtest commands refuse bad flags before loading a model or sending a request."""

from __future__ import annotations

import pytest

from refusion.cli import main


@pytest.mark.parametrize("args,field", [
    (["serve", "--bench-row", "nope", "--task", "arith"], "--bench-row"),
    (["serve", "--task", "arith"], "--bench-row"),
    (["serve", "--bench-row", "ar", "--task", "nope"], "--task"),
    (["serve"], "--model"),
    (["serve", "--model", "tiny-ar"], "--decoder"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--max-batch", "0"], "--max-batch"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--set", "slot_size=4"], "slot_size"),
    (["serve", "--model", "tiny-ar", "--decoder", "ar", "--api-key-file", "/nonexistent/key"], "--api-key-file"),
    (["loadtest", "--url", "http://192.0.2.1:8000"], "loopback"),
    (["loadtest", "--url", "ftp://127.0.0.1:8000"], "--url"),
])
def test_bad_flags_are_refused_naming_them(args, field, capsys):
    assert main(args) == 2
    assert field in capsys.readouterr().err


def test_a_decoder_whose_batch_is_its_own_is_refused():
    from refusion.core.config import ConfigError
    from refusion.models.backend import Backbone
    from refusion.serve.options import DecoderPool

    with pytest.raises(ConfigError, match="'speculative' cannot be served"):
        DecoderPool(Backbone.from_pretrained("tiny-ar"), {"decoder": "speculative", "k": 2})
