"""The forward cost model: the fit recovers known coefficients, decode predictions add up, and the
backbone's forward log records what each forward computed."""

import dataclasses

import numpy as np
import pytest
import torch

from refusion.core.loop import FULL, Attention, ForwardRequest
from refusion.experiments.costmodel import (
    FEATURES, GRID, CostModel, DecodeProfile, LoopCost, SwitchCost, calibrate_loop, crossover, feature_totals,
    features, fit, outside_forwards, predict_decode, scale_rows,
)
from refusion.experiments.floor import breakdown, refusion_floor
from refusion.models.backend import ForwardShape
from refusion.models.kvcache import RaggedCache

KNOWN = {"fixed_causal": 3e-3, "fixed_masked": 3.5e-3, "fixed_segments": 3.8e-3, "fixed_ragged": 4.2e-3,
         "fixed_ragged_masked": 4.6e-3, "ragged_row": 5e-5, "token": 1.1e-4, "narrow": 3e-4, "key": 2e-7, "pair": 3e-9,
         "logit": 6e-6}


def synthetic(coef: dict[str, float], noise: float = 0.0, seed: int = 0) -> list[ForwardShape]:
    """The default grid's shapes, timed by ``coef`` with multiplicative noise."""
    rng = np.random.default_rng(seed)
    truth = CostModel(coef)
    out = []
    for kind, rows, fed, past, logits in GRID:
        n = rows * (fed if logits == "all" else 1)
        s = ForwardShape(rows, fed, past, n, kind)
        out.append(ForwardShape(rows, fed, past, n, kind, truth.predict(s) * (1 + noise * rng.standard_normal())))
    return out


def test_fit_recovers_known_coefficients():
    model = fit(synthetic(KNOWN))
    for name in FEATURES:
        assert model.coef[name] == pytest.approx(KNOWN[name], rel=1e-6), name
    assert model.fit_error["max"] < 1e-9


def test_fit_with_noise_recovers_the_fixed_costs_and_per_token_cost():
    model = fit(synthetic(KNOWN, noise=0.02, seed=1))
    for name in ("fixed_causal", "fixed_masked", "fixed_segments", "fixed_ragged", "fixed_ragged_masked", "token"):
        assert model.coef[name] == pytest.approx(KNOWN[name], rel=0.1), name
    assert all(v >= 0 for v in model.coef.values())
    assert model.fit_error["median"] < 0.03


def test_fit_keeps_coefficients_non_negative():
    """Times that an unconstrained fit would explain with a negative per-key cost get 0 there."""
    coef = {**KNOWN, "key": 0.0}
    shapes = synthetic(coef)
    shapes = [ForwardShape(s.rows, s.fed, s.past, s.logits_rows, s.kind, s.seconds * (1 - 1e-4 * s.past)) for s in shapes]
    model = fit(shapes)
    assert min(model.coef.values()) >= 0 and model.coef["key"] == 0.0


def test_fit_leaves_an_unmeasured_kind_at_zero_and_needs_two_timed_forwards():
    shapes = [s for s in synthetic(KNOWN) if s.kind == "causal"]
    model = fit(shapes)
    assert model.coef["fixed_ragged"] == 0.0 and model.coef["fixed_causal"] == pytest.approx(KNOWN["fixed_causal"])
    with pytest.raises(ValueError, match="shapes: need at least 2 timed forwards"):
        fit(shapes[:1])


def test_features_and_model_validation_name_the_field():
    with pytest.raises(ValueError, match="kind: 'sparse'"):
        features(ForwardShape(1, 1, 0, 1, "sparse"))
    with pytest.raises(ValueError, match="coef: missing"):
        CostModel({"token": 1.0})
    s = ForwardShape(rows=2, fed=3, past=5, logits_rows=2, kind="ragged")
    assert features(s) == [0, 0, 0, 1, 0, 2, 6, 4, 16, 48, 2]
    assert features(ForwardShape(rows=1, fed=3, past=5, logits_rows=2, kind="segments")) == [0, 0, 1, 0, 0, 0, 3, 3, 8, 24, 2]
    with pytest.raises(ValueError, match="coef: unknown \\['speed'\\]"):
        CostModel({**KNOWN, "speed": 1.0})


