"""Token probabilities from a logsumexp: equal to a softmax's, and the chunked CPU logsumexp is bit-identical."""

from __future__ import annotations

import torch

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
