"""``--compile``: a backbone whose forwards run through torch.compile decodes the same token ids as the
eager one, alone and in a batch, with the decoders of each attention kind (tiny random models), and a
batch's forwards with and without the per-row output head each run through a graph of their own, with
two models compiled in one process."""

import pytest
import torch

from refusion.core.config import build_decoder
from refusion.core.loop import ForwardRequest
from refusion.models.backend import Backbone
from refusion.models.kvcache import RaggedCache
from refusion.models.loading import cpp_compiler
from refusion.testing.models import make_tiny_qwen3


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


@pytest.mark.parametrize("attention, config", CASES, ids=[c["decoder"] for _, c in CASES])
@pytest.mark.slow  # minutes: inductor compiles C++ kernels for each graph
@pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_forwards_decode_the_same_tokens(char_tokenizer, attention, config):
    model = make_tiny_qwen3(len(char_tokenizer), attention=attention)
    eager = Backbone(model, char_tokenizer)
    compiled = Backbone(model, char_tokenizer, compile="default")  # the same weights
    assert compiled._call is not model and compiled.compile == "default"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 40, (n,), generator=g).tolist() for n in (5, 9, 3)]
    cfg = {**config, "gen_length": 16}
    want, got = build_decoder(eager, cfg), build_decoder(compiled, cfg)
    assert [got.generate(p).token_ids for p in prompts] == [want.generate(p).token_ids for p in prompts]
    assert [r.token_ids for r in got.generate_batch(prompts)] == [r.token_ids for r in want.generate_batch(prompts)]
    assert compiled.nfe == eager.nfe  # the same forwards, counted the same way
