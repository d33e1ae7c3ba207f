"""Small helpers shared by decoding loops."""

from __future__ import annotations

import torch
from torch import Tensor


def next_token_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """Causal probability of each token given the logits of its predecessor.

    ``logits [..., m, V]`` at real tokens ``tokens [..., m]`` (each predicts the next token) ->
    ``[..., m]`` where entry j is ``softmax(logits[j-1])[tokens[j]]``; entry 0 has no predecessor in the
    span and is set to 1.0 (callers force or ignore it).
    """
    probs = torch.softmax(logits[..., :-1, :].float(), dim=-1).gather(-1, tokens[..., 1:, None]).squeeze(-1)
    return torch.cat([torch.ones(tokens[..., :1].shape, dtype=probs.dtype, device=probs.device), probs], dim=-1)


def cut_after_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids
