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


@pytest.mark.parametrize("variant", ["reference", "bench arith", "fused + window", "kv_recompute"])
def test_a_refusion_batch_reads_the_host_once_per_read_point_of_all_its_sequences(tiny_refusion, variant):
    """A batch's loops wait on the device together: their reads at one point are one to_host, so the batch
    reads at most what its sequences read alone, at least what the longest one does, and nothing else."""
    if variant == "bench arith":
        config = load_bench_config().decoder_config("arith", "refusion", get_task("arith").max_new_tokens)
    else:
        config = {**REFERENCE, "gen_length": 96, **VARIANTS[variant]}
    prompts = [task_prompt(tiny_refusion.tokenizer, task, i) for task in ("arith", "facts") for i in range(2)]
    results, reads, tolist_calls, stray = decode_reading_host(tiny_refusion, config, prompts)
    assert stray == [] and tolist_calls == reads
    alone = [expected_reads(config, r.trace) for r in results]
    assert max(alone) <= reads < sum(alone) - (len(alone) - 1)  # shared: fewer than separate decodes


def test_an_ar_batch_reads_one_token_per_step_of_the_batch(tiny_refusion):
    prompts = [task_prompt(tiny_refusion.tokenizer, task) for task in ("arith", "code", "facts")]
    results, reads, tolist_calls, stray = decode_reading_host(tiny_refusion, {"decoder": "ar", "gen_length": 40}, prompts)
    assert stray == [] and tolist_calls == reads
    assert reads == max(len(r.token_ids) for r in results) + 1


def test_stray_reads_are_caught(tiny_refusion):
    """The detector itself: a conversion outside the model is reported, one inside to_host is not."""
    import torch

    with StrayReads(tiny_refusion.model) as stray:
        host.to_host(torch.ones(2))
        int(torch.tensor(3))
    assert len(stray.where) == 1 and "__int__" in stray.where[0]


@pytest.mark.parametrize("row", ["spec-ngram", "spec-draft", "spec-diffusion"])
def test_speculative_reads_the_host_once_per_verification(row):
    """Speculative decoding: one host read per verification (the target's tokens and the drafts together)
    + 1 per decode; the drafters keep their tokens on the device; alone and batched."""
    bb = Backbone.from_pretrained("tiny-ar")
    config = load_bench_config().decoder_config("arith", row, 48)
    result, reads, tolist_calls, stray = decode_reading_host(bb, config, prompt(bb))
    assert stray == [] and tolist_calls == reads
    assert reads == 1 + result.stats.extra["verifications"] == 1 + len(result.trace)
    prompts = [prompt(bb, task) for task in ("arith", "code", "facts")]
    batch, reads, _, stray = decode_reading_host(bb, config, prompts)
    assert stray == [] and reads <= 1 + sum(r.stats.extra["verifications"] for r in batch)
