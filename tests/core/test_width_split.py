"""width_split: a request group's forwards in model calls of similar widths when the padding saved outweighs
a call's fixed cost; run_loops runs each part as its own call."""

from __future__ import annotations

import pytest
import torch

from refusion.core.loop import ForwardRequest, run_loops, width_split


def request(width: int, rows: int = 1) -> ForwardRequest:
    ids = torch.zeros(width, dtype=torch.long) if rows == 1 else torch.zeros(rows, width, dtype=torch.long)
    return ForwardRequest(None, ids, torch.arange(width))


def test_rows_of_very_different_widths_go_in_two_calls():
    requests = [request(64), request(16), request(16), request(64), request(16)]
    # one call: 5 rows * 64 = 320 tokens; two: 2 * 64 + 3 * 16 = 176 tokens + one more call's 100
    assert width_split(100)(requests) == [[1, 2, 4], [0, 3]]
    assert width_split(200)(requests) == [[0, 1, 2, 3, 4]]  # the padding saved (144) is below a call's cost


def test_similar_widths_share_a_call_and_each_request_is_in_one_call():
    requests = [request(16), request(17), request(64, rows=4), request(65), request(120)]
    parts = width_split(50)(requests)
    assert sorted(k for part in parts for k in part) == list(range(5))
    assert [0, 1] in parts and any({2, 3} <= set(part) for part in parts)
    assert all(part == sorted(part) for part in parts)  # each call keeps the batch's row order
    assert width_split(0)(requests) == [[0], [1], [2], [3], [4]]  # free calls: every width its own
    with pytest.raises(ValueError, match="call_cost_tokens"):
        width_split(-1)


class Cache:
    """A batch cache that records the widths of each model call and answers each request with its width."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def new_view(self):
        return self

    def forward(self, requests):
        self.calls.append([r.ids.shape[-1] for r in requests])
        return [r.ids.shape[-1] for r in requests]

    def release(self, view) -> None:
        pass

    def row_order(self, view) -> int:
        return 0


def loop(cache, widths):
    got = []
    for w in widths:
        got.append((yield ForwardRequest(cache, torch.zeros(w, dtype=torch.long), torch.arange(w))))
    from refusion.core.types import LoopOutput

    return LoopOutput(got, [], [], [])


def test_run_loops_makes_one_call_per_part():
    cache = Cache()
    outs = run_loops([loop(cache, [64, 16]), loop(cache, [16, 16]), loop(cache, [64, 64])], cache,
                     split=width_split(10))
    assert [o.token_ids for o in outs] == [[64, 16], [16, 16], [64, 64]]
    assert cache.calls == [[16], [64, 64], [16, 16], [64]]
    one = Cache()
    run_loops([loop(one, [64, 16]), loop(one, [16, 16]), loop(one, [64, 64])], one)
    assert one.calls == [[64, 16, 64], [16, 16, 64]]  # without a policy: one call per group
