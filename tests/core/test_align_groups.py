"""run_loops' align_groups: loops that alternate between request groups (a speculative drafter's call, then
the target's) and joined the batch at different times fall into step, one call per round; no forward waits
more than one round, and every loop's replies are its own."""

from __future__ import annotations

import torch

from refusion.core.loop import ForwardRequest, run_loops
from refusion.core.types import LoopOutput


class Cache:
    """A batch cache that records each model call's groups and answers each request with (group, step)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def new_view(self):
        return self

    def forward(self, requests):
        self.calls.append([r.group for r in requests])
        return [(r.group, int(r.ids[0])) for r in requests]

    def release(self, view) -> None:
        pass

    def row_order(self, view) -> int:
        return 0


def alternating(cache, steps: int, offset: int = 0):
    """A loop whose forwards alternate between groups "draft" and "verify", starting at ``offset``."""
    got = []
    for k in range(steps):
        group = ("draft", "verify")[(k + offset) % 2]
        got.append((yield ForwardRequest(cache, torch.tensor([k]), torch.arange(1), group=group)))
    return LoopOutput(got, [], [], [])


def test_loops_out_of_step_fall_into_step():
    loops = lambda cache: [alternating(cache, 8), alternating(cache, 8), alternating(cache, 8, offset=1)]  # noqa: E731
    plain = Cache()
    outs = run_loops(loops(plain), plain)
    assert len(plain.calls) == 16  # out of step: every round has a draft call and a verify call
    aligned = Cache()
    aligned_outs = run_loops(loops(aligned), aligned, align_groups=True)
    assert [o.token_ids for o in aligned_outs] == [o.token_ids for o in outs]  # each loop got its own replies
    assert len(aligned.calls) == 9  # one round of waiting, then one call per round
    assert all(len(set(groups)) == 1 for groups in aligned.calls[1:])


def test_a_minority_group_waits_one_round_at_most():
    def steady(cache, steps):  # always the same group: the majority
        for k in range(steps):
            yield ForwardRequest(cache, torch.tensor([k]), torch.arange(1), group="window")
        return LoopOutput([], [], [], [])

    def refresher(cache):  # one loop that needs a "full" call every time
        for k in range(3):
            yield ForwardRequest(cache, torch.tensor([k]), torch.arange(1), group="full")
        return LoopOutput([], [], [], [])

    cache = Cache()
    run_loops([steady(cache, 6), steady(cache, 6), refresher(cache)], cache, align_groups=True)
    full_rounds = [i for i, groups in enumerate(cache.calls) if "full" in groups]
    # the refresher's forwards wait one round each (never two): its calls come every other call at most
    assert len(full_rounds) == 3
    assert all(b - a <= 3 for a, b in zip([-1] + full_rounds, full_rounds))
