"""Token probabilities from a logsumexp: equal to a softmax's, and the chunked CPU logsumexp is bit-identical;
the two-level CPU argmax finds what argmax finds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refusion.core.probs import CPU_CHUNK_ELEMENTS, next_token_probs, row_logsumexp, token_probs


def test_chunked_logsumexp_is_bit_identical():
    logits = torch.randn(2, 3, CPU_CHUNK_ELEMENTS // 4 + 7, generator=torch.Generator().manual_seed(0)) * 8
    assert logits.numel() > CPU_CHUNK_ELEMENTS  # the chunked path runs
    assert torch.equal(row_logsumexp(logits), logits.logsumexp(-1))


def test_token_probs_equal_softmax_probs():
    logits = torch.randn(4, 5, 300, generator=torch.Generator().manual_seed(1)) * 6
    tokens = torch.randint(0, 300, (4, 5), generator=torch.Generator().manual_seed(2))
    softmax = torch.softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(token_probs(logits, tokens), softmax, rtol=1e-5, atol=1e-7)
    causal = next_token_probs(logits[:, :-1], tokens)  # [4, 5]: entry j from the logits at j-1
    assert torch.equal(causal[:, 0], torch.ones(4))
    assert torch.allclose(causal[:, 1:], torch.softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1),
                          rtol=1e-5, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.sampled_from([2048, 2049, 2303, 4096 + 255, 151936]),
       ties=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_row_argmax_is_argmax_with_ties_and_a_ragged_last_block(rows, vocab, ties, seed):
    """The first maximum of each row, as Tensor.argmax finds it: ties across and inside blocks, the maximum
    in the short last block, -inf everywhere but one id."""
    from refusion.core.probs import row_argmax

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 2, vocab, generator=g)
    top = torch.randint(0, vocab, (rows, 2, ties + 1), generator=g)
    logits.scatter_(-1, top, 9.0)  # ties of the maximum at random ids
    logits[0, 0, -1] = 10.0  # the maximum in the last (possibly short) block
    logits[-1, -1] = -float("inf")
    logits[-1, -1, seed % vocab] = 0.0
    assert torch.equal(row_argmax(logits), logits.argmax(-1))
    assert torch.equal(row_argmax(logits[:, 1]), logits[:, 1].argmax(-1))  # a non-contiguous view
