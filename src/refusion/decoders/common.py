"""Small helpers shared by decoding loops: cutting at EOS, and the padding and masks of a batch."""

from __future__ import annotations

import torch
from torch import Tensor

from refusion.core.host import from_host


def cut_after_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts of different lengths as one batch, each right-aligned so that every row's prompt ends in
    the same column: ``ids [B, P]`` (``pad_id`` before a shorter prompt), ``pos [B, P]`` (each prompt's
    own positions from 0; 0 at the padding) and ``real [B, P]`` bool (False at the padding), on
    ``device``. ``P`` is the longest prompt's length."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    pos = [[0] * (width - len(p)) + list(range(len(p))) for p in prompts]
    real = [[False] * (width - len(p)) + [True] * len(p) for p in prompts]
    return from_host(ids, device), from_host(pos, device), from_host(real, device)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """``allowed [B, T, K]`` bool (query t may attend key k) -> ``[B, 1, T, K]`` additive mask of ``dtype``
    (0 where allowed, the dtype's lowest float elsewhere), for :meth:`~refusion.models.backend.Backbone.forward`.
    Every query must be allowed at least one key (a padding query: itself), or attention yields NaN."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]
