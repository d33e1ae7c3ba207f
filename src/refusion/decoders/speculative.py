"""Speculative decoding (Leviathan et al. 2023, Chen et al. 2023): AR decoding of a target model that
checks several proposed tokens per forward, lossless (greedy: AR greedy's tokens; sampled: AR sampling's
distribution).

Per verification, for a sequence whose verified prefix is ``context`` (prompt + accepted output):

    propose  the proposer (a registered part, :class:`~refusion.core.interfaces.Proposer`: ``ngram``
             prompt lookup, a ``model`` drafter, a ``diffusion`` drafter) gives n <= k tokens d_1..d_n
             after the context, with the distributions they were drawn from when it samples
    verify   ONE target forward of [pending + d_1..d_n]: ``pending`` are the context's tokens the target's
             cache does not hold (the prompt at the first verification, the last accepted token after);
             logits at the last pending token and at every draft, ``[n+1, V]``: row i predicts the token
             after d_i (row 0: after the context)
    accept   temperature 0: the longest prefix of drafts equal to the target's argmax, then the target's
             argmax after it (the correction, or the bonus token when all n pass): AR greedy's tokens.
             temperature > 0: speculative sampling's rejection rule: d_i is accepted with probability
             min(1, p_i(d_i) / q_i(d_i)) (p: the target's softmax(logits / T), q: the proposer's
             distribution, a point mass for a deterministic proposer); at the first rejection the token is
             drawn from norm(max(0, p_i - q_i)), after n acceptances the bonus token from p_n; the output
             follows p exactly
    crop     the target's cache back to context + accepted drafts (the last new token is pending); the
             proposer crops its own (:meth:`~refusion.core.interfaces.Proposer.accept`)

One host read per verification (the target's tokens or acceptance marks, the drafts) and one commit of
the new tokens. ``k`` is fixed (``schedule: constant``) or acceptance-driven (``schedule: heuristic``,
transformers' rule for assistant models: k + 2 after a verification that accepts every draft, k - 1
otherwise, at least 1). Drafts never exceed the tokens left to generate minus one (the target's own token).

Batched: the one loop per sequence runs under :func:`~refusion.core.loop.run_loops`; the target's
verify forwards of every sequence share one model call over a
:class:`~refusion.models.kvcache.RaggedCache` (rows of different lengths and different n). A proposer
with a model (``model``, ``diffusion``) yields its forwards as requests of its own group on its rows of a
second RaggedCache, the drafter's (:class:`PairedCache` routes each model call to the cache its requests
belong to), so the drafter's forwards of every sequence waiting on one share a model call too. Alone,
those requests run on the sequence's own cache of the drafter.

Stats (``DecodeStats.extra``): ``verifications`` (target forwards), ``drafted`` and ``accepted`` draft
tokens, ``acceptance_rate`` (accepted / drafted), ``mean_accepted_length`` (tokens committed per
verification, the target's own token included), ``draft_forwards`` (the proposer model's forward calls),
``target_tokens_fed_per_token`` (tokens fed to the target per generated token, the prompt included).
"""

from __future__ import annotations

import inspect
from typing import Literal

import torch
from pydantic import Field

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host
from refusion.core.interfaces import DecoderOptions, Draft
from refusion.core.loop import Commit, ForwardRequest, LoopSteps, Read, run_loops
from refusion.core.probs import row_argmax
from refusion.core.types import IterationTrace, LoopOutput
from refusion.decoders.common import LoopDecoder, cut_after_eos
from refusion.models.kvcache import RaggedCache


def run_proposer(steps, yielded: bool) -> LoopSteps:
    """Run a proposer's generator of forward requests: passed on to the loop's driver when ``yielded`` (its
    cache is part of the batch's), else each run here on the proposer's own cache. -> its Draft."""
    reply = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = (yield request) if yielded else request.cache.forward(request)


