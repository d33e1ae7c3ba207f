"""shape_split: a request group's forwards in model calls of similar widths and similar cached lengths when the
padding saved outweighs a call's cost (CallPrice); run_loops runs each part as its own call."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refusion.core.loop import CallPrice, ForwardRequest, run_loops, shape_split

#: about the CPU's price (serve.engine.CALL_PRICE_CPU: 100, 0.0142, 0.00075)
CPU = CallPrice(call=100.0, key=0.014, pair=0.00075)


class View:
    """A cache view holding ``held`` keys in its longest row."""

    def __init__(self, held: int) -> None:
        self.held = held

    def length(self) -> int:
        return self.held


def request(width: int, rows: int = 1, cached: int = 0) -> ForwardRequest:
    ids = torch.zeros(width, dtype=torch.long) if rows == 1 else torch.zeros(rows, width, dtype=torch.long)
    return ForwardRequest(View(cached), ids, torch.arange(width))


def cost(price: CallPrice, requests: list[ForwardRequest], calls: list[list[int]]) -> float:
    return sum(price.cost(sum(requests[k].ids.shape[0] if requests[k].ids.dim() == 2 else 1 for k in call),
                          max(requests[k].ids.shape[-1] for k in call), max(requests[k].cached() for k in call))
               for call in calls)


def test_rows_of_very_different_widths_go_in_two_calls():
    requests = [request(64), request(16), request(16), request(64), request(16)]
    # one call: 5 rows * 64 = 320 tokens; two: 2 * 64 + 3 * 16 = 176 tokens + one more call's 100
    assert shape_split(CallPrice(100))(requests) == [[1, 2, 4], [0, 3]]
    assert shape_split(CallPrice(200))(requests) == [[0, 1, 2, 3, 4]]  # the padding saved (144) is below a call


def test_rows_of_one_width_and_very_different_cached_lengths_go_in_two_calls():
    """Three sequences early in their decode beside one late: every row of one call attends over the late
    one's 2,000 keys. Per row 32 + 0.014 * 2032 + 0.00075 * 32 * 2032 = 109 tokens in one call, 34 apart."""
    requests = [request(32, cached=20), request(32, cached=2000), request(32, cached=24), request(32, cached=20)]
    assert shape_split(CPU)(requests) == [[0, 2, 3], [1]]
    assert cost(CPU, requests, [[0, 2, 3], [1]]) < cost(CPU, requests, [[0, 1, 2, 3]])
    assert shape_split(CallPrice(100))(requests) == [[0, 1, 2, 3]]  # priced by width alone: one call
    close = [request(32, cached=1900), request(32, cached=2000), request(32, cached=1950)]
    assert shape_split(CPU)(close) == [[0, 1, 2]]  # similar lengths: the padding is below a call's cost


def test_similar_shapes_share_a_call_and_each_request_is_in_one_call():
    requests = [request(16), request(17), request(64, rows=4), request(65), request(120)]
    parts = shape_split(CallPrice(50))(requests)
    assert sorted(k for part in parts for k in part) == list(range(5))
    assert [0, 1] in parts and any({2, 3} <= set(part) for part in parts)
    assert all(part == sorted(part) for part in parts)  # each call keeps the batch's row order
    assert shape_split(CallPrice(0))(requests) == [[0], [1], [2], [3], [4]]  # free calls: every width its own


@pytest.mark.parametrize("field, value", [("call", -1.0), ("key", -0.5), ("pair", float("nan"))])
def test_a_negative_price_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=f"call price: {field} must be 0 or more"):
        CallPrice(**{"call": 1.0, field: value})


