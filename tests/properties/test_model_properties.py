"""Properties of the backbone that ReFusion's KV reuse rests on (RoPE, cache continuation, cache ops)."""

import pytest
import torch
from helpers import make_tiny_qwen3
from hypothesis import given
from hypothesis import strategies as st

from refusion.models.backend import Backbone

pytestmark = pytest.mark.property

V = 50


@pytest.fixture(scope="module")
def one_layer(char_tokenizer):
    return Backbone(make_tiny_qwen3(len(char_tokenizer), seed=1, layers=1), char_tokenizer)


@pytest.fixture(scope="module")
def two_layer(char_tokenizer):
    return Backbone(make_tiny_qwen3(len(char_tokenizer), seed=2, layers=2), char_tokenizer)


@st.composite
def slotted_prefix(draw, max_slots=6, max_k=5):
    k = draw(st.integers(1, max_k))
    n = draw(st.integers(1, max_slots))
    tokens = draw(st.lists(st.integers(4, V - 1), min_size=n * k, max_size=n * k))
    order = draw(st.permutations(range(n)))
    return k, n, tokens, list(order)


@given(data=slotted_prefix(), queries=st.lists(st.integers(4, V - 1), min_size=1, max_size=4))
def test_rope_reorder_invariance_at_attention_level(one_layer, data, queries):
    """Permuting key/value tokens together with their position ids leaves every query's attention output
    unchanged: attention is a sum over keys, and RoPE makes each score depend only on the two tokens and
    the difference of their position ids. With one layer the keys are the layer-0 projections of the
    tokens alone, so the logits of later queries must not change (within float tolerance)."""
    k, n, tokens, order = data
    ids = torch.tensor(tokens)
    pos = torch.arange(n * k)
    perm = torch.cat([torch.arange(s * k, (s + 1) * k) for s in order])
    q = torch.tensor(queries)
    qpos = torch.arange(n * k, n * k + len(queries))
    a = one_layer.forward(torch.cat([ids, q]), torch.cat([pos, qpos]), None)[0, n * k:]
    b = one_layer.forward(torch.cat([ids[perm], q]), torch.cat([pos[perm], qpos]), None)[0, n * k:]
    assert torch.allclose(a, b, atol=1e-4)


@given(data=slotted_prefix(), prompt_len=st.integers(1, 6))
def test_incremental_equals_full(two_layer, data, prompt_len):
    """Logits computed through the cache in steps (prompt, then each slot in buffer order with its original
    position ids) equal one full forward of the same buffer with the same ids: the cache stores exactly
    the keys/values that the full causal forward computes for that buffer order."""
    k, n, tokens, order = data
    prompt = torch.arange(4, 4 + prompt_len)
    slots = [(torch.tensor(tokens[s * k:(s + 1) * k]), torch.arange(prompt_len + s * k, prompt_len + (s + 1) * k))
             for s in order]
    ids = torch.cat([prompt] + [t for t, _ in slots])
    pos = torch.cat([torch.arange(prompt_len)] + [p for _, p in slots])
    full = two_layer.forward(ids, pos, None)[0]
    cache = two_layer.new_cache().kv
    steps = [two_layer.forward(prompt, torch.arange(prompt_len), cache)[0]]
    steps += [two_layer.forward(t, p, cache)[0] for t, p in slots]
    assert torch.allclose(full, torch.cat(steps), atol=1e-4)


@given(data=slotted_prefix(max_slots=4), rows=st.integers(1, 4), drop=st.integers(0, 5))
def test_cache_ops_match_fresh_forwards(two_layer, data, rows, drop):
    """Crop after a forward restores the cache bit for bit; a forked row continued alone equals the same
    continuation of a single-row cache; concatenating rows whose continuations each follow the shared
    prefix equals a fresh forward only for the FIRST row's part (the later rows never saw the earlier
    ones: the documented kv_concat approximation), while the first row is exact."""
    k, n, tokens, _ = data
    bb = two_layer
    prefix = torch.tensor(tokens)
    cache = bb.new_cache()
    bb.forward(prefix, torch.arange(len(prefix)), cache.kv)
    snap = [l.keys.clone() for l in cache.kv.layers]
    extra = torch.arange(4, 4 + drop + 1)
    bb.forward(extra, torch.arange(len(prefix), len(prefix) + len(extra)), cache.kv)
    cache.crop(len(prefix))
    assert all(torch.equal(a, l.keys) for a, l in zip(snap, cache.kv.layers))
    conts = torch.randint(4, V, (rows, k))
    cpos = torch.arange(len(prefix), len(prefix) + k).expand(rows, -1)
    fork = cache.fork(rows)
    bb.forward(conts, cpos, fork.kv)
    for r in range(rows):
        alone = cache.fork(1)
        bb.forward(conts[r], cpos[r], alone.kv)
        assert torch.allclose(fork.kv.layers[1].keys[r], alone.kv.layers[1].keys[0], atol=1e-5)
    fork.concat_rows(len(prefix), [k] * rows)
    fresh = cache.fork(1)
    bb.forward(conts[0], cpos[0], fresh.kv)
    assert torch.allclose(fork.kv.layers[1].keys[0, :, : len(prefix) + k], fresh.kv.layers[1].keys[0], atol=1e-5)
    assert fork.kv.layers[1].keys.shape[-2] == len(prefix) + rows * k
