"""``--compile aot``: every kind of call the decoders make is exported as a function of tensors and run
compiled, none falling back unseen, with the same logits and token ids as eager. The fast tests run the
exported programs themselves (``torch.export``'s module: seconds, no C++ build); the ``slow`` one builds
the AOTInductor packages."""

import logging

import pytest
import torch

from refusion.core.config import build_decoder
from refusion.models import aot
from refusion.models.aot import CallKind, package_key
from refusion.models.backend import Backbone
from refusion.models.ragged_forward import install_row_head
from refusion.models.loading import RuntimeOptionError, Runtime, cpp_compiler
from refusion.testing.models import make_tiny_qwen3
from helpers import decode_eager_and_compiled

CASES = [  # (model attention, decoder config)
    ("causal", {"decoder": "ar"}),
    ("causal", {"decoder": "refusion", "slot_size": 4}),
    ("bidirectional", {"decoder": "llada", "block_length": 8, "kv_cache": "dual"}),
    ("bidirectional", {"decoder": "llada", "block_length": 8}),
    ("block_causal", {"decoder": "block"}),
]


def _exported_only(model, kind):
    """A kind's exported program run as a module (what AOTInductor would compile), its buffers' in-place
    writes applied to the inputs."""
    return aot.export(model, kind)[1].module()


@pytest.fixture
def export_only(monkeypatch):
    monkeypatch.setattr(aot, "aoti_runner", _exported_only)


def _decode_both(char_tokenizer, attention, config):
    return decode_eager_and_compiled(char_tokenizer, attention, config, "aot")


@pytest.mark.parametrize("attention, config", CASES, ids=[f"{c['decoder']}-{a}" for a, c in CASES])
def test_every_call_of_every_decoder_runs_exported_with_eagers_tokens(char_tokenizer, export_only, attention, config):
    compiled = _decode_both(char_tokenizer, attention, config)
    # no call went to torch.compile's path: every one ran through an exported kind
    assert compiled.aot.fallbacks == {}
    assert sum(compiled.aot.calls.values()) == compiled.nfe
    caches = {k.split("-")[0] for k in compiled.aot.calls}  # alone a sequence's own cache, in a batch the ragged one
    assert caches & {"ragged", "ragged_take"} and caches & ({"dense", "dense_new"} if "kv_cache" in config or
                                                          config["decoder"] != "llada" else {"none"})
    if config["decoder"] == "refusion":  # its batch reads each row's own columns: the head's rows are an input
        assert any(k.endswith("head_rows") for k in compiled.aot.calls), compiled.aot.calls


def test_a_kind_that_fails_to_compile_falls_back_once_and_says_so(char_tokenizer, monkeypatch, caplog):
    def compile_kind(model, kind):
        if kind.cache == "dense":
            raise RuntimeError("no export today")
        return _exported_only(model, kind)

    monkeypatch.setattr(aot, "aoti_runner", compile_kind)
    model = make_tiny_qwen3(len(char_tokenizer))
    compiled = Backbone(model, char_tokenizer, compile="aot")
    fell_back: list[dict] = []
    compiled.aot.fallback = lambda **kw: fell_back.append(kw) or model(**kw)  # the eager model stands in for dynamo
    eager = Backbone(model, char_tokenizer)
    with caplog.at_level(logging.WARNING, logger="refusion.models.aot"):
        got = build_decoder(compiled, {"decoder": "ar", "gen_length": 6}).generate([5, 6, 7]).token_ids
    assert got == build_decoder(eager, {"decoder": "ar", "gen_length": 6}).generate([5, 6, 7]).token_ids
    assert list(compiled.aot.fallbacks) == ["dense-mask_none"] and "no export today" in compiled.aot.fallbacks["dense-mask_none"]
    assert len(fell_back) == 5  # AR's steps after the prefill, each through the fallback
    assert [r.getMessage() for r in caplog.records].count(
        "--compile aot: calls of kind dense-mask_none run through torch.compile instead (RuntimeError: no export today)") == 1


def test_export_keeps_every_varying_size_symbolic(char_tokenizer):
    model = make_tiny_qwen3(len(char_tokenizer))
    install_row_head(model)
    _, ep = aot.export(model, CallKind("ragged_take", "4d", True))  # the kind with the most inputs
    aot.check_symbolic(ep, aot.example_inputs(model, CallKind("ragged_take", "4d", True))[1])
    with pytest.raises(RuntimeError, match="dimension 1 a constant"):  # a size marked dynamic but fixed is refused
        aot.check_symbolic(ep, ({0: None, 1: None}, {0: None, 1: None}, {0: None}, {0: None, 2: None, 3: None},
                                {0: None}, {0: None, 1: None}, {0: None, 1: None}, {0: None}, {0: None, 1: None}))


def test_packages_are_keyed_by_shapes_dtype_and_kind(char_tokenizer):
    a, b = make_tiny_qwen3(len(char_tokenizer), seed=0), make_tiny_qwen3(len(char_tokenizer), seed=1)
    kind = CallKind("dense", "none", False)
    assert package_key(a, kind) == package_key(b, kind)  # other weights, the same package: weights are loaded into it
    assert package_key(a, kind) != package_key(a, CallKind("dense", "4d", False))
    half = make_tiny_qwen3(len(char_tokenizer), seed=0).to(torch.bfloat16)
    assert package_key(half, kind) != package_key(a, kind)
    wider = make_tiny_qwen3(len(char_tokenizer) + 8, seed=0)
    assert package_key(wider, kind) != package_key(a, kind)
    b.config._name_or_path = "/another/folder"  # where a model was loaded from is not part of its shapes
    assert package_key(b, kind) == package_key(a, kind)


def test_aot_is_a_checked_compile_mode():
    assert Runtime.resolve(compile="aot").compile == "aot"
    with pytest.raises(RuntimeOptionError, match=r"^--compile aot: the ahead-of-time compiled forward runs a model on one "
                                                 r"device, not spread by --device-map; allowed with --device-map: default, "):
        Runtime.resolve(compile="aot", device_map="cpu")


@pytest.mark.parametrize("attention, config", CASES, ids=[f"{c['decoder']}-{a}" for a, c in CASES])
@pytest.mark.slow  # minutes: AOTInductor builds a C++ package per kind of call
@pytest.mark.skipif(cpp_compiler() is None, reason="AOTInductor on the CPU needs a C++ compiler")
def test_aot_packages_decode_the_same_tokens(char_tokenizer, attention, config, tmp_path, monkeypatch):
    monkeypatch.setenv("REFUSION_AOT_CACHE", str(tmp_path))
    compiled = _decode_both(char_tokenizer, attention, config)
    assert compiled.aot.fallbacks == {} and sum(compiled.aot.calls.values()) == compiled.nfe
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("*.pt2")) == sorted(k.split("-")[0] for k in compiled.aot.calls)
