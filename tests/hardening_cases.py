"""Bad inputs and the message each one gets. Used by tests/test_hardening.py (which asserts them) and by
`python tests/hardening_cases.py` (which prints the table in docs/reliability.md)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

os.environ.setdefault("REFUSION_DISABLE_PLUGIN_AUTOLOAD", "1")
sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_char_tokenizer, make_tiny_qwen3  # noqa: E402

from refusion.core.config import apply_overrides, build_decoder, load_config_file  # noqa: E402
from refusion.models.backend import Backbone  # noqa: E402
from refusion.models.loading import load_pretrained, save_pretrained  # noqa: E402


def _backbone(**kw) -> Backbone:
    tok = make_char_tokenizer()
    return Backbone(make_tiny_qwen3(len(tok)), tok, **kw)


def _refusion(**cfg):
    return build_decoder(_backbone(), {"decoder": "refusion", "gen_length": 16, "slot_size": 4, **cfg})


def _incomplete_folder():
    d = Path(tempfile.mkdtemp()) / "m"
    bb = _backbone()
    save_pretrained(bb.model, bb.tokenizer, d)
    (d / "model.safetensors").unlink()
    load_pretrained(d)


def _no_mask_tokenizer():
    tok = make_char_tokenizer(with_mask=False)
    Backbone(make_tiny_qwen3(len(tok)), tok)


def _nan_logits():
    bb = _backbone()

    def poison(module, args, out):
        out.logits[..., 5] = float("nan")

    bb.model.register_forward_hook(poison)
    build_decoder(bb, {"decoder": "refusion", "gen_length": 8, "slot_size": 4}).generate([5, 6])


def _bidirectional_to_causal():
    build_decoder(_backbone(attention="bidirectional"), {"decoder": "refusion"})


def _bad_file():
    p = Path(tempfile.mkdtemp()) / "c.json"
    p.write_text("{}")
    load_config_file(p)


#: (bad input, callable that must raise, exception type name, fragment of the message)
CASES: list[tuple[str, Callable[[], object], str, str]] = [
    ("empty prompt", lambda: _refusion().generate([]), "ValueError", "prompt is empty"),
    ("prompt longer than the model's maximum positions", lambda: _refusion().generate([5] * 600),
     "ValueError", "exceeds the model's maximum positions (512)"),
    ("gen_length 0", lambda: _refusion(gen_length=0), "ConfigError", "gen_length: Input should be greater than or equal to 1"),
    ("gen_length huge (10**9)", lambda: _refusion(gen_length=10**9), "ConfigError", "gen_length: Input should be less than or equal to 1000000"),
    ("gen_length beyond the model's positions", lambda: _refusion(gen_length=4096).generate([5]),
     "ValueError", "exceeds the model's maximum positions"),
    ("slot size not dividing the serial blocks", lambda: _refusion(gen_length=24, serial_blocks=4),
     "ConfigError", "serial_blocks=4 must divide the number of slots"),
    ("slot_threshold outside [0, 1]", lambda: _refusion(selector={"slot_threshold": 1.5}),
     "ConfigError", "selector.slot_threshold: Input should be less than or equal to 1"),
    ("token_threshold outside [0, 1]", lambda: _refusion(verifier={"token_threshold": -0.2}),
     "ConfigError", "verifier.token_threshold: Input should be greater than or equal to 0"),
    ("unknown plugin name", lambda: _refusion(scorer="mean_prb"), "ConfigError", "did you mean 'mean_prob'"),
    ("unknown config field", lambda: _refusion(slot_sise=4), "ConfigError", "slot_sise: unknown field"),
    ("--set without '='", lambda: apply_overrides({}, ["slot_size"]), "ConfigError", "expected key=value"),
    ("config file of an unknown format", _bad_file, "ConfigError", "allowed: .yaml, .yml, .toml"),
    ("checkpoint folder with files missing", _incomplete_folder, "CheckpointError", "missing model.safetensors"),
    ("tokenizer without a mask token", _no_mask_tokenizer, "MaskTokenError", "add_special_tokens({'mask_token'"),
    ("NaN in the logits", _nan_logits, "NonFiniteLogitsError", "produced NaN/inf logits"),
    ("a bidirectional model given to a causal decoder", _bidirectional_to_causal, "ValueError",
     "needs a model with causal attention, but this model's attention is 'bidirectional'"),
]


def message(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - we report whatever is raised
        return type(e).__name__, str(e)
    return "nothing raised", ""


if __name__ == "__main__":
    print("| bad input | error | message |\n|---|---|---|")
    for name, fn, _, _ in CASES:
        kind, msg = message(fn)
        print(f"| {name} | `{kind}` | {msg.replace('|', chr(92) + '|')} |")
