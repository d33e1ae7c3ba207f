"""The checks of ReFusion's slot pipeline parts: scorer, selector, verifier, extender, remasker and
drafter (each part's contract, kind by kind, as :data:`~refusion.testing.checks.CONTRACTS` lists it)."""

from __future__ import annotations

import torch

from refusion.testing._hypothesis import st
import refusion.testing.strategies as S
import refusion.testing.checks.base as base
from refusion.testing.checks.base import CheckReport, _close, _contract, _options, _resolve, _unchanged


# -- scorer -----------------------------------------------------------------------------------------------------

SCORER_SHAPE = _contract("scorer", "scores are a float tensor [S], finite for finite logits, and the inputs are "
                                   "not modified")
SCORER_PERMUTE = _contract("scorer", "reorder invariance: permuting the slots permutes the scores (a slot's score "
                                     "does not depend on where it sits in the buffer)")
SCORER_LOCAL = _contract("scorer", "a slot's score depends on its own slot only: scoring any subset of the slots "
                                   "gives those slots' scores")
SCORER_PADDING = _contract("scorer", "padding never changes a score: other values at padded positions, or an "
                                     "extra padded column, give the same scores")


def _proposal_rows(p, idx):
    from refusion.core.types import Proposal

    return Proposal(p.token_ids[idx], p.probs[idx], p.logits[idx], None if p.valid is None else p.valid[idx])


def check_scorer(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                 raise_on_failure: bool = True) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.Scorer` against :data:`CONTRACTS` ``["scorer"]``."""
    from refusion.core.types import Proposal

    cls, name = _resolve("scorer", cls_or_name, registry)
    opts = _options(cls, options)

    def shape(o, p):
        before = [p.token_ids.clone(), p.probs.clone(), p.logits.clone()]
        s = cls(o).score(p)
        S_ = p.token_ids.shape[0]
        assert isinstance(s, torch.Tensor) and s.shape == (S_,) and s.is_floating_point(), \
            f"score() returned {type(s).__name__} {getattr(s, 'shape', '')} {getattr(s, 'dtype', '')}; expected a float tensor [{S_}]"
        assert torch.isfinite(s).all(), f"non-finite scores {s.tolist()} for finite logits"
        _unchanged(before, [p.token_ids, p.probs, p.logits], "score()")

    def permute(o, p, data):
        order = data.draw(S.reorderings(p.token_ids.shape[0]), label="order")
        scorer = cls(o)
        s, sp = scorer.score(p), scorer.score(_proposal_rows(p, torch.tensor(order)))
        assert _close(sp, s[order]), (f"scores of the slots in order {order}: {sp.tolist()}\n"
                                      f"the slots' own scores in that order:   {s[order].tolist()}")

    def local(o, p, data):
        n = p.token_ids.shape[0]
        idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True), label="subset")
        scorer = cls(o)
        s, sub = scorer.score(p), scorer.score(_proposal_rows(p, torch.tensor(idx)))
        assert _close(sub, s[idx]), (f"scores of slots {idx} scored alone: {sub.tolist()}\n"
                                     f"their scores among all {n} slots:  {s[idx].tolist()}")

    def padding(o, p, data):
        scorer = cls(o)
        s = scorer.score(p)
        S_, k, V = p.logits.shape
        mask = p.mask
        seed = data.draw(st.integers(0, 2**16), label="seed")
        g = torch.Generator().manual_seed(seed)
        logits = torch.where(mask[..., None], p.logits, torch.randn(S_, k, V, generator=g) * 5)
        ids = torch.where(mask, p.token_ids, torch.randint(0, V, (S_, k), generator=g))
        probs = torch.where(mask, p.probs, torch.rand(S_, k, generator=g))
        other = scorer.score(Proposal(ids, probs, logits, mask.clone()))
        assert _close(other, s), (f"valid mask {mask.int().tolist()}: other values at the padded positions changed "
                                  f"the scores from {s.tolist()} to {other.tolist()}")
        wide = Proposal(torch.cat([p.token_ids, p.token_ids[:, :1]], 1), torch.cat([p.probs, p.probs[:, :1] * 0], 1),
                        torch.cat([p.logits, p.logits[:, :1]], 1),
                        torch.cat([mask, torch.zeros(S_, 1, dtype=torch.bool)], 1))
        extra = scorer.score(wide)
        assert _close(extra, s), f"an extra padded column changed the scores from {s.tolist()} to {extra.tolist()}"

    props = [(SCORER_SHAPE, shape, dict(o=opts, p=S.proposals())),
             (SCORER_PERMUTE, permute, dict(o=opts, p=S.proposals(min_slots=2), data=st.data())),
             (SCORER_LOCAL, local, dict(o=opts, p=S.proposals(min_slots=2), data=st.data())),
             (SCORER_PADDING, padding, dict(o=opts, p=S.proposals(), data=st.data()))]
    return base._run(CheckReport("scorer", name), props, max_examples, raise_on_failure)


# -- selector ---------------------------------------------------------------------------------------------------

SELECTOR_SHAPE = _contract("selector", "select(scores [S]) is a bool tensor [S] with at least one True, the same "
                                       "for the same scores, and the scores are not modified")
SELECTOR_TOKEN = _contract("selector", "a token selector chooses only eligible positions, at least one when "
                                       "at_least_one and any is eligible, for any budget")


def check_selector(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                   raise_on_failure: bool = True) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.Selector` (and a ``TokenSelector``'s extra arguments)."""
    from refusion.core.interfaces import TokenSelector

    cls, name = _resolve("selector", cls_or_name, registry)
    opts = _options(cls, options)

    def shape(o, scores):
        before = scores.clone()
        sel = cls(o)
        out = sel.select(scores)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.shape == scores.shape, \
            f"select({scores.tolist()}) returned {getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}; expected bool {tuple(scores.shape)}"
        assert out.any(), f"select({scores.tolist()}) chose nothing; a selector chooses at least one slot"
        assert torch.equal(sel.select(scores), out), f"select({scores.tolist()}) chose differently on a second call"
        _unchanged([before], [scores], "select()")

    props = [(SELECTOR_SHAPE, shape, dict(o=opts, scores=S.selector_scores()))]
    if issubclass(cls, TokenSelector):
        def token(o, scores, data):
            n = scores.numel()
            eligible = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="eligible"),
                                    dtype=torch.bool)
            budget = data.draw(st.one_of(st.none(), st.integers(1, n + 1)), label="budget")
            at_least_one = data.draw(st.booleans(), label="at_least_one")
            out = cls(o).select(scores, budget=budget, at_least_one=at_least_one, eligible=eligible)
            assert out.dtype == torch.bool and out.shape == scores.shape, f"returned {out.dtype} {tuple(out.shape)}"
            assert not (out & ~eligible).any(), f"chose ineligible positions: chosen {out.tolist()}, eligible {eligible.tolist()}"
            if at_least_one and eligible.any():
                assert out.any(), f"chose nothing with at_least_one and eligible {eligible.tolist()}"

        props.append((SELECTOR_TOKEN, token, dict(o=opts, scores=S.selector_scores(), data=st.data())))
    return base._run(CheckReport("selector", name), props, max_examples, raise_on_failure)