def test_decode_prediction_adds_forward_costs_and_loop_cost():
    model = CostModel(KNOWN)
    shapes = [ForwardShape(1, 1, 10, 1, "causal"), ForwardShape(4, 8, 20, 4, "ragged")]
    forwards = sum(model.predict(s) for s in shapes)
    profile = DecodeProfile(shapes, sequence_forwards=5, tokens=12, wall_s=forwards + 5 * 1e-3)
    loop = calibrate_loop(model, profile)
    assert loop == LoopCost(0.0, pytest.approx(1e-3))
    pred = predict_decode(model, profile, loop)
    assert pred["predicted_s"] == pytest.approx(profile.wall_s) and pred["error"] == pytest.approx(0, abs=1e-12)
    assert pred["fixed_s"] == pytest.approx(KNOWN["fixed_causal"] + KNOWN["fixed_ragged"])
    assert CostModel.from_dict(model.as_dict()) == model


def test_loop_cost_separates_per_call_from_per_sequence_work():
    """Batch-1 decodes alone make as many calls as sequence-forwards; with a batch beside them the loop cost
    splits into a per-call part (the batch's step) and a per-sequence part, and predicts both."""
    model = CostModel(KNOWN)
    truth = LoopCost(per_call=2e-3, per_sequence=0.5e-3)

    def profile(calls: int, rows: int) -> DecodeProfile:
        shapes = [ForwardShape(rows, 1, 40, rows, "ragged" if rows > 1 else "causal")] * calls
        p = DecodeProfile(shapes, calls * rows, calls * rows, 0.0)
        return DecodeProfile(shapes, p.sequence_forwards, p.tokens, model.total(shapes)[0] + truth.seconds(p))

    alone, batched = profile(30, 1), profile(30, 16)
    loop = calibrate_loop(model, [alone, batched])
    assert loop.per_call == pytest.approx(truth.per_call) and loop.per_sequence == pytest.approx(truth.per_sequence)
    assert predict_decode(model, profile(10, 4), loop)["error"] == pytest.approx(0, abs=1e-9)
    one = calibrate_loop(model, [alone])  # batch 1 alone: all of it per sequence-forward
    assert one.per_call == 0 and one.per_sequence == pytest.approx(2.5e-3)
    with pytest.raises(ValueError, match="profiles: need at least one"):
        calibrate_loop(model, [])


def test_loop_cost_from_timed_forwards_ignores_the_fits_error():
    """Forwards timed in the decode: the loop's share is the time outside them, however far the fit prices
    them from what they took (here 30% too high, which the residual would take out of the loop)."""
    truth, fitted = CostModel(KNOWN), CostModel({k: 1.3 * v for k, v in KNOWN.items()})
    loop = LoopCost(per_call=2e-3, per_sequence=0.5e-3)

    def profile(calls: int, rows: int, timed: bool) -> DecodeProfile:
        shape = ForwardShape(rows, 1, 40, rows, "ragged" if rows > 1 else "causal")
        shapes = [ForwardShape(*dataclasses.astuple(shape)[:5], truth.predict(shape) if timed else None)] * calls
        p = DecodeProfile(shapes, calls * rows, calls * rows, 0.0)
        return DecodeProfile(shapes, p.sequence_forwards, p.tokens, truth.total(shapes)[0] + loop.seconds(p))

    timed = calibrate_loop(fitted, [profile(30, 1, True), profile(30, 16, True)])
    assert timed.per_call == pytest.approx(loop.per_call) and timed.per_sequence == pytest.approx(loop.per_sequence)
    residual = calibrate_loop(fitted, [profile(30, 1, False), profile(30, 16, False)])
    assert residual.per_call < 0.6 * loop.per_call  # the fit's 30% taken out of the loop
    assert outside_forwards(fitted, profile(3, 1, True)) == pytest.approx(3 * (loop.per_call + loop.per_sequence))


def test_scale_rows_and_crossover():
    assert scale_rows([ForwardShape(4, 8, 20, 4, "ragged")], 4) == [ForwardShape(16, 8, 20, 16, "ragged")]
    assert crossover({1: 4.0, 4: 2.0, 16: 0.9}, {1: 1.0, 4: 1.5, 16: 1.0}) == 16
    assert crossover({1: 4.0, 4: 2.0}, {1: 1.0, 4: 1.5}) is None


