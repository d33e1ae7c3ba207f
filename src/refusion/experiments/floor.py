"""ReFusion's floor under the forward cost model: the least a ReFusion decode of given answers can cost.

:func:`refusion_floor` gives the least value of every cost-model feature (summed over a decode's calls) that
any schedule of ReFusion's algorithm needs for a batch of sequences; priced by a fit
(:meth:`~refusion.experiments.costmodel.CostModel.terms`), it bounds every schedule's tokens/s from above.
:func:`breakdown` splits a decode's predicted time by what it pays for (``scripts/cost_model.py --bound``).
"""

from __future__ import annotations

from typing import Sequence

from refusion.experiments.costmodel import KINDS, NARROW_TOKENS, LoopCost


def _narrow_floor(prompts: Sequence[int], calls: int, row_forwards: int) -> int:
    """The least sum over a batch's ``calls`` calls of min(tokens, NARROW_TOKENS): the first call holds every
    sequence's first forward (at least its prompt and one [MASK]); the other calls hold the other
    ``row_forwards`` rows, at least one token each and 1 to ``len(prompts)`` per call, packed into as few
    full calls as possible with one row in each other call (the sum is concave in each call's rows, so its
    minimum is that vertex)."""
    n = len(prompts)
    first = min(NARROW_TOKENS, sum(p + 1 for p in prompts))
    rows, others = row_forwards - n, calls - 1
    full, rest = divmod(rows - others, n - 1) if n > 1 else (0, 0)
    single = others - full - (1 if rest else 0)
    return first + single + full * min(NARROW_TOKENS, n) + (min(NARROW_TOKENS, 1 + rest) if rest else 0)


def refusion_floor(prompts: Sequence[int], generated: Sequence[int], calls: int = 2,
                   sequence_forwards: Sequence[int] | None = None) -> list[float]:
    """The least value of every feature (:data:`~refusion.experiments.costmodel.FEATURES` order, summed over calls) that a ReFusion decode of
    one batch can have: sequence i with ``prompts[i]`` prompt tokens (P) commits ``generated[i]`` tokens
    (G) in ``sequence_forwards[i]`` (default 2) of the batch's ``calls`` model calls.

    What every schedule of the algorithm (slot size, draft window or budget, fused or not, thresholds,
    Stage II-b rounds) does: its first forward feeds the prompt with at least one [MASK] (the prefill rides
    on the first Stage I); every committed position is fed as a [MASK] at least once (Stage I drafts whole
    slots, a II-b predict round masks the unverified positions) and again, KV kept, in the forward that
    commits it (Stage II-a feeds the chosen drafts, a II-b verify round its row); Stage I never commits. So
    a sequence takes part in at least 2 forwards and feeds at least P + 2G tokens, every forward attending
    over at least P + 1 keys and the committing one over P + G, with at least G logits rows (each drafted
    mask's); a batch's calls are ragged (each sequence at least one row), one sequence's dense causal; the
    batch's first call holds every sequence's first forward (the batch starts together).
    Each feature takes its own minimum, so the priced vector (every coefficient is non-negative) is a
    lower bound on what the cost model charges any such decode, padding ignored: a bound, not a schedule."""
    n = len(prompts)
    forwards = [2] * n if sequence_forwards is None else [int(f) for f in sequence_forwards]
    if n == 0 or len(generated) != n or len(forwards) != n:
        raise ValueError(f"prompts, generated, sequence_forwards: need one entry per sequence, got {n}, "
                         f"{len(generated)}, {len(forwards)}")
    if min(prompts) < 1 or min(generated) < 1:
        raise ValueError("prompts, generated: every sequence has at least 1 prompt token and 1 committed token")
    if calls < max(forwards) or min(forwards) < 2:
        raise ValueError(f"sequence_forwards: each sequence takes part in 2 to calls={calls} forwards, got "
                         f"{min(forwards)} to {max(forwards)}")
    if not calls - 1 <= sum(forwards) - n <= (calls - 1) * n:  # the first call holds every sequence
        raise ValueError(f"calls: {calls} calls cannot hold {sum(forwards)} sequence-forwards of {n} sequences "
                         "(the first holding each sequence's first forward)")
    kind = "ragged" if n > 1 else "causal"
    fed = sum(p + 2 * g for p, g in zip(prompts, generated))
    keys = sum((f - 1) * (p + 1) + p + g for p, g, f in zip(prompts, generated, forwards))
    pairs = sum((p + 2 * g) * (p + 1) for p, g in zip(prompts, generated))
    return [float(calls if k == kind else 0) for k in KINDS] + [
        float(sum(forwards) if n > 1 else 0), float(fed), float(_narrow_floor(prompts, calls, sum(forwards))),
        float(keys), float(pairs), float(sum(generated))]


#: the cost model's terms by what they pay for: a decode's predicted time split by :func:`breakdown`
GROUPS = {"fixed": tuple(f"fixed_{k}" for k in KINDS), "tokens": ("token", "narrow", "ragged_row"),
          "attention": ("key", "pair"), "logits": ("logit",)}


def breakdown(terms: dict[str, float], loop: LoopCost, calls: int, sequence_forwards: int) -> dict[str, float]:
    """Predicted seconds of a decode whose forwards cost ``terms`` (seconds per :data:`~refusion.experiments.costmodel.FEATURES` term:
    :meth:`~refusion.experiments.costmodel.CostModel.terms` of :func:`refusion_floor`'s totals, ``terms_of`` a decode's calls), with
    ``calls`` model calls and ``sequence_forwards``: per :data:`GROUPS` group, its ``loop`` cost and the
    ``total``."""
    out = {group: sum(terms[name] for name in names) for group, names in GROUPS.items()}
    out["loop"] = loop.per_call * calls + loop.per_sequence * sequence_forwards
    out["total"] = sum(out.values())
    return out
