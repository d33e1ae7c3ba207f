"""The checks of speculative decoding's parts: a proposer (beside a tiny random target model, its
forward requests driven here) and an acceptance rule."""

from __future__ import annotations

from typing import Callable

import torch

from refusion.testing._hypothesis import st
import refusion.testing.strategies as S
import refusion.testing.checks.base as base
from refusion.testing.checks.base import CheckReport, _contract, _options, _resolve, _unchanged, backbone


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
    return base._run(CheckReport("proposer", name), props, max_examples, raise_on_failure)


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
    return base._run(CheckReport("acceptance", name), props, max_examples, raise_on_failure)
