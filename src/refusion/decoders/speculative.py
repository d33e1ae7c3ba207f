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
    accept   the acceptance rule (a registered part, :class:`~refusion.core.interfaces.AcceptanceRule`,
             :mod:`refusion.plugins.acceptance`) gives the drafts accepted a and the token after them:
             ``greedy`` at temperature 0 (the longest prefix equal to the target's argmax, then its argmax:
             AR greedy's tokens), ``rejection_sampling`` at temperature > 0 (speculative sampling: the
             output follows the target's softmax(logits / T) exactly); the default follows ``temperature``
    crop     the target's cache back to context + accepted drafts (the last new token is pending); the
             proposer crops its own (:meth:`~refusion.core.interfaces.Proposer.accept`)

The cache handling is not a part: the target's cache is cropped to the accepted prefix (in a causal model
the verify forward's KV of the accepted drafts is the KV of those tokens after the context, nothing to
recompute), and a drafter's cache is its proposer's own state, cropped in its ``accept``.

One host read per verification (the accepted count, the next token, the drafts) and one commit of
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
from pydantic import Field, model_validator

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host
from refusion.core.interfaces import DecoderOptions, Draft
from refusion.core.loop import Commit, ForwardRequest, LoopSteps, Read
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
    acceptance: PartSpec = Field(PartSpec(name="greedy"), description="the verification rule: greedy (temperature 0) "
                                 "or rejection_sampling (temperature > 0); unset: the one for the temperature")

    @model_validator(mode="after")
    def _acceptance_for_the_temperature(self) -> "SpeculativeOptions":
        if "acceptance" not in self.model_fields_set and self.temperature > 0:
            self.acceptance = PartSpec(name="rejection_sampling")
        return self


class SpeculativeDecoder(LoopDecoder):
    name = "speculative"
    Options = SpeculativeOptions
    attention = ("causal",)
    batch_by_batch_loop = True

    def __init__(self, backbone, options, parts) -> None:
        super().__init__(backbone, options, parts)
        self.proposer = parts["proposer"] = parts["proposer"].bind(backbone)
        self.acceptance = parts["acceptance"]

    @classmethod
    def check_parts(cls, options, parts) -> None:
        rule = parts["acceptance"]
        if rule.sampling != (options.temperature > 0):
            needs = "temperature > 0" if rule.sampling else "temperature 0"
            other = "greedy" if rule.sampling else "rejection_sampling"
            raise ValueError(f"acceptance {options.acceptance.name!r} decodes at {needs}, but temperature is "
                             f"{options.temperature:g}: set temperature, or acceptance (e.g. {other!r}), or leave "
                             "acceptance unset to take the temperature's rule")

    def new_batch_cache(self) -> PairedCache:
        """The shared cache of a running batch: the target's rows and, for a proposer with a model, the
        drafter's (:class:`PairedCache`), so the drafter's forwards are batched too."""
        return PairedCache(RaggedCache(self.backbone), self.proposer.new_batch_cache())

    def batch_loop(self, prompt_ids, generator, batch_cache: PairedCache) -> LoopSteps:
        """One sequence's loop on new views of ``batch_cache``: the target's, and the drafter's when this
        decoder's proposer runs the batch's drafter model (else the proposer runs on a cache of its own, as
        a request of a server whose options name another proposer does)."""
        drafter = batch_cache.drafter
        shared = drafter is not None and getattr(self.proposer, "draft", None) is drafter.backbone
        return self._loop(prompt_ids, generator, batch_cache.target.new_view(),
                          draft_cache=drafter.new_view() if shared else None)

    def _decode_batch(self, prompts, generator, on_commit=None):
        """The loops of :class:`LoopDecoder` over :meth:`new_batch_cache`; ``nfe``: the target's forwards."""
        outs = super()._decode_batch(prompts, generator, on_commit)
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
            verdict = self.acceptance.accept(logits, draft.tokens[None], None if draft.probs is None else
                                             draft.probs[None], opt.temperature, generator)  # [1] each
            a, token, d = yield Read((verdict.accepted[0], verdict.next_token[0], draft.tokens))
            new = cut_after_eos(d[:a] + [token], bb.eos_ids)[:room]
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

    def _next_k(self, k: int, accepted: int, drafted: int) -> int:
        if self.options.schedule == "constant":
            return k
        return min(self.options.k_max, k + 2) if drafted and accepted == drafted else max(1, k - 1)


@hookimpl
def register_decoders(register):
    register("speculative", SpeculativeDecoder)
