"""One check per part kind, and one per decoder: each runs that kind's documented contract as hypothesis
properties and raises :class:`ContractError` naming every property that failed, with its failing example.

>>> from refusion.testing import check_scorer
>>> check_scorer(MyScorer)                     # or check_scorer("my_scorer"): a registered name

Each ``check_<kind>(cls_or_name, options=None, max_examples=None)`` draws the part's options from its
``Options`` model unless ``options`` (a mapping or an ``Options`` instance) fixes them, and runs
``max_examples`` examples per property (None: the environment variable ``REFUSION_CHECK_EXAMPLES`` if set,
else the active hypothesis profile's, 100 by default; the project's test suite registers ``ci`` = 25 and
``thorough`` = 1,000). The contracts, kind by kind, are
listed in :data:`CONTRACTS` and in docs/reliability.md.

Why one module of about 700 lines: each check is a handful of hypothesis properties over shared
strategies and one error type; the checks are listed together in :data:`CONTRACTS`, as docs/reliability.md
lists them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from refusion.testing._hypothesis import st
import refusion.testing.strategies as S

ATOL = 1e-5


class ContractError(AssertionError):
    """A part or decoder broke its kind's contract; the message names each failed property with the
    example hypothesis found (shrunk) and what was expected."""


@dataclass
class CheckReport:
    """What a check ran: the part, the properties that held and those that failed (with their messages)."""

    kind: str
    name: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def message(self) -> str:
        lines = [f"{self.kind} {self.name} breaks {len(self.failed)} of its contract's "
                 f"{len(self.passed) + len(self.failed)} properties:"]
        for statement, detail in self.failed:
            lines.append(f"\n- {statement}\n" + "\n".join("    " + line for line in detail.splitlines()))
        return "\n".join(lines)


#: kind -> the statements its check runs (one hypothesis property each); docs/reliability.md lists them
CONTRACTS: dict[str, list[str]] = {}


def _contract(kind: str, statement: str):
    CONTRACTS.setdefault(kind, []).append(statement)
    return statement


def _settings(max_examples: int | None):
    from hypothesis import HealthCheck, settings

    base = settings()
    max_examples = max_examples or int(os.environ.get("REFUSION_CHECK_EXAMPLES") or 0) or base.max_examples
    return settings(base, max_examples=max_examples, deadline=None, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


def _run(report: CheckReport, properties: list[tuple[str, Callable, dict]], max_examples: int | None,
         raise_on_failure: bool) -> CheckReport:
    """Run each ``(statement, body, strategies)`` as a hypothesis property; record failures readably."""
    from hypothesis import given

    for statement, body, strategies in properties:
        test = _settings(max_examples)(given(**strategies)(body))
        try:
            test()
        except Exception as e:  # noqa: BLE001 - a part may raise anything; report it with its example
            notes = [n.strip("\n") for n in getattr(e, "__notes__", []) if "reproduce_failure" not in n]
            what = str(e) if isinstance(e, AssertionError) else f"raised {type(e).__name__}: {e}"
            report.failed.append((statement, "\n".join([what.strip() or type(e).__name__, *notes])))
        else:
            report.passed.append(statement)
    if raise_on_failure and report.failed:
        raise ContractError(report.message())
    return report


def _resolve(kind: str, cls_or_name, registry=None) -> tuple[type, str]:
    if isinstance(cls_or_name, str):
        from refusion.core.registry import get_registry

        return (registry or get_registry()).get(kind, cls_or_name), cls_or_name
    return cls_or_name, f"{cls_or_name.__module__}.{cls_or_name.__qualname__}"


def _options(cls, options, none: bool = True):
    """A strategy of ``cls.Options``: drawn, or the one given."""
    if options is None:
        return S.part_options(cls, none=none)
    if isinstance(options, dict):
        options = cls.Options.model_validate(options)
    return st.just(options)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=ATOL, rtol=1e-5, equal_nan=False)


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor], what: str) -> None:
    for b, a in zip(before, after):
        assert torch.equal(b, a), f"{what} modified its input tensor in place"


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
    return _run(CheckReport("scorer", name), props, max_examples, raise_on_failure)


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
    return _run(CheckReport("selector", name), props, max_examples, raise_on_failure)


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
    return _run(CheckReport("verifier", name), props, max_examples, raise_on_failure)


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
    return _run(CheckReport("extender", name), props, max_examples, raise_on_failure)


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
    return _run(CheckReport("remasker", name), props, max_examples, raise_on_failure)


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
    return _run(CheckReport("drafter", name), props, max_examples, raise_on_failure)


# -- cache manager ----------------------------------------------------------------------------------------------

CACHE_SHAPE = _contract("cache", "merge_rows gives one row holding the prefix and every slot's tokens")
CACHE_FIRST = _contract("cache", "the prefix and the first slot are exact: after them the model predicts what a "
                                 "fresh forward of prefix + first slot predicts")
CACHE_EXACT = _contract("cache", "position invariance: a manager declaring exact = True equals a fresh forward of "
                                 "the prefix and the slots in buffer order with their original position ids, "
                                 "whatever order the slots' positions are in")


@functools.lru_cache(maxsize=None)
def backbone(attention: str = "causal", seed: int = 3, layers: int = 2):
    """A tiny random backbone of ``attention``, built once per process (checks share it)."""
    from refusion.testing.models import tiny_backbone

    return tiny_backbone(attention, seed=seed, layers=layers)


@st.composite
def _merge_case(draw):
    n = draw(st.integers(1, 4))
    P = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    width = max(sizes) + draw(st.integers(0, 1))  # rows may hold more than the kept tokens
    order = draw(S.reorderings(n))  # slot order in the buffer vs their positions
    starts, at = {}, P
    for s in range(n):
        starts[s] = at
        at += width
    tokens = [draw(st.lists(st.integers(*S.PROMPT_TOKENS), min_size=width, max_size=width)) for _ in range(n)]
    prefix = draw(st.lists(st.integers(*S.PROMPT_TOKENS), min_size=P, max_size=P))
    rows = [(tokens[s], list(range(starts[s], starts[s] + width)), sizes[s]) for s in order]
    probe = draw(st.lists(st.integers(*S.PROMPT_TOKENS), min_size=1, max_size=3))
    return prefix, rows, probe, at


def check_cache_manager(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                        raise_on_failure: bool = True, exact: bool | None = None) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.CacheManager` on a tiny causal model. ``exact`` (default: the
    class's ``exact`` attribute) asks for every slot to equal a fresh forward, not only the first."""
    from refusion.core.loop import ForwardRequest

    cls, name = _resolve("cache", cls_or_name, registry)
    opts = _options(cls, options)
    exact = getattr(cls, "exact", False) if exact is None else exact

    def run(o, case):
        bb = backbone()
        prefix, rows, probe, end = case
        P = len(prefix)
        base = bb.new_cache()
        base.forward(ForwardRequest(base, torch.tensor(prefix), torch.arange(P), logits_at=None))
        fork = base.fork(len(rows))
        fork.forward(ForwardRequest(fork, torch.tensor([t for t, _, _ in rows]), torch.tensor([p for _, p, _ in rows]),
                                    logits_at=None))
        kept = [t[:m] for t, _, m in rows]
        kept_pos = [p[:m] for _, p, m in rows]
        merged = cls(o).merge_rows(bb, fork, P, kept, kept_pos)
        return bb, base, merged, prefix, kept, kept_pos, probe, end

    def probe_logits(cache, probe, end):
        ids = torch.tensor(probe)
        return cache.forward(ForwardRequest(cache, ids, torch.arange(end, end + len(probe)), keep_kv=False))[0]

    def fresh(bb, prefix, kept, kept_pos):
        c = bb.new_cache()
        ids = prefix + [t for r in kept for t in r]
        pos = list(range(len(prefix))) + [p for r in kept_pos for p in r]
        c.forward(ForwardRequest(c, torch.tensor(ids), torch.tensor(pos), logits_at=None))
        return c

    def shape(o, case):
        bb, base, merged, prefix, kept, kept_pos, probe, end = run(o, case)
        want = len(prefix) + sum(map(len, kept))
        assert merged.n_rows() == 1 and merged.length() == want, \
            f"slots of {[len(r) for r in kept]} tokens after a prefix of {len(prefix)}: merged cache has {merged.n_rows()} rows of {merged.length()}, expected 1 of {want}"

    def first(o, case):
        bb, base, merged, prefix, kept, kept_pos, probe, end = run(o, case)
        merged.crop(len(prefix) + len(kept[0]))
        a = probe_logits(merged, probe, end)
        b = probe_logits(fresh(bb, prefix, kept[:1], kept_pos[:1]), probe, end)
        assert torch.allclose(a, b, atol=1e-4), f"after prefix + first slot {kept[0]} at {kept_pos[0]}: logits differ from a fresh forward by {float((a - b).abs().max()):.3g}"

    def exact_(o, case):
        bb, base, merged, prefix, kept, kept_pos, probe, end = run(o, case)
        a = probe_logits(merged, probe, end)
        b = probe_logits(fresh(bb, prefix, kept, kept_pos), probe, end)
        assert torch.allclose(a, b, atol=1e-4), (f"slots {kept} at positions {kept_pos} (buffer order): logits after the "
                                                 f"merged cache differ from a fresh forward by {float((a - b).abs().max()):.3g}")

    props = [(CACHE_SHAPE, shape, dict(o=opts, case=_merge_case())),
             (CACHE_FIRST, first, dict(o=opts, case=_merge_case()))]
    if exact:
        props.append((CACHE_EXACT, exact_, dict(o=opts, case=_merge_case())))
    return _run(CheckReport("cache", name), props, max_examples, raise_on_failure)


