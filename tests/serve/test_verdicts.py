"""loadtest's verdicts: each serving goal judged from a report's figures; its latency percentiles."""

from __future__ import annotations

import copy

from refusion.serve.loadtest import Outcome, report, verdicts

GOOD = {
    "requests": 10, "sent": 10, "completed": 9, "disconnected": 1, "not_sent": 0, "errors": {},
    "delivery": {"each_completed_once": True, "unique_response_ids": True, "lost": 0},
    "server": {"batch_size_after": 0.0, "queue_after": 0.0, "settle_s": 0.1, "cancelled_disconnect": 1.0,
               "rss_mb_first_half_max": 500.0, "rss_mb_second_half_max": 540.0},
    "offline": {"compared": 10, "distinct_prompts": 4, "differ": 0},
}


def judged(**changes) -> dict[str, bool]:
    report = copy.deepcopy(GOOD)
    for path, value in changes.items():
        *head, last = path.split("__")
        node = report
        for key in head:
            node = node[key]
        node[last] = value
    return {goal: met for goal, met, _ in verdicts(report)}


def test_a_clean_run_meets_every_goal():
    assert judged() == {"0 errors": True, "every request sent": True, "nothing lost or duplicated": True,
                        "batch returns to empty": True, "memory steady": True,
                        "outputs identical to offline decodes": True}


def test_each_goal_fails_on_its_own_figure():
    assert not judged(errors={"http_500": 1})["0 errors"]
    assert not judged(not_sent=2)["every request sent"]
    assert not judged(delivery__lost=1)["nothing lost or duplicated"]
    assert not judged(delivery__unique_response_ids=False)["nothing lost or duplicated"]
    assert not judged(completed=8)["nothing lost or duplicated"]  # one request ended neither way
    assert not judged(server__batch_size_after=2.0)["batch returns to empty"]
    assert not judged(server__rss_mb_second_half_max=560.0)["memory steady"]  # 12% above the first half
    assert not judged(offline__differ=1)["outputs identical to offline decodes"]
    assert not judged(offline__compared=9)["outputs identical to offline decodes"]


def test_latency_percentiles_interpolate_as_batch_bench_does():
    """TTFT and ITL percentiles use the project's one percentile (core/stats.py): linear interpolation
    between order statistics, as batch-bench's latency percentiles do (a nearest-rank p50 of 4 values would be
    the 2nd, not the mean of the 2nd and 3rd)."""
    outcomes = []
    for i, ttft in enumerate([0.1, 0.2, 0.4, 0.8]):
        o = Outcome(i, 0, status="ok", finishes=1, dones=1, response_ids=[f"r{i}"], sent_at=0.0, first_at=ttft,
                    chunk_times=[ttft, ttft + 0.01 * (i + 1)])
        outcomes.append(o)
    r = report(outcomes, 1.0, {}, {}, [], 0.0, ["q"], {}, None, False, 4)
    assert abs(r["ttft_ms"]["p50"] - 300.0) < 1e-9  # (200 + 400) / 2
    assert abs(r["ttft_ms"]["p95"] - 740.0) < 1e-9  # 400 + 0.85 * 400
    assert abs(r["itl_ms"]["p50"] - 25.0) < 1e-9  # gaps 10, 20, 30, 40 ms
    assert r["chunks"] == 8
    empty = report([Outcome(0, 0, status="http_500")], 1.0, {}, {}, [], 0.0, ["q"], {}, None, False, 1)
    assert empty["ttft_ms"] == {"p50": None, "p95": None, "p99": None}