# -- verifier ---------------------------------------------------------------------------------------------------

VERIFIER_SHAPE = _contract("verifier", "passed is bool [S, k], only at real positions, True at every slot's first "
                                       "token; prefix_len and accepted_slots are integer scalars")
VERIFIER_PREFIX = _contract("verifier", "the accepted tokens form a prefix: prefix_len is the longest all-pass run "
                                        "of real tokens from the start of the concatenation, and accepted_slots "
                                        "the leading slots wholly inside it")
VERIFIER_PADDING = _contract("verifier", "padding never changes the verdict (other probabilities at padded "
                                         "positions)")
VERIFIER_MONOTONE = _contract("verifier", "monotone: raising causal probabilities never shortens the accepted "
                                          "prefix, raising a threshold option never lengthens it")


def threshold_fields(cls) -> list[str]:
    """Options of a verifier or extender that act as a threshold (float fields named ``*threshold*`` or
    ``min_*``): raising one accepts no more."""
    out = []
    for name, info in cls.Options.model_fields.items():
        if ("threshold" in name or name.startswith("min_")) and "float" in str(info.annotation):
            out.append(name)
    return out


def _leading_run(flags: list[bool]) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


def check_verifier(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                   raise_on_failure: bool = True, thresholds: list[str] | None = None) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.Verifier`. ``thresholds``: the options that act as a
    threshold (default :func:`threshold_fields`)."""
    cls, name = _resolve("verifier", cls_or_name, registry)
    opts = _options(cls, options)
    monotone_fields = threshold_fields(cls) if thresholds is None else thresholds

    def shape(o, inputs):
        draft, ar, valid = inputs
        before = [draft.clone(), ar.clone()]
        v = cls(o).verify(draft, ar, valid)
        mask = torch.ones_like(ar, dtype=torch.bool) if valid is None else valid
        assert v.passed.dtype == torch.bool and v.passed.shape == ar.shape, \
            f"passed is {v.passed.dtype} {tuple(v.passed.shape)}; expected bool {tuple(ar.shape)}"
        assert not (v.passed & ~mask).any(), f"passed {v.passed.int().tolist()} marks padding (valid {mask.int().tolist()})"
        assert v.passed[:, 0].all(), f"passed {v.passed.int().tolist()}: a slot's first token must pass"
        for what in ("prefix_len", "accepted_slots"):
            t = getattr(v, what)
            assert isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point(), f"{what} is {t!r}; expected an integer scalar tensor"
        _unchanged(before, [draft, ar], "verify()")

    def prefix(o, inputs):
        draft, ar, valid = inputs
        v = cls(o).verify(draft, ar, valid)
        mask = torch.ones_like(ar, dtype=torch.bool) if valid is None else valid
        flags = v.passed[mask].tolist()  # real tokens in concatenation order
        run = _leading_run(flags)
        plen = int(v.prefix_len)
        assert plen == run, (f"ar_probs {ar.tolist()}, valid {mask.int().tolist()}: passed marks "
                             f"{[int(f) for f in flags]} (real tokens in order) start with an all-pass run of {run}, "
                             f"but prefix_len is {plen}: the accepted tokens are not that prefix")
        sizes = mask.sum(1).tolist()
        ends = [sum(sizes[: s + 1]) for s in range(len(sizes))]
        whole = sum(1 for e in ends if e <= plen)
        assert int(v.accepted_slots) == whole, (f"prefix_len {plen} over slots of sizes {sizes} holds {whole} whole "
                                                f"slots, but accepted_slots is {int(v.accepted_slots)}")

    def padding(o, inputs, data):
        draft, ar, valid = inputs
        if valid is None:
            return
        seed = data.draw(st.integers(0, 2**16), label="seed")
        g = torch.Generator().manual_seed(seed)
        ar2 = torch.where(valid, ar, torch.rand(ar.shape, generator=g))
        draft2 = torch.where(valid, draft, torch.rand(ar.shape, generator=g))
        a, b = cls(o).verify(draft, ar, valid), cls(o).verify(draft2, ar2, valid)
        assert torch.equal(a.passed, b.passed) and int(a.prefix_len) == int(b.prefix_len) and \
            int(a.accepted_slots) == int(b.accepted_slots), \
            (f"valid {valid.int().tolist()}: other probabilities at padded positions changed the verdict from "
             f"prefix_len {int(a.prefix_len)} to {int(b.prefix_len)}")

    def monotone(o, inputs, data):
        draft, ar, valid = inputs
        seed = data.draw(st.integers(0, 2**16), label="seed")
        higher = torch.maximum(ar, torch.rand(ar.shape, generator=torch.Generator().manual_seed(seed)))
        a, b = int(cls(o).verify(draft, ar, valid).prefix_len), int(cls(o).verify(draft, higher, valid).prefix_len)
        assert b >= a, f"ar_probs {ar.tolist()} accept {a} tokens, but the higher {higher.tolist()} accept only {b}"
        for fname in monotone_fields:
            value = getattr(o, fname)
            if value is None:
                continue
            info = cls.Options.model_fields[fname]
            lo, hi, _, _ = S._bounds(info)
            top = hi if hi is not None else value + 1.0
            raised = data.draw(st.floats(value, top, allow_nan=False), label=f"raised {fname}")
            try:
                o2 = o.model_copy(update={fname: raised})
                o2 = type(o).model_validate(o2.model_dump())
            except ValueError:
                continue
            c = int(cls(o2).verify(draft, ar, valid).prefix_len)
            assert c <= a, f"{fname} {value} accepts {a} tokens of ar_probs {ar.tolist()}, the higher {raised} accepts {c}"

    props = [(VERIFIER_SHAPE, shape, dict(o=opts, inputs=S.verifier_inputs())),
             (VERIFIER_PREFIX, prefix, dict(o=opts, inputs=S.verifier_inputs())),
             (VERIFIER_PADDING, padding, dict(o=opts, inputs=S.verifier_inputs(), data=st.data())),
             (VERIFIER_MONOTONE, monotone, dict(o=opts, inputs=S.verifier_inputs(), data=st.data()))]
    return base._run(CheckReport("verifier", name), props, max_examples, raise_on_failure)


# -- extender ---------------------------------------------------------------------------------------------------

EXTENDER_ROUND = _contract("extender", "a round returns bool [S, m], a prefix per row that keeps every verified "
                                       "token and gains at least one in each row that has an unverified one")
EXTENDER_PERMUTE = _contract("extender", "reorder invariance: permuting the rows permutes the result")
EXTENDER_MONOTONE = _contract("extender", "monotone: raising causal probabilities never shortens a row's verified "
                                          "prefix")


def check_extender(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                   raise_on_failure: bool = True, verifier=None) -> CheckReport:
    """Check an :class:`~refusion.core.interfaces.Extender`: drawn options leave no option unset (an unset
    one is what ``bind`` fills in from the verifier); ``verifier`` (an instance) binds it instead."""
    cls, name = _resolve("extender", cls_or_name, registry)
    opts = _options(cls, options, none=False)

    def make(o):
        ext = cls(o)
        return ext.bind(verifier) if verifier is not None else ext

    def round_(o, inputs):
        ar, verified = inputs
        before = [ar.clone(), verified.clone()]
        out = make(o).extend(ar, verified)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.shape == ar.shape, \
            f"extend() returned {getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}; expected bool {tuple(ar.shape)}"
        ctx = f"ar_probs {ar.tolist()}, verified {verified.int().tolist()} -> {out.int().tolist()}"
        assert not (out[:, 1:] & ~out[:, :-1]).any(), f"{ctx}: a row is not a prefix"
        assert not (verified & ~out).any(), f"{ctx}: a verified token was dropped"
        open_rows = ~verified.all(1)
        gained = out.sum(1) > verified.sum(1)
        assert not (open_rows & ~gained).any(), f"{ctx}: a row with unverified tokens gained none"
        _unchanged(before, [ar, verified], "extend()")

    def permute(o, inputs, data):
        ar, verified = inputs
        order = torch.tensor(data.draw(S.reorderings(ar.shape[0]), label="order"))
        ext = make(o)
        a, b = ext.extend(ar, verified), ext.extend(ar[order], verified[order])
        assert torch.equal(b, a[order]), f"rows in order {order.tolist()} gave {b.int().tolist()}, not {a[order].int().tolist()}"

    def monotone(o, inputs, data):
        ar, verified = inputs
        seed = data.draw(st.integers(0, 2**16), label="seed")
        higher = torch.maximum(ar, torch.rand(ar.shape, generator=torch.Generator().manual_seed(seed)))
        ext = make(o)
        a, b = ext.extend(ar, verified).sum(1), ext.extend(higher, verified).sum(1)
        assert (b >= a).all(), f"ar_probs {ar.tolist()} verify {a.tolist()} per row, the higher {higher.tolist()} only {b.tolist()}"

    props = [(EXTENDER_ROUND, round_, dict(o=opts, inputs=S.extender_inputs())),
             (EXTENDER_PERMUTE, permute, dict(o=opts, inputs=S.extender_inputs(), data=st.data())),
             (EXTENDER_MONOTONE, monotone, dict(o=opts, inputs=S.extender_inputs(), data=st.data()))]
    return base._run(CheckReport("extender", name), props, max_examples, raise_on_failure)


# -- remasker ---------------------------------------------------------------------------------------------------

REMASKER_RANGE = _contract("remasker", "keep() gives one count per slot, each in 1 .. the slot's length")
REMASKER_PERMUTE = _contract("remasker", "reorder invariance: permuting the slots permutes the counts")
REMASKER_PADDING = _contract("remasker", "padding never changes a count (other confidences past a slot's length)")


def check_remasker(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                   raise_on_failure: bool = True) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.Remasker`."""
    cls, name = _resolve("remasker", cls_or_name, registry)
    opts = _options(cls, options)

    def range_(o, inputs):
        conf, lengths = inputs
        keep = cls(o).keep(conf, list(lengths))
        assert len(keep) == len(lengths), f"keep() gave {len(keep)} counts for {len(lengths)} slots"
        bad = [(s, int(n), m) for s, (n, m) in enumerate(zip(keep, lengths)) if not 1 <= int(n) <= m]
        assert not bad, f"confidence {conf.tolist()}, lengths {lengths}: counts {list(keep)} outside 1..length at (slot, count, length) {bad}"

    def permute(o, inputs, data):
        conf, lengths = inputs
        order = data.draw(S.reorderings(len(lengths)), label="order")
        rm = cls(o)
        a, b = rm.keep(conf, list(lengths)), rm.keep(conf[torch.tensor(order)], [lengths[i] for i in order])
        assert [int(x) for x in b] == [int(a[i]) for i in order], f"slots in order {order} kept {list(b)}, not {[a[i] for i in order]}"

    def padding(o, inputs, data):
        conf, lengths = inputs
        seed = data.draw(st.integers(0, 2**16), label="seed")
        mask = S.valid_mask(conf.shape[1], lengths)
        other = torch.where(mask, conf, torch.rand(conf.shape, generator=torch.Generator().manual_seed(seed)))
        a, b = cls(o).keep(conf, list(lengths)), cls(o).keep(other, list(lengths))
        assert [int(x) for x in a] == [int(x) for x in b], f"lengths {lengths}: other confidences past them changed the counts {list(a)} -> {list(b)}"

    props = [(REMASKER_RANGE, range_, dict(o=opts, inputs=S.remasker_inputs())),
             (REMASKER_PERMUTE, permute, dict(o=opts, inputs=S.remasker_inputs(), data=st.data())),
             (REMASKER_PADDING, padding, dict(o=opts, inputs=S.remasker_inputs(), data=st.data()))]
    return base._run(CheckReport("remasker", name), props, max_examples, raise_on_failure)


# -- drafter ----------------------------------------------------------------------------------------------------

DRAFTER_PROPOSAL = _contract("drafter", "draft(logits [S, k, V]) gives token ids [S, k] in 0..V-1 and probs [S, k], "
                                        "each the softmax probability of its drafted token under the logits")
DRAFTER_SEEDED = _contract("drafter", "the same seeded generator gives the same draft")
DRAFTER_PERMUTE = _contract("drafter", "reorder invariance: a deterministic draft (the same under two seeds) of "
                                       "permuted slots is the permuted draft")


def _logits(max_slots=5, max_size=4, max_vocab=6):
    @st.composite
    def draw(d):
        p = d(S.proposals(max_slots, max_size, max_vocab))
        return p.logits
    return draw()


def check_drafter(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                  raise_on_failure: bool = True) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.Drafter`."""
    cls, name = _resolve("drafter", cls_or_name, registry)
    opts = _options(cls, options)

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    def proposal(o, logits):
        before = logits.clone()
        p = cls(o).draft(logits, gen(0))
        S_, k, V = logits.shape
        assert p.token_ids.shape == (S_, k) and not p.token_ids.is_floating_point(), f"token_ids {tuple(p.token_ids.shape)} {p.token_ids.dtype}"
        assert ((p.token_ids >= 0) & (p.token_ids < V)).all(), f"token ids {p.token_ids.tolist()} outside 0..{V - 1}"
        expected = torch.softmax(logits, -1).gather(-1, p.token_ids[..., None]).squeeze(-1)
        assert _close(p.probs, expected), f"probs {p.probs.tolist()} are not the drafted tokens' probabilities {expected.tolist()}"
        _unchanged([before], [logits], "draft()")

    def seeded(o, logits, seed):
        a, b = cls(o).draft(logits, gen(seed)), cls(o).draft(logits, gen(seed))
        assert torch.equal(a.token_ids, b.token_ids), f"seed {seed}: drafts {a.token_ids.tolist()} then {b.token_ids.tolist()}"

    def permute(o, logits, data):
        d = cls(o)
        a = d.draft(logits, gen(0))
        if not torch.equal(a.token_ids, d.draft(logits, gen(1)).token_ids):
            return  # a sampled draft: permuting the slots permutes the noise too
        order = data.draw(S.reorderings(logits.shape[0]), label="order")
        b = d.draft(logits[torch.tensor(order)], gen(0))
        assert torch.equal(b.token_ids, a.token_ids[order]), f"slots in order {order} drafted {b.token_ids.tolist()}, not {a.token_ids[order].tolist()}"

    props = [(DRAFTER_PROPOSAL, proposal, dict(o=opts, logits=_logits())),
             (DRAFTER_SEEDED, seeded, dict(o=opts, logits=_logits(), seed=st.integers(0, 2**16))),
             (DRAFTER_PERMUTE, permute, dict(o=opts, logits=_logits(), data=st.data()))]
    return base._run(CheckReport("drafter", name), props, max_examples, raise_on_failure)
