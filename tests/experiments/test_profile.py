"""`refusion profile` on the shipped tiny models, and the widened-vocabulary stand-in."""

import json

import pytest
import torch

from refusion.cli import main
from refusion.models.tokenizer import encode_prompt
from refusion.core.config import build_decoder
from refusion.experiments.profile import COLUMNS
from refusion.models.backend import Backbone
from refusion.models.build import widen_vocabulary
from refusion.models.loading import load_pretrained
from refusion.tasks import get_task


@pytest.fixture(autouse=True)
def short_arith(monkeypatch):
    monkeypatch.setattr(type(get_task("arith")), "max_new_tokens", 16)


def test_profile_writes_rows(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["profile", "--tasks", "arith", "--decoders", "ar", "--limit", "1", "--out", str(out), "--json"]) == 0
    rows = json.loads((out / "profile.json").read_text())
    assert json.loads(capsys.readouterr().out) == rows
    (row,) = rows
    for key, _ in COLUMNS:
        assert key in row
    assert (row["decoder"], row["task"], row["n"], row["vocab_size"]) == ("ar", "arith", 1, 1024)
    assert row["forwards"] == row["iterations"] == row["logits_rows"] == row["generated_tokens"] > 0
    assert row["logits_rows_per_forward"] == 1.0  # AR reads one row per forward
    assert 0 < row["forward_s"] <= row["wall_s"]
    assert row["outside_forward_share"] == pytest.approx(1 - row["forward_s"] / row["wall_s"])
    assert row["host_syncs_per_iteration"] > 0 and row["tokens_per_second"] > 0
    assert row["identical_to_original"] is None
    assert (out / "profile.md").read_text().startswith("| decoder | task |")


def test_widened_stand_in(tmp_path):
    path = widen_vocabulary("tiny-ar", tmp_path / "wide", vocab_size=4096)
    wide, tok = load_pretrained(path)
    orig, _ = load_pretrained("tiny-ar")
    assert wide.config.vocab_size == 4096 and wide.config.refusion_base_vocab_size == 1024
    assert wide.config.refusion_attention == orig.config.refusion_attention
    emb, head = wide.get_input_embeddings().weight, wide.get_output_embeddings().weight
    assert emb.shape == head.shape == (4096, orig.config.hidden_size)
    assert not emb[1024:].any() and not head[1024:].any()
    assert torch.equal(emb[:1024], orig.get_input_embeddings().weight)

    prompt = encode_prompt(tok, get_task("arith").examples("test", 1)[0].query)
    ids = [build_decoder(Backbone.from_pretrained(m), {"decoder": "ar", "gen_length": 16}).generate(prompt).token_ids
           for m in ("tiny-ar", str(path))]
    assert ids[0] == ids[1]


def test_profile_stand_in(tmp_path):
    out = tmp_path / "p"
    argv = ["profile", "--tasks", "arith", "--decoders", "ar", "--limit", "1", "--vocab", "4096", "--out", str(out)]
    assert main(argv) == 0
    (row,) = json.loads((out / "profile.json").read_text())
    assert (row["vocab_size"], row["identical_to_original"]) == (4096, 1)


@pytest.mark.parametrize("args, option", [
    (["--decoders", "nope"], "--decoders"), (["--vocab", "100"], "--vocab"), (["--tasks", "nope"], "--tasks"),
])
def test_bad_options(tmp_path, capsys, args, option):
    argv = ["profile", "--tasks", "arith", "--decoders", "ar", "--limit", "1", "--out", str(tmp_path), *args]
    assert main(argv) == 2
    assert option in capsys.readouterr().err
