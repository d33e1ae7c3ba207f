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

Batched (:meth:`~refusion.core.interfaces.Decoder.generate_batch`): the prompts are left-padded to one
width, so every row's generation span lies in the same columns (each row keeps its own position ids;
padding keys are masked out of every row, a padding query sees only itself). Each sequence runs its own
schedule (block, step, pool, budget, refreshes, early stop), so rows may be in different blocks; a step
of the batch is one step of every sequence still decoding, in at most two forwards: the rows at a full
step (no cache, or a refresh) feed every column, the rows at a cached step their own window (prefix:
block + later masks, right-padded to the longest; dual: the block) over their own cache. The caches are
per-layer buffers in column order (:class:`~refusion.models.ragged.OffsetLayer`): a refresh writes its rows' columns, a cached
step writes its window's KV in place (scratch, never kept), and each row's ``[b, 1, T, K]`` mask selects
its keys. Every row's pool logits are drafted in one call and scored together; each row's pool is
selected on its own (:func:`choose` with that row's budget). Host reads: ONE
:func:`~refusion.core.host.to_host` per step for the whole batch (every row's scores, chosen flags and
drafted tokens), plus the finiteness check. A finished sequence leaves the batch (its row of every
tensor and buffer is dropped). Greedy, each sequence decodes to the tokens of its single decode except
at floating-point near-ties (padding and batch shape change reduction order); with sampling (drafter
temperature > 0, or random remasking) the draws come from one generator for the whole batch, so they
differ from a single decode's.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host, to_host
from refusion.core.interfaces import Decoder, DecoderOptions, Selector, TokenSelector
from refusion.core.types import IterationTrace, LoopOutput
from refusion.decoders.common import BatchRows, cut_after_eos, fed_window, left_pad
from refusion.models.ragged import additive_mask, offset_cache


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


def full_mask(q: int, kv: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """``[1, 1, q, kv]`` additive mask letting every query attend to every key."""
    return torch.zeros(1, 1, q, kv, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------ batched decoding
class LladaDecoder(Decoder):
    name = "llada"
    Options = LladaOptions
    attention = ("bidirectional",)
    batched = True

    def _decode(self, prompt_ids, generator):
        o: LladaOptions = self.options
        bb = self.backbone
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        P, L, dt, dev, mask_id = len(prompt_ids), o.block, bb.model.dtype, bb.device, bb.mask_id
        tokens = list(prompt_ids) + [mask_id] * o.gen_length  # host copy of x, updated from each step's read
        N = len(tokens)
        x = from_host(tokens, dev)  # [N] long
        pos = torch.arange(N, device=dev)  # [N]
        steps_per_block = o.n_steps // (o.gen_length // L)
        trace: list[IterationTrace] = []
        cache = None
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
                    cache = bb.new_cache() if o.kv_cache != "none" else None
                    rows = slice(s - 1, e - 1) if bb.logits_shifted else slice(s, e)  # Dream: row i predicts i+1
                    logits = bb.forward(x, pos, cache, attn_mask=full_mask(N, N, dt, dev), logits_at=rows)[0]  # [L, V]
                    if bb.logits_shifted:
                        head = logits[0]  # the prediction of s, for the cached steps
                    if o.kv_cache == "prefix":
                        bb.crop(cache, s)
                    elif o.kv_cache == "dual":
                        bb.drop_span(cache, s, e)
                else:  # prefix: block + later masks after x[:s]; dual: only the block between x[:s] and x[e:]
                    end = N if o.kv_cache == "prefix" else e
                    mask = full_mask(end - s, N, dt, dev)  # the cache holds the other N - (end - s) tokens
                    if bb.logits_shifted:  # s is predicted from s-1, outside the window: the last refresh's head
                        window = bb.forward(x[s:end], pos[s:end], cache, keep_kv=False, attn_mask=mask,
                                            logits_at=slice(0, L - 1) if L > 1 else None)  # [1, L - 1, V]
                        logits = head[None] if window is None else torch.cat([head[None], window[0]])  # [L, V]
                    else:
                        logits = bb.forward(x[s:end], pos[s:end], cache, keep_kv=False, attn_mask=mask,
                                            logits_at=slice(0, L))[0]  # [L, V]
                where = from_host(pool, dev)  # [n] the pool's positions
                proposal = drafter.draft(logits[where - s][:, None], generator)  # [n, 1]
                if o.remasking == "random":
                    scores = torch.rand(len(pool), generator=generator, dtype=torch.float64, device=dev)  # [n]
                else:
                    scores = scorer.score(proposal)  # [n]
                chosen = choose(selector, scores, budget[i] if i < len(budget) else None)  # [n] bool
                drafted = proposal.token_ids[:, 0]  # [n]
                x[where] = torch.where(chosen, drafted, mask_id)
                score_values, chosen_flags, drafted_ids = to_host(scores, chosen, drafted)  # the step's one read
                committed = [p for p, c in zip(pool, chosen_flags) if c]
                for p, t, c in zip(pool, drafted_ids, chosen_flags):
                    if c:
                        tokens[p] = t
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
        return LoopOutput(out, trace, list(prompt_ids) + out, list(range(P + len(out))))

    def _decode_batch(self, prompts, generator):
        o: LladaOptions = self.options
        bb = self.backbone
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        L, G, dev, mask_id = o.block, o.gen_length, bb.device, bb.mask_id
        nb = G // L
        budget = num_transfer_tokens(L, o.n_steps // nb)
        ids, _, _ = left_pad(prompts, bb.eos_id, dev)  # [n, W]: every row's generation span at columns W .. N-1
        n, W = ids.shape
        x = torch.cat([ids, torch.full((n, G), mask_id, dtype=ids.dtype, device=dev)], dim=1)  # [b, N]
        state = BatchRows(x=x, pad=from_host([W - len(p) for p in prompts], dev))  # device tensors of the rows
        # host state per sequence, as in its single decode (gen: host copy of its generation span)
        gen = [[mask_id] * G for _ in prompts]
        block, step = [0] * n, [0] * n
        pools = [list(range(W, W + L)) for _ in prompts]  # columns of the block's [MASK]s, ascending
        traces: list[list[IterationTrace]] = [[] for _ in prompts]
        nfe, fed, finished_at = [0] * n, [0] * n, [None] * n
        rows = list(range(n))  # the sequence of each batch row

        while rows:
            starts = [W + block[q] * L for q in rows]  # column s of each row's block
            refresh = [o.kv_cache == "none" or step[q] == 0 or (o.refresh_every > 0 and step[q] % o.refresh_every == 0)
                       for q in rows]  # a full forward for this row (no cache, or a refresh)
            order: list[int] = []  # batch rows in the order of their pools in `logits`
            parts: list[Tensor] = []  # per forward: [n_g, V] its rows' pool logits
            width: dict[int, int] = {}  # tokens fed in each row this step
            for full in (True, False):  # at most two forwards: the rows at a full step, the rows at a cached one
                group = [r for r in range(len(rows)) if refresh[r] == full]
                if group:
                    step_logits, T = self._batch_forward(state, group, full, [starts[r] for r in group], len(rows))
                    parts.append(step_logits[  # [n_g, V]
                        from_host([k for k, r in enumerate(group) for _ in pools[rows[r]]], dev),
                        from_host([c - starts[r] for r in group for c in pools[rows[r]]], dev)])
                    order += group
                    width.update({r: T for r in group})
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]  # [n_all, V]
            proposal = drafter.draft(logits[:, None], generator)  # [n_all, 1]: every row's pool in one call
            if o.remasking == "random":
                scores = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64, device=dev)  # [n_all]
            else:
                scores = scorer.score(proposal)  # [n_all]
            chosen_parts, at = [], 0
            for r in order:  # each row's pool is selected on its own, with its own step's budget
                q, k = rows[r], len(pools[rows[r]])
                scheduled = budget[step[q]] if step[q] < len(budget) else None
                chosen_parts.append(choose(selector, scores[at : at + k], scheduled))
                at += k
            chosen = torch.cat(chosen_parts)  # [n_all] bool
            drafted = proposal.token_ids[:, 0]  # [n_all]
            state.x[from_host([r for r in order for _ in pools[rows[r]]], dev),
                    from_host([c for r in order for c in pools[rows[r]]], dev)] = torch.where(chosen, drafted, mask_id)
            score_values, chosen_flags, drafted_ids = to_host(scores, chosen, drafted)  # the step's one read
            done, at = set(), 0
            for r in order:
                q = rows[r]
                pool, k, shift = pools[q], len(pools[q]), W - len(prompts[q])  # column - shift = position
                flags = chosen_flags[at : at + k]
                committed = [c for c, f in zip(pool, flags) if f]
                for c, t, f in zip(pool, drafted_ids[at : at + k], flags):
                    if f:
                        gen[q][c - W] = t
                scored = [(c - shift, v) for c, v in zip(pool, score_values[at : at + k])]
                traces[q].append(IterationTrace(
                    block=block[q], stage="mdm", scored=scored, chosen=[c - shift for c in committed],
                    accepted=[(c - shift, 1) for c in committed], forwards=1))
                at += k
                nfe[q], fed[q] = nfe[q] + 1, fed[q] + width[r]
                pools[q] = [c for c, f in zip(pool, flags) if not f]
                step[q] += 1
                stop = o.early_stop and decided(gen[q], mask_id, bb.eos_ids)
                if not stop and not pools[q]:  # block complete: the next one starts with a full forward
                    block[q], step[q] = block[q] + 1, 0
                    pools[q] = list(range(W + block[q] * L, W + (block[q] + 1) * L))
                    stop = block[q] == nb
                if stop:
                    finished_at[q] = time.perf_counter()
                    done.add(r)
            if done:  # finished sequences leave the batch
                keep = [r for r in range(len(rows)) if r not in done]
                if keep:
                    state.select(from_host(keep, dev))
                rows = [rows[r] for r in keep]
        outs = []
        for q, prompt in enumerate(prompts):
            out = cut_after_eos(gen[q], bb.eos_ids)  # early stop leaves [MASK] only after the EOS
            outs.append(LoopOutput(out, traces[q], list(prompt) + out, list(range(len(prompt) + len(out))), nfe=nfe[q],
                                   tokens_in=fed[q], finished_at=finished_at[q]))
        return outs

    def _batch_forward(self, state: BatchRows, group: list[int], full: bool, starts: list[int],
                       b: int) -> tuple[Tensor, int]:
        """One forward of the batch rows ``group`` (of ``b``), whose blocks start at columns ``starts``.
        ``full``: every column (LLaDA, or a cache refresh, whose KV becomes the rows' cache); else the rows'
        cached step (prefix: columns s .. N-1; dual: s .. e-1) over their cache. -> ``[g, L, V]`` logits
        predicting each row's block columns ``s .. e-1``, and the tokens fed per row."""
        o: LladaOptions = self.options
        bb = self.backbone
        L, dt, dev = o.block, bb.model.dtype, bb.device
        N = state.x.shape[1]
        every = len(group) == b
        index = None if every else from_host(group, dev)
        x, pad = (state.x, state.pad) if every else (state.x[index], state.pad[index])
        shift = 1 if bb.logits_shifted else 0  # Dream: row i predicts token i+1
        if full:
            key = torch.arange(N, device=dev)
            allowed = (key[None, None, :] >= pad[:, None, None]) | torch.eye(N, dtype=torch.bool, device=dev)
            blocks = sorted(set(starts))  # logits rows: every distinct block of the group, in column order
            rows_at = (slice(blocks[0] - shift, blocks[0] - shift + L) if len(blocks) == 1 else
                       from_host([s - shift + j for s in blocks for j in range(L)], dev))
            cache = bb.new_cache() if o.kv_cache != "none" else None
            pos = (key[None, :] - pad[:, None]).clamp_min(0)  # [g, N] each prompt's own positions
            out = bb.forward(x, pos, cache, attn_mask=additive_mask(allowed, dt), logits_at=rows_at)  # [g, k * L, V]
            if len(blocks) == 1:
                logits = out
            else:  # each row's own block's rows
                at = from_host([blocks.index(s) * L for s in starts], dev)  # [g]
                at = (at[:, None] + torch.arange(L, device=dev))[:, :, None]  # [g, L, 1]
                logits = out.gather(1, at.expand(-1, -1, out.shape[-1]))
            if cache is not None:
                state.store(cache, index, N + o.gen_length if o.kv_cache == "prefix" else N)  # prefix: room for padding
                if shift:
                    state.set_head(logits[:, 0], index)  # the prediction of s, for the cached steps
            return logits, N
        # prefix: block + every later [MASK] after x[:s], right-padded to the longest; dual: only the block
        lo = from_host(starts, dev)
        T = L if o.kv_cache == "dual" else N - min(starts)
        hi = lo + L if o.kv_cache == "dual" else torch.full_like(lo, N)
        cols, ids, pos = fed_window(x, pad, lo, hi, T, bb.eos_id)  # [g, T] each
        width = N if o.kv_cache == "dual" else max(starts) + T
        key = torch.arange(width, device=dev)[None, None, :]
        allowed = ((key >= pad[:, None, None]) & (key < N)) | (key == cols[:, :, None])  # [g, T, width]
        keys, values = state.rows_kv(index)  # a cached step's KV is scratch: written in place, never kept
        cache = offset_cache(keys, values, lo, T, width)
        mask = additive_mask(allowed, dt)
        if shift:  # s is predicted from s-1, outside the window: the last refresh's head
            window = bb.forward(ids, pos, cache, attn_mask=mask, logits_at=slice(0, L - 1) if L > 1 else None)
            head = (state.head if every else state.head[index])[:, None]  # [g, 1, V]
            return (head if window is None else torch.cat([head, window], dim=1)), T  # [g, L, V]
        return bb.forward(ids, pos, cache, attn_mask=mask, logits_at=slice(0, L)), T  # [g, L, V]


@hookimpl
def register_decoders(register):
    register("llada", LladaDecoder)
