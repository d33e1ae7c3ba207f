"""LLaDA / Fast-dLLM v1 decoder on a tiny random bidirectional Qwen3: schedule, caches, parallel rules, EOS."""

import pytest
import torch
from helpers import ban_token, decode_reading_host, force_token, make_tiny_qwen3, task_prompt

from refusion.core.config import ConfigError, build_decoder, validate_config
from refusion.decoders.llada import num_transfer_tokens
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.tasks import get_task

PROMPT = [10, 11, 12, 13, 14]


@pytest.fixture
def bidi(char_tokenizer) -> Backbone:
    model = make_tiny_qwen3(len(char_tokenizer))
    model.config.refusion_attention = "bidirectional"
    return Backbone(model, char_tokenizer)


def count_forwards(model):
    calls = {"n": 0}

    def pre(module, args, kwargs):
        calls["n"] += 1

    return calls, model.register_forward_pre_hook(pre, with_kwargs=True)


def run(bb, **cfg):
    cfg = {"decoder": "llada", "gen_length": 16, "block_length": 8, **cfg}
    calls, h = count_forwards(bb.model)
    try:
        res = build_decoder(bb, cfg).generate(PROMPT)
    finally:
        h.remove()
    assert res.stats.nfe == calls["n"] == sum(t.forwards for t in res.trace)  # NFE = instrumented forwards
    check_invariants(res, bb, cfg["gen_length"])
    return res


def check_invariants(res, bb, gen_length):
    ids = res.token_ids
    assert bb.mask_id not in ids
    assert len(ids) <= gen_length
    eos = [i for i, t in enumerate(ids) if t in bb.eos_ids]
    assert not eos or eos[0] == len(ids) - 1  # nothing after the first EOS
    assert all(t.tokens >= 1 for t in res.trace)  # every step commits at least one token
    assert res.buffer_ids == PROMPT + ids and res.buffer_pos == list(range(len(PROMPT) + len(ids)))


def test_causal_model_refused_before_any_forward(backbone):
    calls, h = count_forwards(backbone.model)
    with pytest.raises(ValueError, match="'llada' needs a model with bidirectional attention.*'causal'"):
        build_decoder(backbone, {"decoder": "llada"})
    h.remove()
    assert calls["n"] == 0 and backbone.nfe == 0


def test_num_transfer_tokens_is_llada_schedule():
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert num_transfer_tokens(8, 8) == [1] * 8
    assert num_transfer_tokens(8, 3) == [3, 3, 2]


@pytest.mark.parametrize("kv_cache", ["none", "prefix", "dual"])
def test_fixed_schedule_nfe_equals_steps(bidi, kv_cache):
    ban_token(bidi.model, bidi.eos_id)
    res = run(bidi, steps=6, kv_cache=kv_cache)
    assert res.stats.nfe == 6 and len(res.token_ids) == 16
    assert [t.tokens for t in res.trace] == [3, 3, 2, 3, 3, 2]  # per block: 8 tokens over 3 steps
    assert [t.block for t in res.trace] == [0, 0, 0, 1, 1, 1]


def test_defaults_one_token_per_step_single_block(bidi):
    ban_token(bidi.model, bidi.eos_id)
    res = run(bidi, gen_length=8, block_length=None)
    assert res.stats.nfe == 8 and all(t.tokens == 1 for t in res.trace)


@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
def test_cache_refreshed_every_step_equals_no_cache(bidi, kv_cache):
    ban_token(bidi.model, bidi.eos_id)
    ref = run(bidi, steps=8)
    res = run(bidi, steps=8, kv_cache=kv_cache, refresh_every=1)
    assert res.token_ids == ref.token_ids
    assert [t.scored for t in res.trace] == [t.scored for t in ref.trace]


def test_cached_steps_feed_fewer_tokens_and_block_start_is_exact(bidi):
    ban_token(bidi.model, bidi.eos_id)
    runs = {m: run(bidi, steps=8, kv_cache=m) for m in ("none", "prefix", "dual")}
    N = len(PROMPT) + 16
    # per block: 1 full forward, then 3 steps of block + later masks (prefix) or of the block only (dual)
    assert runs["none"].stats.tokens_in == 8 * N
    assert runs["prefix"].stats.tokens_in == 2 * N + 3 * 16 + 3 * 8
    assert runs["dual"].stats.tokens_in == 2 * N + 6 * 8
    assert all(r.trace[0].scored == runs["none"].trace[0].scored for r in runs.values())  # block start = full forward
    half = run(bidi, steps=8, kv_cache="dual", refresh_every=2)  # a refresh at steps 0 and 2 of each block
    assert half.stats.tokens_in == 4 * N + 4 * 8


@pytest.mark.parametrize("kv_cache", ["none", "dual"])
def test_threshold_decoding(bidi, kv_cache):
    ban_token(bidi.model, bidi.eos_id)
    res = run(bidi, kv_cache=kv_cache, selector={"name": "confidence_threshold", "threshold": 0.0})
    assert res.stats.nfe == 2 and [t.tokens for t in res.trace] == [8, 8]  # a whole block per step
    fac = run(bidi, kv_cache=kv_cache, selector={"name": "factor", "factor": 100.0})
    assert fac.stats.nfe == 2