def test_forward_log_records_each_kind(backbone):
    backbone.forward_log = []
    cache = backbone.new_cache()
    cache.forward(ForwardRequest(cache, torch.tensor([5, 6, 7]), torch.arange(3), logits_at=None))
    cache.forward(ForwardRequest(cache, torch.tensor([8, 9]), torch.arange(3, 5), keep_kv=False, logits_at=[1]))
    cache.forward(ForwardRequest(cache, torch.tensor([8, 9]), torch.arange(3, 5), keep_kv=False, attention=FULL))
    shared = RaggedCache(backbone)
    views = [shared.new_view() for _ in range(2)]
    cache.forward(ForwardRequest(cache, torch.tensor([8, 9]), torch.arange(3, 5), keep_kv=False,
                                 attention=Attention.block_causal([0, 1])))
    shared.forward([ForwardRequest(v, torch.tensor([5, 6, 7, 8][: 3 + i]), torch.arange(3 + i), logits_at=None)
                    for i, v in enumerate(views)])
    shared.forward([ForwardRequest(views[0], torch.tensor([9]), torch.tensor([3]), keep_kv=False),
                    ForwardRequest(views[1], torch.tensor([9, 9]), torch.tensor([4, 5]), keep_kv=False,
                                   attention=Attention.block_causal([0, 0]))])
    log = backbone.forward_log
    assert [(s.kind, s.rows, s.fed, s.past, s.logits_rows) for s in log] == [
        ("causal", 1, 3, 0, 0), ("causal", 1, 2, 3, 1), ("masked", 1, 2, 3, 2), ("segments", 1, 2, 3, 2),
        ("ragged", 2, 4, 0, 0), ("ragged_masked", 2, 2, 4, 3)]  # the head ran on 1 + 2 rows, each its own
    assert all(s.seconds is None for s in log)  # forwards were not timed
    backbone.forward_log, backbone.time_forwards = [], True
    cache.forward(ForwardRequest(cache, torch.tensor([8]), torch.arange(3, 4)))
    assert backbone.forward_log[0].seconds > 0


def test_refusion_floor_by_hand():
    """Two sequences (P 3 and 5, G 4 and 2) in the fewest calls: both in both ragged calls."""
    floor = dict(zip(FEATURES, refusion_floor([3, 5], [4, 2])))
    assert floor == {"fixed_causal": 0, "fixed_masked": 0, "fixed_segments": 0, "fixed_ragged": 2,
                     "fixed_ragged_masked": 0, "ragged_row": 4, "token": 11 + 9, "narrow": 4 + 2,
                     "key": (4 + 7) + (6 + 7), "pair": 11 * 4 + 9 * 6, "logit": 6}
    alone = dict(zip(FEATURES, refusion_floor([3], [4], calls=5, sequence_forwards=[5])))
    assert (alone["fixed_causal"], alone["fixed_ragged"], alone["ragged_row"], alone["narrow"]) == (5, 0, 0, 4 + 4)
    assert (alone["key"], alone["pair"]) == (4 * 4 + 7, 11 * 4)
    # 5 calls, the first holding all 4 sequences; the other 4 hold 7 more rows: one call of 4, three of 1;
    # 8 more rows: one of 4, one of 2, two of 1
    assert dict(zip(FEATURES, refusion_floor([2] * 4, [1] * 4, 5, [2, 3, 4, 2])))["narrow"] == 4 + 4 + 1 + 1 + 1
    assert dict(zip(FEATURES, refusion_floor([2] * 4, [1] * 4, 5, [2, 3, 4, 3])))["narrow"] == 4 + 4 + 2 + 1 + 1
    for bad in ({"calls": 1}, {"sequence_forwards": [1, 2]}, {"calls": 3, "sequence_forwards": [4, 2]}):
        with pytest.raises(ValueError, match="sequence_forwards"):
            refusion_floor([3, 5], [4, 2], **bad)
    with pytest.raises(ValueError, match="calls: 4 calls cannot hold"):
        refusion_floor([3, 5], [4, 2], calls=4, sequence_forwards=[2, 2])  # a call would hold no sequence


def test_refusion_floor_is_reached_by_the_least_decode(backbone):
    """One token in a slot of one, drafted with the prefill and committed by Stage II-a: the decode is the
    floor, term by term, alone and in a batch of prompts of one length (no padding)."""
    from refusion.core.config import build_decoder

    decoder = build_decoder(backbone, {"decoder": "refusion", "gen_length": 1, "slot_size": 1})
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    for batch in ([prompts[0]], prompts):
        backbone.forward_log = []
        results = [decoder.generate(batch[0])] if len(batch) == 1 else decoder.generate_batch(batch)
        log, backbone.forward_log = backbone.forward_log, None
        assert len(log) == 2 and [len(r.token_ids) for r in results] == [1] * len(batch)
        assert feature_totals(log) == refusion_floor([3] * len(batch), [1] * len(batch))