# -- proposer ---------------------------------------------------------------------------------------------------

PROPOSER_DRAFT = _contract("proposer", "propose(state, context, k, temperature, generator) gives a Draft of n <= k "
                                       "tokens: token ids [n] in 0..V-1, n their count, probs None or [n, V] "
                                       "distributions under which each drafted token has positive probability, and "
                                       "state.forwards counts the forward requests it made")
PROPOSER_SEEDED = _contract("proposer", "the same context and seeded generator give the same draft (at temperature 0 "
                                        "and above), and the context is not modified")
PROPOSER_ACCEPT = _contract("proposer", "after accept() with any number of accepted drafts and the target's token, "
                                        "over several verifications, the next draft at temperature 0 is a fresh "
                                        "proposer's on the longer context (its cache is cropped right)")


def _drive(steps):
    """Run a proposer's propose(): a Draft, or a generator of forward requests run each on its own cache.
    -> (the Draft, the number of requests it made)."""
    import inspect

    if not inspect.isgenerator(steps):
        return steps, 0
    from refusion.decoders.speculative import run_proposer

    runner, made, reply = run_proposer(steps, yielded=True), 0, None
    while True:
        try:
            request = runner.send(reply)
        except StopIteration as stop:
            return stop.value, made
        made += 1
        reply = request.cache.forward(request)


