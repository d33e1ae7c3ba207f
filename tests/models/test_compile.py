"""``--compile``: a backbone whose forwards run through torch.compile decodes the same token ids as the
eager one, alone and in a batch, with the decoders of each attention kind (tiny random models), and a
batch's forwards with and without the per-row output head each run through a graph of their own, with
two models compiled in one process."""

import pytest
import torch

from refusion.core.loop import ForwardRequest
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache
from refusion.models.loading import cpp_compiler
from refusion.testing.models import make_tiny_qwen3
from helpers import decode_eager_and_compiled


CASES = [  # (model attention, decoder config)
    ("causal", {"decoder": "ar"}),
    ("causal", {"decoder": "refusion", "slot_size": 4}),
    ("bidirectional", {"decoder": "llada", "block_length": 8, "kv_cache": "dual"}),
    ("block_causal", {"decoder": "block"}),
]


@pytest.fixture
def dynamo_only(monkeypatch):
    """``torch.compile`` with dynamo's guards and graph capture but no inductor (``backend="eager"``): the
    graphs run as traced, in seconds and without a C++ compiler; dynamo's caches are reset after."""
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, dynamic=None: real(model, backend="eager", dynamic=dynamic))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batched_logits(bb: Backbone, fed: list[int], logits_at: list[list[int]]) -> list[torch.Tensor]:
    """One ragged forward of a new batch: row i feeds ``fed[i]`` random tokens and reads ``logits_at[i]``."""
    shared = RaggedCache(bb)
    g = torch.Generator().manual_seed(sum(fed))
    requests = [ForwardRequest(shared.new_view(), torch.randint(4, 40, (n,), generator=g), torch.arange(n), logits_at=cols)
                for n, cols in zip(fed, logits_at)]
    return shared.forward(requests)