class PairedCache:
    """The batch cache (:class:`~refusion.core.loop.BatchCache`) of a speculative batch: the target's
    :class:`~refusion.models.kvcache.RaggedCache` and the drafter's (or None). New views are the target's;
    a model call runs on the cache its requests' views belong to (the drafter's requests have their own
    ``group``, so a call never mixes the two)."""

    def __init__(self, target: RaggedCache, drafter: RaggedCache | None) -> None:
        self.target, self.drafter = target, drafter

    def new_view(self):
        return self.target.new_view()

    def forward(self, requests):
        owner = requests[0].cache.owner
        if any(r.cache.owner is not owner for r in requests):
            raise ValueError("one model call of a speculative batch mixes the target's and the drafter's requests")
        return owner.forward(requests)

    def release(self, view) -> None:
        view.owner.release(view)

    def row_order(self, view) -> int:
        return view.owner.row_order(view)


class SpeculativeOptions(DecoderOptions):
    k: int = Field(4, ge=1, le=256, description="tokens proposed per verification (the first value when adaptive)")
    schedule: Literal["constant", "heuristic"] = Field(
        "constant", description="constant k, or transformers' 'heuristic': k + 2 after a verification that accepts "
        "every draft, k - 1 (at least 1) otherwise")
    k_max: int = Field(32, ge=1, le=256, description="the heuristic schedule's largest k")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy; > 0: speculative sampling at this "
                               "temperature (lossless in distribution)")
    proposer: PartSpec = PartSpec(name="ngram")


