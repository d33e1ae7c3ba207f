"""Attention masks, built in one place for the decoders' caches and the training objectives.

A mask is first a bool ``allowed [..., T, K]`` (query t may attend key k), then an additive float mask
(0 where allowed, the dtype's lowest value elsewhere) that the models add to their attention scores.
Segments express every attention kind the decoders use: a query attends to the keys whose segment is not
after its own (causal: one segment per token; full: one segment; block-causal: one segment per block).
"""

from __future__ import annotations

import torch
from torch import Tensor


def additive_mask(allowed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``allowed`` bool -> additive mask of the same shape and ``dtype``. Every query must be allowed at
    least one key, or attention yields NaN."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def segment_allowed(query_segments: Tensor, key_segments: Tensor) -> Tensor:
    """``query_segments [..., T]``, ``key_segments [..., K]`` -> ``allowed [..., T, K]``: a query attends to
    every key whose segment is <= its own."""
    return key_segments[..., None, :] <= query_segments[..., :, None]
