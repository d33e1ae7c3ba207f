"""Block diffusion decoding (BD3-LM, arXiv 2503.09573; Fast-dLLM v2) for a block-causal model.

The generation span is cut into blocks of ``block_size`` (default: the model's ``refusion_block_size``)
right after the prompt. Attention is block-causal: the prompt attends to itself, a block to the prompt,
every earlier block and (bidirectionally) itself, never to a later block; the KV of the prompt and of
finished blocks is cached::

    cache = []; x = prompt + [MASK] * (n_blocks * block_size)
    while a block is unfinished:
        window = blocks started and unfinished           # one block; more with pipeline
        chunk  = (tokens not yet cached: prompt / just-finished blocks, clean) + window blocks
        logits = forward(chunk, after cache, block-causal mask); keep the KV of the clean part only
        for each window block (oldest first):
            pool   = its [MASK]s (in the first unfinished sub-block of sub_block_size)
            draft  = drafter(logits[pool]); scores = scorer(draft)
            commit pool[selector(scores)]                 # oldest block: at least one token
        stop if a committed EOS has no [MASK] before it

So a finished block's KV is written by the next forward, fused with the first step of the next block
(exact: the clean tokens' mask rows never see the noisy ones), and the prompt prefill rides with block 0:
no extra forward. ``kv_cache: false`` forwards the whole sequence every step (same logits, a check).

``pipeline`` (D2F-style): block b+1 is started (drafted together with the window) once the newest started
block is at least ``pipeline_threshold`` decoded, at most one new block per step, and no new block once
an EOS is committed. Only the oldest window block is forced to commit a token each step; younger ones
commit only what their selector passes (TokenSelector with ``at_least_one=False``). A window block
attends to the partly-masked older window blocks (D2F's layout).

Data path: the sequence, positions, masks, logits, proposals, scores, selections and commits live on
the model's device. Each forward computes logits only for the window blocks' rows (never the prompt's
or a finished block's). The loop keeps a host copy of the sequence, so the window, the pools and the
stopping test need no device read. Host synchronisations: one per step
(= per forward), its one :func:`~refusion.core.host.to_host` read of every pool's scores, which of
them were chosen and the drafted tokens; plus the finiteness check of
:meth:`~refusion.core.interfaces.Decoder.generate`: NFE + 1 per decode. The output needs no further read.

The loop is one generator (:meth:`BlockDecoder._loop`) of forward requests (block-causal attention),
reads and commits (the committed left-to-right prefix of the output, as it grows). Batched
(:meth:`~refusion.core.interfaces.Decoder.generate_batch`), :func:`~refusion.core.loop.run_loops` runs
one such loop per sequence over one :class:`~refusion.models.kvcache.RaggedCache`: each sequence keeps
its own window, pools, pipeline and cache length, so rows may be at different blocks; a step of the
batch is one step of every sequence still decoding, in ONE model call that feeds each row its own chunk
(right-padded to the longest), with ONE host read for the whole batch. A finished sequence leaves the
batch. Each sequence samples from its own generator, so a batched decode draws what its single decode
draws; greedy, the two agree except at floating-point near-ties (padding and batch shape change
reduction order).
"""

from __future__ import annotations

import math
import struct

import torch
from pydantic import Field, model_validator

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host
from refusion.core.interfaces import DecoderOptions, TokenSelector
from refusion.core.loop import Attention, ForwardRequest, LoopSteps, Read
from refusion.core.types import IterationTrace
from refusion.decoders.common import FinalPrefix, LoopDecoder, cut_after_eos
from refusion.decoders.llada import choose, decided


class BlockOptions(DecoderOptions):
    block_size: int | None = Field(None, ge=1, description="tokens per block (None = config.refusion_block_size)")
    sub_block_size: int | None = Field(None, ge=1, description="sub-blocks decoded left to right (Fast-dLLM v2)")
    kv_cache: bool = Field(True, description="reuse the KV of the prompt and finished blocks")
    pipeline: bool = Field(False, description="D2F-style: draft the next block before this one is finished")
    pipeline_threshold: float = Field(0.7, gt=0.0, le=1.0, description="newest block's decoded fraction to start the next")
    drafter: PartSpec = PartSpec(name="gumbel")
    scorer: PartSpec = PartSpec(name="first_token_prob")
    selector: PartSpec = PartSpec(name="confidence_threshold")

    @model_validator(mode="after")
    def _sub_divides(self) -> "BlockOptions":
        if self.block_size and self.sub_block_size and self.block_size % self.sub_block_size:
            raise ValueError(f"sub_block_size={self.sub_block_size} must divide block_size={self.block_size}")
        return self


def decoded_fraction(masked: int, size: int) -> float:
    """Share of a block's ``size`` tokens committed when ``masked`` remain: one minus the float32 mean of
    its [MASK] flags (``masked / size`` rounded to float32), the value ``pipeline_threshold`` is compared with."""
    return 1.0 - struct.unpack("f", struct.pack("f", masked / size))[0]


class BlockDecoder(LoopDecoder):
    name = "block"
    Options = BlockOptions
    attention = ("block_causal",)

    def __init__(self, backbone, options, parts):
        super().__init__(backbone, options, parts)
        B = options.block_size or getattr(backbone.model.config, "refusion_block_size", None)
        if not B:
            raise ValueError("decoder 'block' needs block_size: set it, or use a model with config.refusion_block_size")
        sub = options.sub_block_size or B
        if B % sub:
            raise ValueError(f"sub_block_size={sub} must divide block_size={B}")
        if options.pipeline and not isinstance(parts["selector"], TokenSelector):
            raise ValueError("pipeline needs a token selector (confidence_threshold, factor, topk_per_step) "
                             f"that can commit nothing in a younger block; got {type(parts['selector']).__name__}")
        self.block_size, self.sub_block_size = int(B), int(sub)

    def _loop(self, prompt_ids, generator, cache) -> LoopSteps:
        """One sequence's decode on ``cache``; yields its forwards (block-causal), host reads and commits."""
        o: BlockOptions = self.options
        bb, B, sub = self.backbone, self.block_size, self.sub_block_size
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        P, nb, dev, mask_id = len(prompt_ids), math.ceil(o.gen_length / B), bb.device, bb.mask_id
        bb.check_length(P, nb * B)
        tokens = list(prompt_ids) + [mask_id] * (nb * B)  # host copy of x, updated from each step's read
        x = from_host(tokens, dev)  # [N] long
        pos = torch.arange(len(tokens), device=dev)  # [N]
        seg = [-1] * P + [b for b in range(nb) for _ in range(B)]  # block index per position (-1 = prompt)
        masked = [B] * nb  # [MASK]s left per block
        eos_seen = False  # an EOS has been committed
        cached, started = 0, 1  # x[:cached] has its KV in cache; blocks [0, started) were started
        final = FinalPrefix(P, o.gen_length, bb.eos_ids)
        trace: list[IterationTrace] = []

        while True:
            finished = next((b for b in range(nb) if masked[b]), nb)  # leading clean blocks
            if finished == nb:
                break
            decoded = decoded_fraction(masked[started - 1], B)  # of the newest started block
            if o.pipeline and started < nb and not eos_seen and decoded >= o.pipeline_threshold:
                started += 1
            started = max(started, finished + 1)
            pools: list[list[int]] = []  # per window block with a [MASK]: its pool's positions, ascending
            for b in range(finished, started):
                start = P + b * B
                if masked[b]:  # the pool: the [MASK]s of the block's first sub-block that has one
                    first = next(i for i in range(B) if tokens[start + i] == mask_id) // sub * sub
                    pools.append([p for p in range(start + first, start + first + sub) if tokens[p] == mask_id])
            where = from_host([p for pool in pools for p in pool], dev)  # [n] every pool's positions
            lo, hi, w0 = cached, P + started * B, P + finished * B  # fed: x[lo:hi]; window: x[w0:hi]
            window = (yield ForwardRequest(cache, x[lo:hi], pos[lo:hi], keep_kv=o.kv_cache,
                                           attention=Attention.block_causal(seg[lo:hi]),
                                           logits_at=slice(w0 - lo, None)))[0]  # [hi - w0, V]
            logits = window[where - w0]  # [n, V]
            if o.kv_cache:  # keep the KV of the clean prompt / finished blocks only
                cached = w0
                cache.crop(cached)
            scores, chosen, drafted = [], [], []  # per pool: [n_j] tensors
            at = 0
            for j, pool in enumerate(pools):  # pools[0] is the oldest window block's: it commits at least one
                proposal = drafter.draft(logits[at : at + len(pool), None], generator)  # [n_j, 1]
                pool_scores = scorer.score(proposal)  # [n_j]
                pool_chosen = choose(selector, pool_scores, None, at_least_one=j == 0)  # [n_j] bool
                x[where[at : at + len(pool)]] = torch.where(pool_chosen, proposal.token_ids[:, 0], mask_id)
                scores.append(pool_scores)
                chosen.append(pool_chosen)
                drafted.append(proposal.token_ids[:, 0])
                at += len(pool)
            score_values, chosen_flags, drafted_ids = yield Read(  # the step's one read
                (torch.cat(scores), torch.cat(chosen), torch.cat(drafted)))
            it = IterationTrace(block=finished, stage="block", scored=[], chosen=[], accepted=[], forwards=1)
            at = 0
            for pool in pools:
                flags = chosen_flags[at : at + len(pool)]
                committed = [p for p, c in zip(pool, flags) if c]
                for p, t, c in zip(pool, drafted_ids[at : at + len(pool)], flags):
                    if c:
                        tokens[p] = t
                        masked[(p - P) // B] -= 1
                        eos_seen = eos_seen or t in bb.eos_ids
                final.learn(committed, [tokens[p] for p in committed])
                it.scored += list(zip(pool, score_values[at : at + len(pool)]))
                it.chosen += committed
                it.accepted += [(p, 1) for p in committed]
                at += len(pool)
            trace.append(it)
            if commit := final.commit():
                yield commit
            if decided(tokens[P:], mask_id, bb.eos_ids):
                break  # the output is decided: tokens after the first EOS are dropped
        return (yield from final.end(prompt_ids, cut_after_eos(tokens[P:], bb.eos_ids)[: o.gen_length], trace))


@hookimpl
def register_decoders(register):
    register("block", BlockDecoder)