def test_threshold_commits_confident_tokens_together(bidi):
    hooks = [force_token(bidi.model, len(PROMPT) + i, 20 + i) for i in (1, 2, 6)]
    res = run(bidi, selector="confidence_threshold", early_stop=False)
    for h in hooks:
        h.remove()
    assert sorted(res.trace[0].chosen) == [len(PROMPT) + i for i in (1, 2, 6)]
    assert [res.token_ids[i] for i in (1, 2, 6)] == [21, 22, 26]


def test_slot_selector_works_too(bidi):
    res = run(bidi, selector={"name": "threshold", "slot_threshold": 0.0})
    assert res.stats.nfe == 2


@pytest.mark.parametrize("eos_at, kv_cache", [(0, "dual"), (5, "none"), (13, "dual")])
def test_eos_stops_and_nothing_follows(bidi, eos_at, kv_cache):
    ban_token(bidi.model, bidi.eos_id)  # the random model would say EOS somewhere itself
    h = force_token(bidi.model, len(PROMPT) + eos_at, bidi.eos_id, boost=3e4)
    try:
        full = run(bidi, kv_cache=kv_cache, early_stop=False)
        res = run(bidi, kv_cache=kv_cache)
    finally:
        h.remove()
    assert res.token_ids == full.token_ids and len(res.token_ids) == eos_at + 1
    assert res.token_ids[-1] == bidi.eos_id
    # the EOS is committed first; decoding stops once every position before it is committed
    assert full.stats.nfe == 16 and eos_at + 1 <= res.stats.nfe <= 8 * (eos_at // 8 + 1)
    assert {t.block for t in res.trace} == ({0} if eos_at < 8 else {0, 1})


def test_sampling_and_random_remasking_are_seeded(bidi):
    cfg = dict(drafter={"temperature": 1.0}, remasking="random", steps=8)
    a, b, c = run(bidi, seed=3, **cfg), run(bidi, seed=3, **cfg), run(bidi, seed=4, **cfg)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert [t.chosen for t in a.trace] != [t.chosen for t in c.trace]


@pytest.mark.parametrize(
    "cfg, msg",
    [
        ({"gen_length": 16, "block_length": 5}, "block_length=5 must divide gen_length=16; allowed: [1, 2, 4, 8, 16]"),
        ({"gen_length": 16, "block_length": 8, "steps": 3}, "steps=3 must be a multiple of the number of blocks (2)"),
        ({"gen_length": 16, "steps": 32}, "at most block_length=16 steps per block"),
        ({"kv_cache": "full"}, "kv_cache"),
        ({"remasking": "entropy"}, "remasking"),
    ],
)
def test_invalid_options_name_the_problem(cfg, msg):
    with pytest.raises(ConfigError) as err:
        validate_config({"decoder": "llada", **cfg})
    assert msg in str(err.value)


READ_VARIANTS = {
    "fast-dllm dual threshold": {"kv_cache": "dual", "selector": {"name": "confidence_threshold", "threshold": 0.2}},
    "topk no cache": {"steps": 8},
    "prefix refresh": {"kv_cache": "prefix", "refresh_every": 2, "steps": 8},
    "random remasking, sampled": {"remasking": "random", "steps": 8, "drafter": {"temperature": 1.0}},
    "factor": {"kv_cache": "dual", "selector": {"name": "factor", "factor": 2.0}},
    "slot selector": {"selector": {"name": "threshold", "slot_threshold": 0.5}},
    "eos early stop": {"kv_cache": "dual", "steps": 16, "eos_at": 5},
    "shifted logits dual": {"kv_cache": "dual", "shifted": True},
    "shifted logits prefix, block 1": {"kv_cache": "prefix", "block_length": 1, "shifted": True},
}


@pytest.mark.parametrize("variant", list(READ_VARIANTS))
def test_reads_the_host_once_per_step_and_nowhere_else(bidi, variant):
    cfg = {"decoder": "llada", "gen_length": 16, "block_length": 8, **READ_VARIANTS[variant]}
    eos_at, bidi.logits_shifted = cfg.pop("eos_at", None), cfg.pop("shifted", False)
    hooks = [ban_token(bidi.model, bidi.eos_id)]  # the random model would say EOS somewhere itself
    if eos_at is not None:
        hooks.append(force_token(bidi.model, len(PROMPT) + eos_at, bidi.eos_id, boost=3e4))
    try:
        res, reads, tolist_calls, stray = decode_reading_host(bidi, cfg, PROMPT)
    finally:
        for h in hooks:
            h.remove()
    assert stray == []  # no .item() / .tolist() / int() / bool() / .nonzero() / mask indexing outside to_host
    assert reads == len(res.trace) + 1 == res.stats.nfe + 1  # one per step + the decode's finiteness check
    assert tolist_calls == reads
    assert (len(res.token_ids) == eos_at + 1) if eos_at is not None else len(res.token_ids) == 16


def test_bench_settings_read_the_host_once_per_step():
    """The shipped tiny-mdm at the bench settings: several tokens per step, an early stop at the EOS."""
    bb = Backbone.from_pretrained("tiny-mdm")
    task = get_task("arith")
    cfg = load_bench_config().decoder_config("arith", "llada", task.max_new_tokens)
    prompt = task_prompt(bb.tokenizer, "arith")
    res, reads, tolist_calls, stray = decode_reading_host(bb, cfg, prompt)
    assert stray == [] and reads == tolist_calls == len(res.trace) + 1
    assert len(res.trace) < len(res.token_ids) < task.max_new_tokens and res.token_ids[-1] in bb.eos_ids
