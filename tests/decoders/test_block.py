"""Block diffusion decoder on a tiny random block-causal Qwen3: masks, cache exactness, threshold, EOS, pipeline."""

import pytest
import torch
from helpers import ban_token, decode_reading_host, force_token, make_tiny_qwen3, task_prompt

from refusion.core.config import build_decoder
from refusion.core.loop import Attention
from refusion.core.masks import additive_mask, segment_allowed
from refusion.decoders.block import decoded_fraction
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.tasks import get_task

PROMPT = [10, 11, 12, 13, 14]
P, B = len(PROMPT), 4


@pytest.fixture
def blockc(char_tokenizer) -> Backbone:
    model = make_tiny_qwen3(len(char_tokenizer))
    model.config.refusion_attention = "block_causal"
    model.config.refusion_block_size = B
    return Backbone(model, char_tokenizer)


def blk(pos: torch.Tensor) -> torch.Tensor:
    return torch.where(pos < P, -1, (pos - P) // B)


def run(bb, **cfg):
    """Decode and check, at every forward, the mask the decoder built: a query sees a key iff the key's block
    is not later than its own (cached keys are the positions 0 .. cached-1)."""
    cfg = {"decoder": "block", "gen_length": 16, **cfg}
    calls = {"n": 0}

    def pre(module, args, kwargs):
        calls["n"] += 1
        mask, qpos = kwargs["attention_mask"][0, 0], kwargs["position_ids"][0]
        kpos = torch.cat([torch.arange(mask.shape[1] - len(qpos)), qpos])
        assert torch.equal(mask == 0, blk(kpos)[None, :] <= blk(qpos)[:, None])

    h = bb.model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        res = build_decoder(bb, cfg).generate(PROMPT)
    finally:
        h.remove()
    assert res.stats.nfe == calls["n"] == sum(t.forwards for t in res.trace)  # NFE = instrumented forwards
    ids = res.token_ids
    assert bb.mask_id not in ids and len(ids) <= cfg["gen_length"]
    eos = [i for i, t in enumerate(ids) if t in bb.eos_ids]
    assert not eos or eos[0] == len(ids) - 1  # nothing after the first EOS
    assert all(len(t.chosen) >= 1 for t in res.trace)  # at least one token per step
    return res


def test_mask_is_block_causal():
    seg = torch.tensor([-1, -1, 0, 0, 1, 1])
    allowed = segment_allowed(seg, seg)
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 0],  # prompt: prompt only (bidirectional)
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # block 0: prompt + itself (bidirectional), never block 1
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],  # block 1: everything before + itself
        [1, 1, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    assert Attention.block_causal(seg.tolist()).segment_ids(6) == seg.tolist()
    assert additive_mask(allowed, torch.bfloat16).dtype == torch.bfloat16


def test_decoded_fraction_is_one_minus_the_float32_mean_of_the_mask_flags():
    for size in (4, 6, 10, 32):
        for masked in range(size + 1):
            flags = torch.arange(size) < masked
            assert decoded_fraction(masked, size) == 1.0 - float(flags.float().mean())
    assert decoded_fraction(3, 10) < 0.7  # 0.3 rounds up in float32


def test_wrong_models_refused_before_any_forward(backbone, char_tokenizer):
    with pytest.raises(ValueError, match="'block' needs a model with block_causal attention"):
        build_decoder(backbone, {"decoder": "block"})
    model = make_tiny_qwen3(len(char_tokenizer))
    model.config.refusion_attention = "block_causal"
    with pytest.raises(ValueError, match="needs block_size"):
        build_decoder(Backbone(model, char_tokenizer), {"decoder": "block"})
    assert backbone.nfe == 0


def test_cache_is_exact(blockc):
    ban_token(blockc.model, blockc.eos_id)
    a, b = run(blockc), run(blockc, kv_cache=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert a.stats.nfe == b.stats.nfe == 16  # nothing above 0.9 on a random model: one token per step
    # the same scores at every step: cached prompt/blocks + block == one block-causal forward over everything
    for ta, tb in zip(a.trace, b.trace):
        assert [p for p, _ in ta.scored] == [p for p, _ in tb.scored]
        assert torch.allclose(torch.tensor([s for _, s in ta.scored]), torch.tensor([s for _, s in tb.scored]), atol=1e-5)
    # the prompt rides with block 0's first step, a finished block's KV with the next block's first step
    assert a.stats.tokens_in == (P + B) + 3 * B + 3 * (2 * B + 3 * B)
    assert a.stats.tokens_in < b.stats.tokens_in


def test_threshold_zero_decodes_a_block_per_step(blockc):
    ban_token(blockc.model, blockc.eos_id)
    res = run(blockc, selector={"name": "confidence_threshold", "threshold": 0.0})
    assert res.stats.nfe == 4 and [len(t.chosen) for t in res.trace] == [4, 4, 4, 4]


def test_confident_tokens_commit_together(blockc):
    ban_token(blockc.model, blockc.eos_id)
    hooks = [force_token(blockc.model, P + i, 20 + i) for i in (0, 2, 3)]
    res = run(blockc)
    for h in hooks:
        h.remove()
    assert res.trace[0].chosen == [P, P + 2, P + 3] and res.token_ids[:4] == [20, res.token_ids[1], 22, 23]
    assert res.stats.nfe == 2 + 3 * 4


@pytest.mark.parametrize("eos_at", [0, 6, 13])
def test_eos_stops_and_nothing_follows(blockc, eos_at):
    ban_token(blockc.model, blockc.eos_id)  # the random model would say EOS somewhere itself
    h = force_token(blockc.model, P + eos_at, blockc.eos_id, boost=3e4)
    try:
        res = run(blockc)
    finally:
        h.remove()
    assert len(res.token_ids) == eos_at + 1 and res.token_ids[-1] == blockc.eos_id
    assert max(t.block for t in res.trace) == eos_at // B  # no later block is decoded


def test_gen_length_not_multiple_of_block(blockc):
    ban_token(blockc.model, blockc.eos_id)
    res = run(blockc, gen_length=10, selector={"name": "confidence_threshold", "threshold": 0.0})
    assert len(res.token_ids) == 10 and res.stats.nfe == 3


def test_sub_blocks_left_to_right(blockc):
    ban_token(blockc.model, blockc.eos_id)
    res = run(blockc, gen_length=8, sub_block_size=2)
    order = [p for t in res.trace for p in t.chosen]
    for b in range(2):
        first = order[4 * b : 4 * b + 2]
        assert sorted(first) == [P + 4 * b, P + 4 * b + 1]


@pytest.mark.parametrize("kv_cache", [True, False])
def test_pipeline_drafts_next_block_early(blockc, kv_cache):
    ban_token(blockc.model, blockc.eos_id)
    hooks = [force_token(blockc.model, P + B + i, 30 + i) for i in (0, 1)]  # two confident tokens in block 1
    try:
        plain = run(blockc, kv_cache=kv_cache)
        piped = run(blockc, kv_cache=kv_cache, pipeline=True, pipeline_threshold=0.25)
    finally:
        for h in hooks:
            h.remove()
    # block 1 starts after block 0's first step; its two confident tokens commit alongside block 0's
    assert piped.trace[1].chosen[1:] == [P + B, P + B + 1] and piped.trace[1].block == 0
    assert plain.stats.nfe == 15 and piped.stats.nfe == 14
    assert piped.token_ids[4:6] == [30, 31] and len(piped.token_ids) == 16


def test_pipeline_needs_token_selector(blockc):
    with pytest.raises(ValueError, match="pipeline needs a token selector"):
        build_decoder(blockc, {"decoder": "block", "pipeline": True, "selector": "threshold"})


READ_VARIANTS = {
    "threshold": {},
    "no cache, threshold 0.2": {"kv_cache": False, "selector": {"name": "confidence_threshold", "threshold": 0.2}},
    "pipeline": {"pipeline": True, "pipeline_threshold": 0.25, "confident": True},
    "pipeline, sub-blocks, sampled": {"pipeline": True, "pipeline_threshold": 0.5, "sub_block_size": 2,
                                      "drafter": {"temperature": 1.0}},
    "topk k 2": {"selector": {"name": "topk_per_step", "k": 2}, "gen_length": 10},
    "slot selector": {"selector": {"name": "threshold", "slot_threshold": 0.5}},
    "eos stop": {"eos_at": 6},
}


@pytest.mark.parametrize("variant", list(READ_VARIANTS))
def test_reads_the_host_once_per_step_and_nowhere_else(blockc, variant):
    cfg = {"decoder": "block", "gen_length": 16, **READ_VARIANTS[variant]}
    eos_at, confident = cfg.pop("eos_at", None), cfg.pop("confident", False)
    hooks = [ban_token(blockc.model, blockc.eos_id)]  # the random model would say EOS somewhere itself
    if eos_at is not None:
        hooks.append(force_token(blockc.model, P + eos_at, blockc.eos_id, boost=3e4))
    if confident:  # two confident tokens in block 1: the pipeline commits them alongside block 0's
        hooks += [force_token(blockc.model, P + B + i, 30 + i) for i in (0, 1)]
    try:
        res, reads, tolist_calls, stray = decode_reading_host(blockc, cfg, PROMPT)
    finally:
        for h in hooks:
            h.remove()
    assert stray == []  # no .item() / .tolist() / int() / bool() / .nonzero() / mask indexing outside to_host
    assert reads == len(res.trace) + 1 == res.stats.nfe + 1  # one per step + the decode's finiteness check
    assert tolist_calls == reads
    assert len(res.token_ids) == (eos_at + 1 if eos_at is not None else cfg["gen_length"])
    if confident:
        assert any(len({(p - P) // B for p in t.chosen}) > 1 for t in res.trace)  # a step committed in two blocks


@pytest.mark.parametrize("pipeline", [False, True])
def test_bench_settings_read_the_host_once_per_step(pipeline):
    """The shipped tiny-block at the bench settings: several tokens per step, a stop at the EOS."""
    bb = Backbone.from_pretrained("tiny-block")
    task = get_task("arith")
    cfg = {**load_bench_config().decoder_config("arith", "block", task.max_new_tokens), "pipeline": pipeline}
    prompt = task_prompt(bb.tokenizer, "arith")
    res, reads, tolist_calls, stray = decode_reading_host(bb, cfg, prompt)
    assert stray == [] and reads == tolist_calls == len(res.trace) + 1
    assert len(res.trace) < len(res.token_ids) < task.max_new_tokens and res.token_ids[-1] in bb.eos_ids
