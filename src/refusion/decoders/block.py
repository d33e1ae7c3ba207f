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
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator
from torch import Tensor

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Decoder, DecoderOptions
from refusion.core.types import IterationTrace, LoopOutput
from refusion.decoders.common import cut_after_eos
from refusion.decoders.llada import choose
from refusion.plugins.token_selectors import TokenSelector


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
    """``[1, 1, q, cached + q]`` additive mask of a chunk after ``cached`` cached tokens.

    ``seg [q]``: block index of each chunk token (-1 = prompt). A query attends to every cached token and
    to the chunk tokens whose block index is <= its own (itself bidirectionally, never a later block).
    """
    allowed = torch.cat([torch.ones(len(seg), cached, dtype=torch.bool), seg[None, :] <= seg[:, None]], dim=1)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class BlockDecoder(Decoder):
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

    def _decode(self, prompt_ids, generator):
        o: BlockOptions = self.options
        bb, B, sub = self.backbone, self.block_size, self.sub_block_size
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        P, nb = len(prompt_ids), math.ceil(o.gen_length / B)
        bb.check_length(P, nb * B)
        x = torch.tensor(list(prompt_ids) + [bb.mask_id] * (nb * B))  # [N]
        pos = torch.arange(len(x))
        seg = torch.tensor([-1] * P + [b for b in range(nb) for _ in range(B)])  # block index per position
        eos = torch.tensor(sorted(bb.eos_ids))
        cache = bb.new_cache() if o.kv_cache else None
        cached, started = 0, 1  # x[:cached] has its KV in cache; blocks [0, started) were started
        trace: list[IterationTrace] = []

        def masks(b: int) -> Tensor:
            return x[P + b * B : P + (b + 1) * B] == bb.mask_id  # [B]

        while True:
            finished = next((b for b in range(nb) if masks(b).any()), nb)  # leading clean blocks
            if finished == nb:
                break
            eos_seen = bool(torch.isin(x[P:], eos).any())
            decoded = 1.0 - float(masks(started - 1).float().mean())  # of the newest started block
            if o.pipeline and started < nb and not eos_seen and decoded >= o.pipeline_threshold:
                started += 1
            started = max(started, finished + 1)
            lo, hi = (cached if o.kv_cache else 0), P + started * B
            mask = block_causal_mask(seg[lo:hi], lo, bb.model.dtype)  # [1, 1, hi - lo, hi]
            logits = bb.forward(x[lo:hi], pos[lo:hi], cache, attn_mask=mask)[0]  # [hi - lo, V]
            if cache is not None:  # keep the KV of the clean prompt / finished blocks only
                cached = P + finished * B
                bb.crop(cache, cached)
            it = IterationTrace(block=finished, stage="block", scored=[], chosen=[], accepted=[], forwards=1)
            for j, b in enumerate(range(finished, started)):
                m = masks(b)
                if not m.any():
                    continue
                first = int(m.nonzero()[0]) // sub * sub  # first sub-block with a [MASK]
                pool = (m[first : first + sub]).nonzero().flatten() + P + b * B + first  # [n] absolute positions
                proposal = drafter.draft(logits[pool - lo][:, None], generator)  # [n, 1]
                scores = scorer.score(proposal)  # [n]
                idx = choose(selector, scores, None, at_least_one=j == 0)
                x[pool[idx]] = proposal.token_ids[idx, 0].cpu()
                it.scored += [(int(p), float(c)) for p, c in zip(pool, scores)]
                it.chosen += pool[idx].tolist()
                it.accepted += [(int(p), 1) for p in pool[idx]]
            trace.append(it)
            gen = x[P:]
            hits = torch.isin(gen, eos).nonzero().flatten()
            if len(hits) and not bool((gen[: int(hits[0])] == bb.mask_id).any()):
                break  # the output is decided: tokens after the first EOS are dropped
        out = cut_after_eos(x[P:].tolist(), bb.eos_ids)[: o.gen_length]
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))))


@hookimpl
def register_decoders(register):
    register("block", BlockDecoder)