def partitions(items: list[int]):
    """Every set partition of ``items``."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]
        yield [[first]] + part


@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 3)), min_size=1, max_size=6),
       st.sampled_from([8, 32]), st.sampled_from([CPU, CallPrice(20.0, 0.05, 0.002), CallPrice(0.0, 0.01, 0.0)]))
def test_one_width_the_split_is_the_cheapest_of_all_partitions(shape, width, price):
    """Of one width, the calls' cost grows with their longest cached row: runs of the cached lengths, sorted,
    are optimal, and the split finds the cheapest of every partition."""
    requests = [request(width, rows=n, cached=c) for c, n in shape]
    calls = shape_split(price)(requests)
    assert sorted(k for call in calls for k in call) == list(range(len(requests)))
    best = min(cost(price, requests, p) for p in partitions(list(range(len(requests)))))
    assert cost(price, requests, calls) == pytest.approx(best)


@given(st.lists(st.tuples(st.sampled_from([1, 4, 16, 64]), st.integers(0, 2000), st.integers(1, 4)), min_size=1,
                max_size=8))
def test_the_split_never_costs_more_than_one_call_or_the_split_by_width(shape):
    requests = [request(w, rows=n, cached=c) for w, c, n in shape]
    calls = shape_split(CPU)(requests)
    assert sorted(k for call in calls for k in call) == list(range(len(requests)))
    assert all(call == sorted(call) for call in calls)
    by_width = shape_split(CallPrice(CPU.call))(requests)
    assert cost(CPU, requests, calls) <= min(cost(CPU, requests, [list(range(len(requests)))]),
                                             cost(CPU, requests, by_width)) + 1e-9


class Cache:
    """A batch cache that records the widths of each model call and answers each request with its width."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def new_view(self):
        return self

    def length(self) -> int:
        return 0

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
                     split=shape_split(CallPrice(10)))
    assert [o.token_ids for o in outs] == [[64, 16], [16, 16], [64, 64]]
    assert cache.calls == [[16], [64, 64], [16, 16], [64]]
    one = Cache()
    run_loops([loop(one, [64, 16]), loop(one, [16, 16]), loop(one, [64, 64])], one)
    assert one.calls == [[64, 16, 64], [16, 16, 64]]  # without a policy: one call per group


@pytest.mark.parametrize("model, config", [
    ("tiny-block", {"decoder": "block", "gen_length": 16, "selector": {"name": "confidence_threshold", "threshold": 0.9}}),
    ("tiny-mdm", {"decoder": "llada", "gen_length": 16, "block_length": 8, "kv_cache": "dual",
                  "selector": {"name": "confidence_threshold", "threshold": 0.9}}),
    ("tiny-ar", {"decoder": "ar", "gen_length": 16}),
])
def test_sequences_split_by_cached_length_decode_as_alone(model, config):
    """Sequences admitted one per model call sit at different stages; priced so that every call splits
    by cached length, their rows go in separate calls of one width, and each decodes token for token as it
    does alone (a split changes only which rows share a call)."""
    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.models.kvcache import RaggedCache
    from refusion.models.tokenizer import encode_prompt
    from refusion.tasks import get_task

    bb = Backbone.from_pretrained(model)
    decoder = build_decoder(bb, config)
    prompts = [encode_prompt(bb.tokenizer, ex.query) for ex in get_task("arith").examples("test", 4)]
    cache = decoder.new_batch_cache()
    pending = list(prompts)

    def admit():  # one new sequence before each model call: every one at a stage of its own
        if not pending:
            return []
        generator = torch.Generator(device=bb.device).manual_seed(decoder.options.seed)
        return [decoder.batch_loop(pending.pop(0), generator, cache)]

    calls: list[list[tuple[int, int]]] = []  # per model call: (width, cached) of each request
    forward = RaggedCache.forward

    def recorded(self, requests):
        calls.append([(r.ids.shape[-1], r.cached()) for r in requests])
        return forward(self, requests)

    RaggedCache.forward = recorded
    try:
        outs = run_loops([], cache, admit=admit, split=shape_split(CallPrice(0.0, key=1.0, pair=0.1)))
    finally:
        RaggedCache.forward = forward
    assert [o.token_ids for o in outs] == [decoder.generate(p).token_ids for p in prompts]
    widths = [{w for w, _ in call} for call in calls]
    assert all(len(w) == 1 for w in widths)  # free calls: one width and one cached length per call
    assert all(len({c for _, c in call}) == 1 for call in calls)
    rounds = len(calls)
    cache, pending, calls = decoder.new_batch_cache(), list(prompts), []
    RaggedCache.forward = recorded
    try:
        run_loops([], cache, admit=admit)
    finally:
        RaggedCache.forward = forward
    assert rounds > len(calls)  # one call per group: fewer calls
    if config["decoder"] != "llada":  # (LLaDA's dual cache holds the whole sequence at every stage)
        assert any(len({c for _, c in call}) > 1 for call in calls)  # rows of several cached lengths in one