@pytest.mark.parametrize("settings", [
    {}, {"draft_window": 1}, {"fused": True}, {"slot_size": 2, "draft_budget": 4},
    {"correct": True, "join_adjacent": True}, {"remasker": "sub_slot"}])
def test_refusion_floor_is_below_every_decode(backbone, settings):
    """On a random model (many Stage II-b rounds, remasks, EOS anywhere), every feature of ReFusion's recorded
    forwards, alone and in a batch of three, is at least the floor's for the same sequences, calls and
    sequence-forwards; the minimum schedule (two calls) is below that again."""
    from refusion.core.config import build_decoder

    decoder = build_decoder(backbone, {"decoder": "refusion", "gen_length": 12, "slot_size": 4, **settings})
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    for batch in ([prompts[0]], prompts):
        backbone.forward_log = []
        results = [decoder.generate(batch[0])] if len(batch) == 1 else decoder.generate_batch(batch)
        log, backbone.forward_log = backbone.forward_log, None
        recorded = feature_totals(log)
        generated = [len(r.token_ids) for r in results]
        nfe = [r.stats.nfe for r in results]
        floor = refusion_floor([len(p) for p in batch], generated, len(log), nfe)
        least = refusion_floor([len(p) for p in batch], generated)
        for name, got, low, lowest in zip(FEATURES, recorded, floor, least):
            assert got >= low >= lowest, (name, len(batch), got, low, lowest)
        model = CostModel(KNOWN)
        priced = breakdown(model.terms_of(log), LoopCost(1e-3, 2e-4), len(log), sum(nfe))
        assert priced["total"] == pytest.approx(model.total(log)[0] + 1e-3 * len(log) + 2e-4 * sum(nfe))
        assert breakdown(model.terms(floor), LoopCost(1e-3, 2e-4), len(log), sum(nfe))["total"] <= priced["total"]


@pytest.mark.parametrize("warm", [3, 0])
def test_measure_times_each_shape_after_calls_of_itself_when_warm(monkeypatch, warm):
    """Warm: every timed call comes after ``warm`` untimed calls of the same shape; cold: right after the
    grid's previous shape (the warm-up round aside)."""
    import refusion.experiments.costmodel as cm

    calls, timed = [], []

    class Bb:
        def synchronize(self):
            pass

    ticks = iter(range(10_000))
    monkeypatch.setattr(cm, "forward_call", lambda bb, *shape: lambda: calls.append(shape))

    def clock():
        timed.append(len(calls))  # calls made before this clock read
        return float(next(ticks))

    grid = [("causal", 1, 1, 8), ("ragged", 4, 16, 8, "all")]
    shapes = cm.measure(Bb(), grid, repeats=2, clock=clock, warm=warm)
    assert [s.kind for s in shapes] == ["causal", "ragged"] and all(s.seconds == 1.0 for s in shapes)
    starts = timed[::2]  # each timed call starts at a clock read; the read after it ends the timing
    ran = [calls[i] for i in starts]
    assert all(calls[i - j] == shape for i, shape in zip(starts, ran) for j in range(1, warm + 1))
    assert warm or all(calls[i - 1] != shape for i, shape in zip(starts, ran))
    assert len(calls) == len(grid) * (1 + 2 * (1 + warm))


def test_switch_cost_prices_a_repeated_shape_warm_and_any_other_cold():
    warm, cold = CostModel(KNOWN), CostModel({k: 2 * v for k, v in KNOWN.items()})
    a, b = ForwardShape(1, 1, 40, 1, "causal"), ForwardShape(1, 16, 40, 16, "causal")
    a2 = ForwardShape(1, 1, 41, 1, "causal")  # the next step of a run of a: the cache grew by one
    calls = [a, a2, b, b, a]
    expected = cold.predict(a) + warm.predict(a2) + cold.predict(b) + warm.predict(b) + cold.predict(a)
    switch = SwitchCost(warm, cold)
    assert switch.total(calls)[0] == pytest.approx(expected)
    assert sum(switch.terms_of(calls).values()) == pytest.approx(expected)
    assert warm.total(calls)[0] < expected < cold.total(calls)[0]
