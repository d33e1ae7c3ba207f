"""Small helpers shared by decoding loops."""

from __future__ import annotations


def cut_after_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids
