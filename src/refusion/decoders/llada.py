"""LLaDA-style masked-diffusion decoding (arXiv 2502.09992) with Fast-dLLM v1's caches and parallel rules.

For a bidirectional model. The generation span (``gen_length`` [MASK]s after the prompt) is cut into
semi-autoregressive blocks of ``block_length``; each block gets ``steps / num_blocks`` scheduled steps::

    x = prompt + [MASK] * gen_length
    for each block [s, e):
        budget = num_transfer_tokens(e - s, steps_per_block)   # LLaDA: even split, remainder to early steps
        i = 0
        while block has [MASK]:                                # one forward per step
            logits = forward(...)                              # see kv_cache below; no logits shift
            pool = masked positions of the block (position order)
            draft  = drafter(logits[pool])                     # argmax / float64 Gumbel-max, k = 1 slots
            scores = scorer(draft)  (low_confidence)  |  uniform random (random)
            commit pool[selector(scores, budget[i])]           # topk_per_step / confidence_threshold / factor
            i += 1
            stop if a committed EOS has no [MASK] before it    # early_stop: the output cannot change any more

``kv_cache`` (Fast-dLLM v1; the cache is rebuilt by a full forward at each block start and, with
``refresh_every = n``, at every n-th step of the block; that refresh step also decodes):

* ``none``   every step forwards the whole sequence (LLaDA);
* ``prefix`` KV of ``x[:s]`` from the refresh forward; other steps forward ``x[s:]`` (block + every later
  [MASK]) on top of it;
* ``dual``   KV of ``x[:s]`` and ``x[e:]`` from the refresh forward; other steps forward only the block.

Every forward attends everywhere (4D all-zero additive mask). The output is cut after the first EOS.

Shifted-logits models (``backbone.logits_shifted``: Dream, whose logits at position i predict token i+1
even at a [MASK] input) have their logits shifted right by one before use; in a cached window the first
position's prediction comes from the last full (refresh) forward, as D2F / dllm do.

Data path: the sequence, positions, logits, proposals, scores, selections and commits live on the
model's device. Each forward computes logits only for the current block's rows (shifted models: the
rows before them; a cached step takes the block start's prediction from the last refresh). The loop
keeps a host copy of the sequence, so the pool's positions, the schedule and the early-stop test need
no device read. Host synchronisations: one per step (= per forward), its one
:func:`~refusion.core.host.to_host` read of the pool's scores, which of them were chosen and the
drafted tokens; plus the finiteness check of :meth:`~refusion.core.interfaces.Decoder.generate`:
NFE + 1 per decode. The output needs no further read.

The loop is one generator (:meth:`LladaDecoder._loop`) of forward requests, reads and commits (the
committed left-to-right prefix of the output, as it grows). Batched
(:meth:`~refusion.core.interfaces.Decoder.generate_batch`), :func:`~refusion.core.loop.run_loops` runs
one such loop per sequence over one :class:`~refusion.models.kvcache.RaggedCache`: each sequence keeps
its own schedule (block, step, pool, budget, refreshes, early stop), so rows may be in different blocks;
a step of the batch is one step of every sequence still decoding, in at most two model calls (the rows
at a full forward, the rows at a cached step), with ONE host read for the whole batch. Each row holds its
own cache (a refresh keeps its KV, a cached step's KV is scratch) and attends to its own tokens only. A
finished sequence leaves the batch. Each sequence samples from its own generator, so with sampling
(drafter temperature > 0, or random remasking) a batched decode draws what its single decode draws;
greedy, the two agree except at floating-point near-ties (padding and batch shape change reduction
order).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host
from refusion.core.interfaces import DecoderOptions, Selector, TokenSelector
from refusion.core.loop import FULL, ForwardRequest, LoopSteps, Read
from refusion.core.types import IterationTrace
from refusion.decoders.common import FinalPrefix, LoopDecoder, cut_after_eos


class LladaOptions(DecoderOptions):
    steps: int | None = Field(None, ge=1, description="total diffusion steps (None = gen_length: one token per step)")
    block_length: int | None = Field(None, ge=1, description="semi-autoregressive block length (None = gen_length)")
    remasking: Literal["low_confidence", "random"] = Field("low_confidence", description="confidence = scorer | random")
    kv_cache: Literal["none", "prefix", "dual"] = Field("none", description="Fast-dLLM v1 cache mode")
    refresh_every: int = Field(0, ge=0, description="also rebuild the cache every n steps (0 = block start only)")
    early_stop: bool = Field(True, description="stop once a committed EOS has no [MASK] before it")
    drafter: PartSpec = PartSpec(name="gumbel")
    scorer: PartSpec = PartSpec(name="first_token_prob")
    selector: PartSpec = PartSpec(name="topk_per_step")

    @property
    def n_steps(self) -> int:
        return self.steps or self.gen_length

    @property
    def block(self) -> int:
        return self.block_length or self.gen_length

    @model_validator(mode="after")
    def _schedule_divides(self) -> "LladaOptions":
        G, L, T = self.gen_length, self.block, self.n_steps
        if G % L:
            allowed = [d for d in range(1, G + 1) if G % d == 0]
            raise ValueError(f"block_length={L} must divide gen_length={G}; allowed: {allowed}")
        nb = G // L
        if T % nb or T // nb > L:
            ok = [nb * j for j in range(1, L + 1)]
            raise ValueError(
                f"steps={T} must be a multiple of the number of blocks ({nb}) with at most block_length={L} steps "
                f"per block; allowed: {ok if len(ok) <= 12 else ok[:6] + ['...'] + ok[-3:]}"
            )
        return self


def num_transfer_tokens(n_masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens``: ``n_masked`` split over ``steps``, remainder to the early steps."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def choose(selector: Selector, scores: Tensor, budget: int | None, at_least_one: bool = True) -> Tensor:
    """``scores [n]`` of a pool -> ``[n]`` bool, True at the positions to commit. Token selectors also get
    the step's budget and ``at_least_one``; any other selector just the scores (it always chooses one)."""
    if isinstance(selector, TokenSelector):
        return selector.select(scores, budget=budget, at_least_one=at_least_one)
    return selector.select(scores)


def decided(generated: list[int], mask_id: int, eos_ids: set[int]) -> bool:
    """Whether a committed EOS has no [MASK] before it: the output up to that EOS cannot change any more."""
    for token in generated:
        if token in eos_ids:
            return True
        if token == mask_id:
            return False
    return False


class LladaDecoder(LoopDecoder):
    name = "llada"
    Options = LladaOptions
    attention = ("bidirectional",)

    def _loop(self, prompt_ids, generator, cache) -> LoopSteps:
        """One sequence's decode on ``cache``; yields its forwards (full attention; group ``full`` for a
        forward of the whole sequence, ``window`` for a cached step), host reads and commits."""
        o: LladaOptions = self.options
        bb = self.backbone
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        P, L, dev, mask_id = len(prompt_ids), o.block, bb.device, bb.mask_id
        tokens = list(prompt_ids) + [mask_id] * o.gen_length  # host copy of x, updated from each step's read
        N = len(tokens)
        x = from_host(tokens, dev)  # [N] long
        pos = torch.arange(N, device=dev)  # [N]
        steps_per_block = o.n_steps // (o.gen_length // L)
        shift = 1 if bb.logits_shifted else 0  # Dream: row i predicts token i+1
        final = FinalPrefix(P, o.gen_length, bb.eos_ids)
        trace: list[IterationTrace] = []
        head: Tensor | None = None  # [V] shifted models: the last full forward's prediction of the block start
        done = False
        for b in range(o.gen_length // L):
            s, e = P + b * L, P + (b + 1) * L
            budget = num_transfer_tokens(L, steps_per_block)
            pool = list(range(s, e))  # the block's [MASK] positions, ascending
            i = 0
            while not done and pool:
                refresh = i == 0 or (o.refresh_every > 0 and i % o.refresh_every == 0)
                if o.kv_cache == "none" or refresh:  # full forward; a refresh keeps the prefix (+ suffix) KV
                    cache.crop(0)
                    logits = (yield ForwardRequest(cache, x, pos, keep_kv=o.kv_cache != "none", attention=FULL,
                                                   logits_at=slice(s - shift, e - shift), group="full"))[0]  # [L, V]
                    if shift:
                        head = logits[0]  # the prediction of s, for the cached steps
                    if o.kv_cache == "prefix":
                        cache.crop(s)
                    elif o.kv_cache == "dual":
                        cache.drop_span(s, e)
                else:  # prefix: block + later masks after x[:s]; dual: only the block between x[:s] and x[e:]
                    end = N if o.kv_cache == "prefix" else e
                    rows = slice(0, L - 1) if shift else slice(0, L)  # Dream: s comes from the last refresh's head
                    window = yield ForwardRequest(cache, x[s:end], pos[s:end], keep_kv=False, attention=FULL,
                                                  logits_at=rows if rows.stop else None, group="window")
                    if shift:
                        logits = head[None] if window is None else torch.cat([head[None], window[0]])  # [L, V]
                    else:
                        logits = window[0]  # [L, V]
                where = from_host(pool, dev)  # [n] the pool's positions
                proposal = drafter.draft(logits[where - s][:, None], generator)  # [n, 1]
                if o.remasking == "random":
                    scores = torch.rand(len(pool), generator=generator, dtype=torch.float64, device=dev)  # [n]
                else:
                    scores = scorer.score(proposal)  # [n]
                chosen = choose(selector, scores, budget[i] if i < len(budget) else None)  # [n] bool
                drafted = proposal.token_ids[:, 0]  # [n]
                x[where] = torch.where(chosen, drafted, mask_id)
                score_values, chosen_flags, drafted_ids = yield Read((scores, chosen, drafted))  # the step's one read
                committed = [p for p, c in zip(pool, chosen_flags) if c]
                for p, t, c in zip(pool, drafted_ids, chosen_flags):
                    if c:
                        tokens[p] = t
                final.learn(committed, [tokens[p] for p in committed])
                if commit := final.commit():
                    yield commit
                trace.append(IterationTrace(
                    block=b, stage="mdm", scored=list(zip(pool, score_values)), chosen=committed,
                    accepted=[(p, 1) for p in committed], forwards=1,
                ))
                pool = [p for p, c in zip(pool, chosen_flags) if not c]
                i += 1
                done = o.early_stop and decided(tokens[P:], mask_id, bb.eos_ids)
            if done:
                break
        out = cut_after_eos(tokens[P:], bb.eos_ids)  # early stop leaves [MASK] only after the EOS
        return (yield from final.end(prompt_ids, out, trace))


@hookimpl
def register_decoders(register):
    register("llada", LladaDecoder)
