"""Host reads of the ReFusion and AR loops: exactly the documented ones, and nothing else converts a
tensor to a Python value outside the model (each such conversion is a synchronisation on a GPU)."""

from __future__ import annotations

import pytest
from helpers import StrayReads, decode_reading_host, task_prompt

from refusion.core import host
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.tasks import get_task

REFERENCE = {"decoder": "refusion", "slot_size": 8, "selector": {"name": "threshold", "slot_threshold": 0.9},
             "verifier": {"name": "prefix", "token_threshold": 0.4}}
VARIANTS = {
    "reference": {},
    "fused + window": {"fused": True, "draft_window": 3},
    "split + sub_slot": {"split_threshold": 0.6, "remasker": {"name": "sub_slot", "threshold": 0.5},
                         "verifier": {"name": "prefix", "token_threshold": 0.999}},
    "kv_recompute": {"cache": "kv_recompute", "selector": {"name": "threshold", "slot_threshold": 0.3}},
}


@pytest.fixture(scope="module")
def tiny_refusion() -> Backbone:
    return Backbone.from_pretrained("tiny-refusion")


def prompt(backbone: Backbone, task: str = "arith") -> list[int]:
    return task_prompt(backbone.tokenizer, task)


def expected_reads(config: dict, trace) -> int:
    """2 per iteration (after selection, after II-a) + 1 per II-b round + 1 per decode (finiteness);
    adaptive slots: +1 per iteration; the sub_slot remasker: +1 per II-b iteration."""
    reads = 1 + sum(2 + it.rounds for it in trace)
    if config.get("split_threshold") is not None:
        reads += len(trace)
    if isinstance(config.get("remasker"), dict) and config["remasker"]["name"] == "sub_slot":
        reads += sum(it.stage == "II-b" for it in trace)
    return reads


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_refusion_reads_the_host_only_where_documented(tiny_refusion, variant):
    config = {**REFERENCE, "gen_length": 96, **VARIANTS[variant]}
    result, reads, tolist_calls, stray = decode_reading_host(tiny_refusion, config, prompt(tiny_refusion))
    assert stray == [] and tolist_calls == reads
    assert reads == expected_reads(config, result.trace)
    assert any(it.stage == "II-b" for it in result.trace) or variant == "fused + window"


@pytest.mark.parametrize("task", ["arith", "code", "facts"])
def test_refusion_bench_settings_read_the_host_only_where_documented(tiny_refusion, task):
    config = load_bench_config().decoder_config(task, "refusion", get_task(task).max_new_tokens)
    result, reads, tolist_calls, stray = decode_reading_host(tiny_refusion, config, prompt(tiny_refusion, task))
    assert stray == [] and tolist_calls == reads
    assert reads == expected_reads(config, result.trace)


def test_ar_reads_one_token_per_step(tiny_refusion):
    result, reads, tolist_calls, stray = decode_reading_host(
        tiny_refusion, {"decoder": "ar", "gen_length": 40}, prompt(tiny_refusion))
    assert stray == [] and tolist_calls == reads
    assert reads == len(result.token_ids) + 1


def test_stray_reads_are_caught(tiny_refusion):
    """The detector itself: a conversion outside the model is reported, one inside to_host is not."""
    import torch

    with StrayReads(tiny_refusion.model) as stray:
        host.to_host(torch.ones(2))
        int(torch.tensor(3))
    assert len(stray.where) == 1 and "__int__" in stray.where[0]