def bind_proposer(proposer, target):
    """``proposer`` beside the tiny ``target`` backbone, as the checks run it: a proposer with a model of its own
    that offers ``with_backbone(draft)`` (the built-in ``model`` and ``diffusion``) gets a tiny random draft
    model of its class's ``draft_attention`` (default causal) instead of loading ``options.model``."""
    if hasattr(proposer, "with_backbone"):
        proposer = proposer.with_backbone(backbone(getattr(type(proposer), "draft_attention", "causal"), seed=5,
                                                   layers=1))
    return proposer.bind(target)


def check_proposer(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                   raise_on_failure: bool = True, bind: Callable | None = None) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.Proposer` beside a tiny random causal target model, driving its
    forward requests itself. ``bind(proposer, target) -> proposer`` binds it (default :func:`bind_proposer`)."""
    cls, name = _resolve("proposer", cls_or_name, registry)
    opts = _options(cls, options)
    bind = bind or bind_proposer
    target = backbone()
    V = target.model.config.vocab_size

    def fresh(o):
        return bind(cls(o), target)

    def gen(seed):
        return torch.Generator(device=target.device).manual_seed(seed)

    def draft(o, context, k, temperature, seed):
        p = fresh(o)
        state = p.start(list(context))
        before = list(context)
        d, made = _drive(p.propose(state, context, k, temperature, gen(seed)))
        assert context == before, f"propose() modified the context {before} -> {context}"
        return d, made, state

    def shape(o, context, k, temperature):
        d, made, state = draft(o, context, k, temperature, 0)
        tokens = d.tokens
        assert isinstance(tokens, torch.Tensor) and tokens.dim() == 1 and tokens.shape[0] == d.n <= k, \
            f"context {context}, k {k}: {getattr(tokens, 'shape', tokens)} tokens, n = {d.n}; expected n <= k tokens [n]"
        if d.n:
            assert not tokens.is_floating_point() and ((tokens >= 0) & (tokens < V)).all(), \
                f"token ids {tokens.tolist()} are not vocabulary ids 0..{V - 1}"
        if d.probs is not None:
            assert d.probs.shape == (d.n, V), f"probs {tuple(d.probs.shape)}; expected [{d.n}, {V}]"
            assert torch.allclose(d.probs.sum(-1), torch.ones(d.n), atol=1e-4), f"probs rows sum to {d.probs.sum(-1).tolist()}"
            drawn = d.probs.gather(-1, tokens.long()[:, None])[:, 0]
            assert (drawn > 0).all(), f"drafted tokens {tokens.tolist()} have probabilities {drawn.tolist()} under probs"
        assert state.forwards == made, f"state.forwards is {state.forwards} after {made} forward requests"

    def seeded(o, context, k, temperature, seed):
        a, _, _ = draft(o, context, k, temperature, seed)
        b, _, _ = draft(o, context, k, temperature, seed)
        assert a.tokens.tolist() == b.tokens.tolist(), f"context {context}, seed {seed}: drafts {a.tokens.tolist()} then {b.tokens.tolist()}"

    def accept(o, prompt, k, data):
        p = fresh(o)
        state, context = p.start(list(prompt)), list(prompt)
        for _ in range(data.draw(st.integers(1, 3), label="verifications")):
            d, _ = _drive(p.propose(state, context, k, 0.0, gen(0)))
            a = data.draw(st.integers(0, d.n), label="accepted")
            token = data.draw(st.integers(*S.PROMPT_TOKENS), label="target's token")
            context = context + d.tokens.tolist()[:a] + [token]
            p.accept(state, context, a)
        ours, _ = _drive(p.propose(state, context, k, 0.0, gen(0)))
        other = fresh(o)
        theirs, _ = _drive(other.propose(other.start(list(context)), context, k, 0.0, gen(0)))
        assert ours.tokens.tolist() == theirs.tokens.tolist(), (
            f"context {context} after verifications: the proposer drafts {ours.tokens.tolist()}, a fresh one "
            f"{theirs.tokens.tolist()}")

    temperatures = st.sampled_from([0.0, 0.0, 0.7, 1.5])
    props = [(PROPOSER_DRAFT, shape, dict(o=opts, context=S.prompts(max_size=12), k=st.integers(1, 6),
                                          temperature=temperatures)),
             (PROPOSER_SEEDED, seeded, dict(o=opts, context=S.prompts(max_size=12), k=st.integers(1, 6),
                                            temperature=temperatures, seed=st.integers(0, 2**16))),
             (PROPOSER_ACCEPT, accept, dict(o=opts, prompt=S.prompts(max_size=10), k=st.integers(1, 5),
                                            data=st.data()))]
    return _run(CheckReport("proposer", name), props, max_examples, raise_on_failure)


# -- acceptance rule --------------------------------------------------------------------------------------------

ACCEPT_SHAPE = _contract("acceptance", "accept(logits [B, n+1, V], drafts [B, n], draft probs, temperature) gives "
                                       "accepted [B] in 0..n and next_token [B] in 0..V-1, integer tensors, and "
                                       "the inputs are not modified; sampling is a bool")
ACCEPT_ROWS = _contract("acceptance", "a function of its tensors: the same seeded generator gives the same decision, "
                                      "and a temperature-0 rule (sampling = False) decides each batch row as it "
                                      "decides that row alone")
ACCEPT_GREEDY = _contract("acceptance", "a temperature-0 rule (sampling = False) is AR greedy's: accepted is the "
                                        "longest prefix of drafts equal to the target's argmax, next_token the "
                                        "argmax after them")
ACCEPT_SAMPLED = _contract("acceptance", "a sampling rule (sampling = True) accepts every draft drawn from the "
                                         "target's own distribution softmax(logits / T), and its next token has "
                                         "positive probability under the residual norm(max(0, p - q)) after a "
                                         "rejection (under p where p = q, and after every draft passed)")


def check_acceptance(cls_or_name, options=None, max_examples: int | None = None, *, registry=None,
                     raise_on_failure: bool = True) -> CheckReport:
    """Check a :class:`~refusion.core.interfaces.AcceptanceRule` (speculative decoding's verification rule)."""
    from refusion.core.probs import tempered_softmax

    cls, name = _resolve("acceptance", cls_or_name, registry)
    opts = _options(cls, options)
    sampling = getattr(cls, "sampling", None)

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    def run(rule, inputs, seed=0):
        logits, drafts, probs, T = inputs
        return rule.accept(logits, drafts, probs, T, gen(seed))

    def shape(o, inputs):
        logits, drafts, probs, T = inputs
        before = [logits.clone(), drafts.clone()] + ([probs.clone()] if probs is not None else [])
        out = run(cls(o), inputs)
        B, n, V = drafts.shape[0], drafts.shape[1], logits.shape[-1]
        assert isinstance(sampling, bool), f"sampling is {sampling!r}; expected True or False"
        for what in ("accepted", "next_token"):
            t = getattr(out, what)
            assert isinstance(t, torch.Tensor) and t.shape == (B,) and not t.is_floating_point(), \
                f"{what} is {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}; expected an integer tensor [{B}]"
        assert ((out.accepted >= 0) & (out.accepted <= n)).all(), f"accepted {out.accepted.tolist()} outside 0..{n}"
        assert ((out.next_token >= 0) & (out.next_token < V)).all(), f"next_token {out.next_token.tolist()} outside 0..{V - 1}"
        _unchanged(before, [logits, drafts] + ([probs] if probs is not None else []), "accept()")

    def rows(o, inputs, seed):
        rule = cls(o)
        a, b = run(rule, inputs, seed), run(rule, inputs, seed)
        assert torch.equal(a.accepted, b.accepted) and torch.equal(a.next_token, b.next_token), \
            f"seed {seed}: accepted {a.accepted.tolist()} then {b.accepted.tolist()}, next {a.next_token.tolist()} then {b.next_token.tolist()}"
        if sampling:
            return  # a sampled decision: the rows share the generator's draws
        logits, drafts, probs, T = inputs
        for i in range(drafts.shape[0]):
            alone = run(rule, (logits[i:i + 1], drafts[i:i + 1], None if probs is None else probs[i:i + 1], T), seed)
            assert (int(alone.accepted[0]), int(alone.next_token[0])) == (int(a.accepted[i]), int(a.next_token[i])), (
                f"row {i} alone: accepted {int(alone.accepted[0])}, next {int(alone.next_token[0])}; in the batch of "
                f"{drafts.shape[0]}: accepted {int(a.accepted[i])}, next {int(a.next_token[i])}")

    def greedy(o, inputs):
        logits, drafts, probs, T = inputs
        out = run(cls(o), inputs)
        target = logits.argmax(-1)  # [B, n+1]
        for i in range(drafts.shape[0]):
            want = 0
            while want < drafts.shape[1] and int(drafts[i, want]) == int(target[i, want]):
                want += 1
            got = (int(out.accepted[i]), int(out.next_token[i]))
            assert got == (want, int(target[i, want])), (
                f"row {i}: drafts {drafts[i].tolist()}, target's argmax {target[i].tolist()}: accepted {got[0]} then "
                f"{got[1]}; AR greedy accepts {want} then {int(target[i, want])}")

    def sampled(o, inputs, seed, own):
        logits, drafts, probs, T = inputs
        p = tempered_softmax(logits, T)  # [B, n+1, V]
        B, n, V = drafts.shape[0], drafts.shape[1], logits.shape[-1]
        if own:  # drafts drawn from the target's own distributions: every one passes
            probs = p[:, :n].clone()
            drafts = torch.multinomial(probs.reshape(-1, V), 1, generator=gen(seed + 7)).view(B, n) if n else drafts
        out = run(cls(o), (logits, drafts, probs, T), seed)
        q = torch.zeros_like(p)
        if n:
            q[:, :n] = probs if probs is not None else torch.nn.functional.one_hot(drafts, V).float()
        for i in range(B):
            a, token = int(out.accepted[i]), int(out.next_token[i])
            if own:
                assert a == n, (f"row {i}: drafts {drafts[i].tolist()} drawn from the target's own distributions "
                                f"(q = p), accepted {a} of {n}")
            residual = (p[i, a] - q[i, a]).clamp_min(0)
            support = residual if a < n and float(residual.sum()) > 1e-6 else p[i, a]
            assert float(support[token]) > 0, (
                f"row {i}: accepted {a} of {n}, next token {token} has probability {float(support[token]):.3g} under "
                f"the {'residual max(0, p - q)' if support is residual else 'target'} at position {a} "
                f"(p {p[i, a].tolist()}, q {q[i, a].tolist()})")

    props = [(ACCEPT_SHAPE, shape, dict(o=opts, inputs=S.acceptance_inputs(sampling=bool(sampling)))),
             (ACCEPT_ROWS, rows, dict(o=opts, inputs=S.acceptance_inputs(sampling=bool(sampling)),
                                      seed=st.integers(0, 2**16)))]
    if sampling:
        props.append((ACCEPT_SAMPLED, sampled, dict(o=opts, inputs=S.acceptance_inputs(sampling=True),
                                                    seed=st.integers(0, 2**16), own=st.booleans())))
    elif sampling is False:
        props.append((ACCEPT_GREEDY, greedy, dict(o=opts, inputs=S.acceptance_inputs(sampling=False))))
    return _run(CheckReport("acceptance", name), props, max_examples, raise_on_failure)


# -- decoder ----------------------------------------------------------------------------------------------------

DECODER_INVARIANTS = _contract(
    "decoder", "every config drawn from the registry's parts and options, any prompt, EOS forced anywhere or "
               "nowhere: no [MASK] in the output, at most gen_length tokens, nothing after the first EOS (and a "
               "forced EOS ends the output), every output position committed once and the buffer restored by "
               "position is the output (positions past it only before an EOS or past gen_length), nothing "
               "committed outside the generation span (gen_length, padded to whole slots where the decoder pads) "
               "nor, once an EOS is committed, after it, NFE equals the model's forward calls, the same seed "
               "decodes the same, the streamed commits are the output left to right, and each sequence of a "
               "batch decodes as alone")


def _stream(dec, prompt):
    steps, commits = dec.stream(prompt), []
    while True:
        try:
            commits.append(next(steps))
        except StopIteration as stop:
            return commits, stop.value


def decoder_invariants(bb, cfg: dict, prompt: list[int], other: list[int], eos_at: int | None, registry=None) -> None:
    """Assert the decoder invariants (:data:`CONTRACTS` ``["decoder"]``) for one config and prompt pair."""
    from refusion.core.config import build_decoder
    from refusion.testing.models import ban_token, force_token

    hooks = [ban_token(bb.model, bb.eos_id)]
    if eos_at is not None:
        hooks.append(force_token(bb.model, len(prompt) + eos_at, bb.eos_id, boost=2e4, mask_id=bb.mask_id))
    calls = []
    hooks.append(bb.model.register_forward_pre_hook(lambda m, a: calls.append(1)))
    try:
        try:
            dec = build_decoder(bb, cfg, registry)
        except ValueError:  # a combination the decoder refuses when built (e.g. block's pipeline + a slot selector)
            from hypothesis import assume

            assume(False)
        commits, res = _stream(dec, prompt)
        again = dec.generate(prompt)
        n_calls = len(calls)
        alone_other = dec.generate(other)
        batch = dec.generate_batch([prompt, other])
    finally:
        for h in hooks:
            h.remove()
    ids = res.token_ids
    ctx = f"config {cfg}, prompt {prompt}, EOS forced at {eos_at}: output {ids}"
    assert bb.mask_id not in ids, f"{ctx}: [MASK] ({bb.mask_id}) in the output"
    assert len(ids) <= cfg["gen_length"], f"{ctx}: {len(ids)} tokens > gen_length {cfg['gen_length']}"
    assert all(t not in bb.eos_ids for t in ids[:-1]), f"{ctx}: tokens after the first EOS"
    if eos_at is not None and eos_at < cfg["gen_length"]:
        assert len(ids) == eos_at + 1 and ids[-1] == bb.eos_id, f"{ctx}: the forced EOS does not end the output"
    if res.buffer_pos:
        P = len(prompt)
        gen = sorted(res.buffer_pos[P:])
        assert len(set(gen)) == len(gen), f"{ctx}: a position committed twice: {gen}"
        beyond = [p for p in gen if p >= P + len(ids)]
        ended = bool(ids) and (ids[-1] in bb.eos_ids or len(ids) == cfg["gen_length"])
        assert set(range(P, P + len(ids))) <= set(gen) and (not beyond or ended), \
            (f"{ctx}: committed positions {gen} are not the output's prefix range (positions past it only when "
             "the output ends with EOS or at gen_length: slots committed before the EOS, or slot padding)")
        restored = [t for _, t in sorted(zip(res.buffer_pos, res.buffer_ids))][P:]
        assert restored[: len(ids)] == ids, f"{ctx}: the buffer restored by position is {restored}"
        span = getattr(dec.options, "padded_length", cfg["gen_length"])  # refusion pads to whole slots
        assert all(p < P + span for p in gen), f"{ctx}: committed positions {gen} past the generation span {span}"
        eos_pos = None  # the leftmost EOS committed so far, in commit (buffer) order
        for p, t in zip(res.buffer_pos[P:], res.buffer_ids[P:]):
            assert eos_pos is None or p < eos_pos, \
                f"{ctx}: position {p} committed after an EOS was committed at {eos_pos} (decoding past the EOS)"
            if t in bb.eos_ids:
                eos_pos = p
    assert res.stats.nfe + again.stats.nfe == n_calls, f"{ctx}: NFE {res.stats.nfe} + {again.stats.nfe} != {n_calls} model calls"
    assert again.token_ids == ids, f"{ctx}: decoded {again.token_ids} the second time"
    positions = [p for c in commits for p in c.positions]
    assert positions == list(range(len(prompt), len(prompt) + len(ids))), f"{ctx}: commits at positions {positions}"
    assert [t for c in commits for t in c.token_ids] == ids, f"{ctx}: streamed {[c.token_ids for c in commits]}"
    got = [r.token_ids for r in batch]
    assert got == [ids, alone_other.token_ids], (f"{ctx}: in a batch with prompt {other} the outputs are {got}, "
                                                 f"alone {[ids, alone_other.token_ids]}")


def check_decoder(name: str, max_examples: int | None = None, *, registry=None, parts: dict[str, list[str]] | None = None,
                  raise_on_failure: bool = True) -> CheckReport:
    """Check registered decoder ``name`` on a tiny random model of its attention kind, over configs drawn
    from the registry (:func:`~refusion.testing.strategies.decoder_configs`; ``parts`` limits the part
    names drawn per kind)."""
    from refusion.core.registry import get_registry

    reg = registry or get_registry()
    dec_cls = reg.get("decoder", name)
    bb = backbone(dec_cls.attention[0])

    def invariants(cfg, prompt, other, eos_at):
        decoder_invariants(bb, cfg, prompt, other, eos_at, reg)

    props = [(DECODER_INVARIANTS, invariants,
              dict(cfg=S.decoder_configs(name, reg, parts), prompt=S.prompts(), other=S.prompts(),
                   eos_at=st.one_of(st.none(), st.integers(0, S.MAX_GEN_LENGTH + 2))))]
    return _run(CheckReport("decoder", name), props, max_examples, raise_on_failure)


#: kind -> its check
CHECKS: dict[str, Callable[..., CheckReport]] = {
    "scorer": check_scorer, "selector": check_selector, "verifier": check_verifier, "extender": check_extender,
    "cache": check_cache_manager, "remasker": check_remasker, "drafter": check_drafter,
    "proposer": check_proposer, "acceptance": check_acceptance,
}


def check_part(kind: str, cls_or_name, options=None, max_examples: int | None = None, **kw: Any) -> CheckReport:
    """The check of ``kind`` (``decoder`` included) on a class or registered name."""
    if kind == "decoder":
        return check_decoder(cls_or_name, max_examples, **kw)
    if kind not in CHECKS:
        raise ValueError(f"no check for part kind {kind!r}; checked kinds: {', '.join([*CHECKS, 'decoder'])}")
    return CHECKS[kind](cls_or_name, options, max_examples, **kw)
