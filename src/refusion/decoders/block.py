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

Batched (:meth:`~refusion.core.interfaces.Decoder.generate_batch`): the prompts are left-padded to one
width, so every row's blocks lie in the same columns (each row keeps its own position ids; padding keys
are masked out of every row, a padding query sees only itself). Each sequence runs its own loop (window,
pools, pipeline, cache length), so rows may be at different blocks: one step of the batch is one step of
every sequence still decoding, in ONE forward that feeds each row its own chunk (its uncached clean
tokens + its window blocks), right-padded to the longest. The KV lives in per-layer buffers in column
order (:class:`~refusion.models.ragged.OffsetLayer`): each row writes its chunk's KV at its own columns,
keeps the clean ones as its cache (a host integer per row, no crop) and attends with its own block-causal
``[b, 1, T, K]`` mask. Every row's pools are drafted in one call and scored together; each pool is
selected on its own, as in the single decode. Host reads: ONE :func:`~refusion.core.host.to_host` per
step for the whole batch (every pool's scores, chosen flags and drafted tokens), plus the finiteness
check. A finished sequence leaves the batch (its row of every tensor and buffer is dropped). Greedy, each
sequence decodes to the tokens of its single decode except at floating-point near-ties (padding and batch
shape change reduction order); sampled drafts (temperature > 0) come from one generator for the whole
batch, so they differ from a single decode's.
"""

from __future__ import annotations

import math
import struct
import time

import torch
from pydantic import Field, model_validator
from torch import Tensor

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host, to_host
from refusion.core.interfaces import Decoder, DecoderOptions, TokenSelector
from refusion.core.types import IterationTrace, LoopOutput
from refusion.decoders.common import BatchRows, cut_after_eos, fed_window, left_pad
from refusion.decoders.llada import choose, decided
from refusion.models.ragged import additive_mask, offset_cache


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


def block_causal_mask(seg: Tensor, cached: int, dtype: torch.dtype) -> Tensor:
    """``[1, 1, q, cached + q]`` additive mask of a chunk after ``cached`` cached tokens, on ``seg``'s device.

    ``seg [q]``: block index of each chunk token (-1 = prompt). A query attends to every cached token and
    to the chunk tokens whose block index is <= its own (itself bidirectionally, never a later block).
    """
    q = seg.shape[0]
    cached_keys = torch.ones(q, cached, dtype=torch.bool, device=seg.device)
    allowed = torch.cat([cached_keys, seg[None, :] <= seg[:, None]], dim=1)  # [q, cached + q]
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
    return blocked.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def decoded_fraction(masked: int, size: int) -> float:
    """Share of a block's ``size`` tokens committed when ``masked`` remain: one minus the float32 mean of
    its [MASK] flags (``masked / size`` rounded to float32), the value ``pipeline_threshold`` is compared with."""
    return 1.0 - struct.unpack("f", struct.pack("f", masked / size))[0]


class BlockDecoder(Decoder):
    name = "block"
    Options = BlockOptions
    attention = ("block_causal",)
    batched = True

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

    def _decode(self, prompt_ids, generator):
        o: BlockOptions = self.options
        bb, B, sub = self.backbone, self.block_size, self.sub_block_size
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        P, nb, dev, mask_id = len(prompt_ids), math.ceil(o.gen_length / B), bb.device, bb.mask_id
        bb.check_length(P, nb * B)
        tokens = list(prompt_ids) + [mask_id] * (nb * B)  # host copy of x, updated from each step's read
        x = from_host(tokens, dev)  # [N] long
        pos = torch.arange(len(tokens), device=dev)  # [N]
        seg = from_host([-1] * P + [b for b in range(nb) for _ in range(B)], dev)  # [N] block index per position
        masked = [B] * nb  # [MASK]s left per block
        eos_seen = False  # an EOS has been committed
        cache = bb.new_cache() if o.kv_cache else None
        cached, started = 0, 1  # x[:cached] has its KV in cache; blocks [0, started) were started
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
            lo, hi, w0 = (cached if o.kv_cache else 0), P + started * B, P + finished * B  # window: x[w0:hi]
            mask = block_causal_mask(seg[lo:hi], lo, bb.model.dtype)  # [1, 1, hi - lo, hi]
            window = bb.forward(x[lo:hi], pos[lo:hi], cache, attn_mask=mask, logits_at=slice(w0 - lo, None))[0]
            logits = window[where - w0]  # [n, V]
            if cache is not None:  # keep the KV of the clean prompt / finished blocks only
                cached = w0
                bb.crop(cache, cached)
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
            score_values, chosen_flags, drafted_ids = to_host(  # the step's one read
                torch.cat(scores), torch.cat(chosen), torch.cat(drafted))
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
                it.scored += list(zip(pool, score_values[at : at + len(pool)]))
                it.chosen += committed
                it.accepted += [(p, 1) for p in committed]
                at += len(pool)
            trace.append(it)
            if decided(tokens[P:], mask_id, bb.eos_ids):
                break  # the output is decided: tokens after the first EOS are dropped
        out = cut_after_eos(tokens[P:], bb.eos_ids)[: o.gen_length]
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))))

    def _decode_batch(self, prompts, generator):
        o: BlockOptions = self.options
        bb, B, sub = self.backbone, self.block_size, self.sub_block_size
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        nb, dev, mask_id = math.ceil(o.gen_length / B), bb.device, bb.mask_id
        for p in prompts:
            bb.check_length(len(p), nb * B)
        ids, _, _ = left_pad(prompts, bb.eos_id, dev)  # [n, W]: every row's blocks at the same columns
        n, W = ids.shape
        N = W + nb * B
        x = torch.cat([ids, torch.full((n, nb * B), mask_id, dtype=ids.dtype, device=dev)], dim=1)  # [b, N]
        state = BatchRows(x=x, pad=from_host([W - len(p) for p in prompts], dev))  # device tensors of the rows
        # host state per sequence, as in its single decode (gen: host copy of its blocks)
        gen = [[mask_id] * (nb * B) for _ in prompts]
        masked = [[B] * nb for _ in prompts]  # [MASK]s left per block
        eos_seen, started, cached = [False] * n, [1] * n, [0] * n  # cached: columns 0 .. cached-1 hold its KV
        traces: list[list[IterationTrace]] = [[] for _ in prompts]
        nfe, fed, finished_at = [0] * n, [0] * n, [None] * n
        rows = list(range(n))  # the sequence of each batch row

        while rows:
            lo, hi, w0, pools = [], [], [], []  # per row: fed columns lo .. hi-1; window w0 .. hi-1; its pools
            for q in rows:
                finished = next(b for b in range(nb) if masked[q][b])  # leading clean blocks (< nb: q is decoding)
                decoded = decoded_fraction(masked[q][started[q] - 1], B)  # of the newest started block
                if o.pipeline and started[q] < nb and not eos_seen[q] and decoded >= o.pipeline_threshold:
                    started[q] += 1
                started[q] = max(started[q], finished + 1)
                row_pools = []  # per window block with a [MASK]: its pool's columns, ascending
                for b in range(finished, started[q]):
                    start = b * B
                    if masked[q][b]:  # the pool: the [MASK]s of the block's first sub-block that has one
                        first = next(i for i in range(B) if gen[q][start + i] == mask_id) // sub * sub
                        span = range(start + first, start + first + sub)
                        row_pools.append([W + i for i in span if gen[q][i] == mask_id])
                pools.append(row_pools)
                lo.append(cached[q] if o.kv_cache else 0)
                hi.append(W + started[q] * B)
                w0.append(W + finished * B)
            T = max(h - l for l, h in zip(lo, hi))
            width = max(lo) + T
            lo_t, hi_t = from_host(lo, dev), from_host(hi, dev)
            cols, ids_f, pos_f = fed_window(state.x, state.pad, lo_t, hi_t, T, bb.eos_id)  # [b, T] each
            # block-causal in column order: query column c of row r sees key column j iff j is one of the row's
            # real columns fed so far (not padding, before hi) and j's block is not later than c's; and itself
            key = torch.arange(width, device=dev)
            seg_k = torch.where(key < W, -1, torch.div(key - W, B, rounding_mode="floor"))[None, None, :]  # -1 = prompt
            seg_q = torch.where(cols < W, -1, torch.div(cols - W, B, rounding_mode="floor"))[:, :, None]
            key = key[None, None, :]
            real = (key >= state.pad[:, None, None]) & (key < hi_t[:, None, None])  # [b, 1, width]
            allowed = (real & (seg_k <= seg_q)) | (key == cols[:, :, None])  # [b, T, width]
            if o.kv_cache:  # each row's new KV goes to its own columns; the clean ones stay as its cache
                if state.keys is None:
                    cfg = bb.model.config
                    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
                    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
                    state.new_buffers(heads, dim, int(cfg.num_hidden_layers), max(N, width), bb.model.dtype)
                state.grow(width)  # a row near the end fed with a longer row's width writes padding past N
                cache = offset_cache(state.keys, state.values, lo_t, T, width)
            else:
                cache = None
            a = min(w - l for w, l in zip(w0, lo))  # logits rows: every row's window
            window = bb.forward(ids_f, pos_f, cache, attn_mask=additive_mask(allowed, bb.model.dtype),
                                logits_at=slice(a, None))  # [b, T - a, V]
            flat = [(r, c) for r, row_pools in enumerate(pools) for pool in row_pools for c in pool]
            logits = window[from_host([r for r, _ in flat], dev), from_host([c - lo[r] - a for r, c in flat], dev)]
            for r, q in enumerate(rows):
                if o.kv_cache:  # keep the KV of the clean prompt / finished blocks only
                    cached[q] = w0[r]
                nfe[q] += 1
                fed[q] += T
            proposal = drafter.draft(logits[:, None], generator)  # [n_all, 1], all rows' pools in one call
            scores = scorer.score(proposal)  # [n_all]
            chosen_parts, at = [], 0
            for row_pools in pools:  # each pool selected on its own; a row's oldest window block commits at least one
                for j, pool in enumerate(row_pools):
                    chosen_parts.append(choose(selector, scores[at : at + len(pool)], None, at_least_one=j == 0))
                    at += len(pool)
            chosen = torch.cat(chosen_parts)  # [n_all] bool
            drafted = proposal.token_ids[:, 0]  # [n_all]
            state.x[from_host([r for r, _ in flat], dev), from_host([c for _, c in flat], dev)] = torch.where(
                chosen, drafted, mask_id)
            score_values, chosen_flags, drafted_ids = to_host(scores, chosen, drafted)  # the step's one read
            keep, at = [], 0
            for r, q in enumerate(rows):
                shift = W - len(prompts[q])  # column - shift = position
                it = IterationTrace(block=(w0[r] - W) // B, stage="block", scored=[], chosen=[], accepted=[],
                                    forwards=1)
                for pool in pools[r]:
                    flags = chosen_flags[at : at + len(pool)]
                    committed = [c - shift for c, f in zip(pool, flags) if f]
                    for c, t, f in zip(pool, drafted_ids[at : at + len(pool)], flags):
                        if f:
                            gen[q][c - W] = t
                            masked[q][(c - W) // B] -= 1
                            eos_seen[q] = eos_seen[q] or t in bb.eos_ids
                    it.scored += [(c - shift, v) for c, v in zip(pool, score_values[at : at + len(pool)])]
                    it.chosen += committed
                    it.accepted += [(p, 1) for p in committed]
                    at += len(pool)
                traces[q].append(it)
                if not any(masked[q]) or decided(gen[q], mask_id, bb.eos_ids):
                    finished_at[q] = time.perf_counter()
                else:
                    keep.append(r)
            if len(keep) < len(rows) and keep:  # finished sequences leave the batch
                state.select(from_host(keep, dev))
            rows = [rows[r] for r in keep]
        outs = []
        for q, prompt in enumerate(prompts):
            out = cut_after_eos(gen[q], bb.eos_ids)[: o.gen_length]
            outs.append(LoopOutput(out, traces[q], list(prompt) + out, list(range(len(prompt) + len(out))), nfe=nfe[q],
                                   tokens_in=fed[q], finished_at=finished_at[q]))
        return outs


@hookimpl
def register_decoders(register):
    register("block", BlockDecoder)
