"""Checks that need a CUDA device (``pytest -m gpu``; skipped elsewhere). Run them all with
``scripts/gpu_check.sh``."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import task_prompt

from refusion.core import host
from refusion.core.config import build_decoder
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.tasks import get_task

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DECODERS = ["ar", "refusion", "llada", "block"]
TASKS = ["arith", "code", "facts"]


def prompts(backbone: Backbone, task: str, n: int) -> list[list[int]]:
    return [task_prompt(backbone.tokenizer, task, i) for i in range(n)]


def decoder(name: str, task: str, device: str, dtype: str):
    bench = load_bench_config()
    backbone = Backbone.from_pretrained(bench.models[name], device=device, dtype=dtype)
    return build_decoder(backbone, bench.decoder_config(task, name, get_task(task).max_new_tokens))


@pytest.mark.parametrize("name", DECODERS)
def test_cpu_and_cuda_decode_the_same_tokens_in_float32(name):
    for task in TASKS:
        cpu, cuda = decoder(name, task, "cpu", "float32"), decoder(name, task, "cuda", "float32")
        for ids in prompts(cpu.backbone, task, 3):
            assert cpu.generate(ids).token_ids == cuda.generate(ids).token_ids, (name, task, ids)


@pytest.mark.parametrize("name", DECODERS)
def test_bfloat16_decodes(name):
    dec = decoder(name, "arith", "cuda", "bfloat16")
    assert dec.backbone.model.dtype == torch.bfloat16
    result = dec.generate(prompts(dec.backbone, "arith", 1)[0])
    assert result.token_ids and result.stats.nfe > 0


@pytest.mark.parametrize("name", DECODERS)
def test_no_synchronisation_beyond_the_documented_host_reads(name):
    for task in TASKS:
        dec = decoder(name, task, "cuda", "float32")
        ids = prompts(dec.backbone, task, 1)[0]
        dec.generate(ids)  # warm-up: one-off allocations and lazy initialisation
        host.reset()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                dec.generate(ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == host.count, (name, task, host.count, syncs[:5])