class SpeculativeDecoder(LoopDecoder):
    name = "speculative"
    Options = SpeculativeOptions
    attention = ("causal",)

    def __init__(self, backbone, options, parts) -> None:
        super().__init__(backbone, options, parts)
        self.proposer = parts["proposer"] = parts["proposer"].bind(backbone)

    def _decode_batch(self, prompts, generator, on_commit=None):
        """The loops of :class:`LoopDecoder`, over a cache that holds the target's rows and, for a proposer
        with a model, the drafter's (:class:`PairedCache`): the drafter's forwards are batched too."""
        target = RaggedCache(self.backbone)
        drafter = self.proposer.new_batch_cache()
        shared = PairedCache(target, drafter)
        loops = [self._loop(p, self.new_generator(), target.new_view(),
                            draft_cache=drafter.new_view() if drafter is not None else None) for p in prompts]
        outs = run_loops(loops, shared, on_commit=on_commit)
        for out in outs:  # run_loops counted the drafter's forwards too: nfe is the target's
            out.nfe = out.extra["verifications"]
        return outs

    def _loop(self, prompt_ids, generator, cache, draft_cache=None) -> LoopSteps:
        """One sequence's decode on the target's ``cache``; ``draft_cache``: its rows of the drafter's batch
        cache, whose requests are yielded (None: the proposer's requests run here, on its own cache)."""
        bb, opt = self.backbone, self.options
        P = len(prompt_ids)
        context = list(prompt_ids)  # the verified prefix (host ints)
        pending = P  # its last `pending` tokens are not in the target's cache yet
        state = (self.proposer.start(list(prompt_ids)) if draft_cache is None
                 else self.proposer.start(list(prompt_ids), draft_cache))
        shared_drafter = draft_cache is not None
        k = opt.k
        out: list[int] = []
        trace: list[IterationTrace] = []
        drafted = accepted_total = fed = 0
        while True:
            L, room = len(context), opt.gen_length - len(out)
            n_max = min(k, room - 1)
            forwards0 = state.forwards
            draft = Draft(torch.empty(0, dtype=torch.long, device=bb.device), 0)
            if n_max > 0:
                draft = self.proposer.propose(state, context, n_max, opt.temperature, generator)
                if inspect.isgenerator(draft):  # a proposer with a model: its forward requests
                    draft = yield from run_proposer(draft, shared_drafter)
            n = draft.n
            draft.tokens = draft.tokens.to(torch.long)  # [n] (an empty list from the host is float)
            ids = torch.cat([from_host(context[L - pending:], bb.device, torch.long), draft.tokens])  # [pending + n]
            pos = torch.arange(L - pending, L + n)  # [pending + n]
            logits = yield ForwardRequest(cache, ids, pos, logits_at=slice(pending - 1, None))  # [1, n + 1, V]
            fed += pending + n
            if opt.temperature == 0:
                a, new = yield from self._accept_greedy(logits[0], draft)
            else:
                a, new = yield from self._accept_sampled(logits[0], draft, generator)
            new = cut_after_eos(new, bb.eos_ids)[:room]
            out += new
            context += new
            yield Commit(list(range(L, L + len(new))), new)
            drafted += n
            accepted_total += min(a, len(new))
            trace.append(IterationTrace(block=0, stage="spec", scored=[], chosen=list(range(L, L + n)),
                                        accepted=[(L, len(new))], forwards=1 + state.forwards - forwards0))
            if new[-1] in bb.eos_ids or len(out) >= opt.gen_length:
                break
            cache.crop(L + a)  # context + accepted drafts; the last new token is pending
            pending = 1
            self.proposer.accept(state, context, a)
            k = self._next_k(k, a, n)
        verifications = len(trace)
        extra = {
            "verifications": verifications, "drafted": drafted, "accepted": accepted_total,
            "acceptance_rate": accepted_total / drafted if drafted else 0.0,
            "mean_accepted_length": len(out) / verifications if verifications else 0.0,
            "draft_forwards": state.forwards,
            "target_tokens_fed_per_token": fed / len(out) if out else 0.0,  # no padding (a batch pads rows)
        }
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))), extra=extra)

    # ------------------------------------------------------------------ verification rules
    def _accept_greedy(self, logits, draft: Draft):
        """``logits [n+1, V]`` -> (drafts accepted a, the new tokens: d_1..d_a + the target's argmax after)."""
        target = row_argmax(logits)  # [n+1]
        t, d = yield Read((target, draft.tokens))
        a = 0
        while a < draft.n and d[a] == t[a]:
            a += 1
        return a, d[:a] + [t[a]]

    def _accept_sampled(self, logits, draft: Draft, generator):
        """Speculative sampling's rejection rule over ``logits [n+1, V]`` -> (a, the new tokens)."""
        n, dev = draft.n, logits.device
        p = torch.softmax(logits / self.options.temperature, dim=-1)  # [n+1, V] the target's distributions
        q = torch.zeros_like(p)  # [n+1, V] the proposer's; row n (the bonus position) stays 0
        if n:  # a deterministic proposer's distribution: a point mass on its token
            q[:n] = draft.probs if draft.probs is not None else \
                torch.nn.functional.one_hot(draft.tokens, p.shape[-1]).to(p.dtype)
        rows = torch.arange(n, device=dev)
        p_d, q_d = p[rows, draft.tokens], q[rows, draft.tokens]  # [n] each
        u = torch.rand(n, generator=generator, device=generator.device).to(dev)  # [n]
        ok = u * q_d < p_d  # [n]: accept d_i with probability min(1, p/q)
        residual = (p - q).clamp_min(0)  # [n+1, V]
        z = residual.sum(-1, keepdim=True)
        residual = torch.where(z > 0, residual / z.clamp_min(torch.finfo(p.dtype).tiny), p)  # p == q: draw from p
        resampled = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [n+1]
        ok_h, r, d = yield Read((ok, resampled, draft.tokens))
        a = 0
        while a < n and ok_h[a]:
            a += 1
        return a, d[:a] + [r[a]]

    def _next_k(self, k: int, accepted: int, drafted: int) -> int:
        if self.options.schedule == "constant":
            return k
        return min(self.options.k_max, k + 2) if drafted and accepted == drafted else max(1, k - 1)


@hookimpl
def register_decoders(register):
    register("speculative", SpeculativeDecoder)