def test_batched_forwards_with_and_without_the_per_row_head_match_eager(char_tokenizer, dynamo_only):
    # rows reading the same columns run the head on the union of them; rows reading different ones run it
    # on each row's own (the head's pre-hook). A graph compiled without that hook once ran the calls that
    # need it, with the wrong rows' hidden states (two models of one class share their compiled code), and
    # each number of (row, column) pairs the head reads once compiled a graph of its own
    models = [make_tiny_qwen3(len(char_tokenizer), seed=s, attention=a) for s, a in ((0, "causal"), (1, "block_causal"))]
    pairs = [(Backbone(m, char_tokenizer), Backbone(m, char_tokenizer, compile="default")) for m in models]
    calls = [  # (model, tokens fed per row, columns read per row)
        (0, [4, 4, 4], [[1, 3], [1, 3], [1, 3]]),  # the union: no per-row head
        (1, [5, 5, 4], [[1, 2, 3], [1, 2, 3], [1, 2, 3]]),  # the same, another size: a graph of symbolic sizes
        (1, [5, 3, 4], [[4, 1], [2, 0], [3, 2]]),  # each row its own columns: the per-row head
        (0, [5, 3, 4], [[4, 1], [2, 0], [3, 2]]),
        (1, [6, 6, 2], [[0, 1], [0, 1], [0, 1]]),
        (0, [6, 3, 4], [[5, 1], [2, 0], [3, 2]]),
    ]
    from torch._dynamo.utils import counters

    graphs = []
    for _ in range(2):  # the second round reuses the first round's graphs: switching the head recompiles nothing
        for i, fed, cols in calls:
            eager, compiled = pairs[i]
            want, got = _batched_logits(eager, fed, cols), _batched_logits(compiled, fed, cols)
            for w, g in zip(want, got):
                assert w.shape == g.shape
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"model {i}, fed {fed}, columns {cols}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]
    eager, compiled = pairs[0]  # the per-row head on a new number of (row, column) pairs: the same graph too
    fed, cols = [6, 3, 4], [[5, 1, 0], [2, 0], [3, 2, 1]]
    for w, g in zip(_batched_logits(eager, fed, cols), _batched_logits(compiled, fed, cols)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs[1]
    assert [(e.nfe, c.nfe) for e, c in pairs] == [(7, 7), (6, 6)]


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_a_dense_cache_after_a_prefill_or_a_crop_reuses_the_graph(char_tokenizer, dynamo_only):
    # a prefill leaves the cache's keys as a transposed view and a crop as a narrower view, and ids may
    # come as a strided view; each layout was once a graph of its own (dynamo guards static strides)
    model = make_tiny_qwen3(len(char_tokenizer), seed=0)
    eager, compiled = Backbone(model, char_tokenizer), Backbone(model, char_tokenizer, compile="default")
    g = torch.Generator().manual_seed(0)
    steps = [(5, True), (3, True), (4, False), (2, True), (3, False), (4, True)]  # (tokens fed, keep_kv)
    caches = {bb: bb.new_cache() for bb in (eager, compiled)}
    start, counts = 0, []
    for i, (n, keep) in enumerate(steps):
        ids, pos = torch.randint(4, 40, (n,), generator=g), torch.arange(start, start + n)
        if i == 3:  # ids and positions as strided views (every other entry of a longer tensor): the same graph
            ids, pos = torch.stack([ids, ids]).t().reshape(-1)[::2], torch.stack([pos, pos]).t().reshape(-1)[::2]
        want, got = (bb.forward(ids, pos, caches[bb].kv, keep_kv=keep) for bb in (eager, compiled))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        start += n if keep else 0
        counts.append(_graphs())
    assert caches[compiled].length() == caches[eager].length() == 14
    assert counts[2:] == [counts[1]] * (len(steps) - 2)  # the prefill's graph, then one graph for every step


def test_a_ragged_batch_that_loses_a_sequence_reuses_its_graph(char_tokenizer, dynamo_only):
    # a finished sequence leaves its buffer row spare, so the next call has fewer rows than the buffers:
    # with "duck sizing" the two sizes, equal at the first call, shared one symbol and this recompiled
    model = make_tiny_qwen3(len(char_tokenizer), seed=0)
    eager, compiled = Backbone(model, char_tokenizer), Backbone(model, char_tokenizer, compile="default")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 40, (n,), generator=g) for n in (4, 6, 5)]
    shared = {bb: RaggedCache(bb) for bb in (eager, compiled)}
    views = {bb: [shared[bb].new_view() for _ in prompts] for bb in (eager, compiled)}
    counts = []
    for step in range(3):
        if step == 2:
            for bb in (eager, compiled):
                shared[bb].release(views[bb].pop(1))
        live = [0, 2] if step == 2 else [0, 1, 2]
        outs = []
        for bb in (eager, compiled):
            reqs = [ForwardRequest(v, prompts[i][:3] + step, torch.arange(3 * step, 3 * step + 3), logits_at=[2])
                    for v, i in zip(views[bb], live)]
            outs.append(shared[bb].forward(reqs))
        for w, c in zip(*outs):
            torch.testing.assert_close(c, w, rtol=1e-4, atol=1e-4)
        counts.append(_graphs())
    assert counts[2] == counts[1]


def test_ragged_buffers_are_wider_than_every_forward(char_tokenizer):
    # a forward attends over columns [:width] of the buffers; were that the whole buffer, a compiled
    # forward would compile one graph for width == capacity and another for width < capacity
    bb = Backbone(make_tiny_qwen3(len(char_tokenizer), seed=0), char_tokenizer)
    shared = RaggedCache(bb)
    view = shared.new_view()
    for n in (64, 64, 128):  # widths 64, 128, 256: each a power of two, as the buffers grow
        shared.forward([ForwardRequest(view, torch.randint(4, 40, (n,)), torch.arange(view.length(), view.length() + n),
                                       logits_at=None)])
        assert shared.keys[0].shape[2] > view.length()


@pytest.mark.parametrize("attention, config", CASES, ids=[c["decoder"] for _, c in CASES])
@pytest.mark.slow  # minutes: inductor compiles C++ kernels for each graph
@pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_forwards_decode_the_same_tokens(char_tokenizer, attention, config):
    compiled = decode_eager_and_compiled(char_tokenizer, attention, config, "default")  # the same weights
    assert compiled._call is not compiled.model and compiled.compile == "default"
