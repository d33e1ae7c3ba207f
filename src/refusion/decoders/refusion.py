"""ReFusion decoding (arXiv 2512.13586): slot-level select-and-infill with KV reuse.

The generation span is cut into serial blocks, each block into slots of ``slot_size`` consecutive
positions. Per iteration, on the pool of the block's still-masked slots (in position order):

    Stage I    one forward of all pool [MASK]s at their ORIGINAL positions after the committed buffer
               (their KV dropped again) -> drafter -> Proposal [n_pool, k]; scorer -> one score per
               slot; selector -> the chosen slots (threshold with top-1 fallback). With
               ``draft_window`` W only the W leftmost pool slots are drafted (and can be chosen)
    Stage II-a one causal forward of the chosen drafts concatenated in position order; verifier ->
               longest passing prefix. EOS inside it: accept up to the EOS, drop the pool from the EOS
               slot on, stop after this block. Else accept the prefix's whole slots (their KV from this
               forward is exact); the other chosen slots go back to the pool
    Stage II-b if no whole slot passed: complete ALL chosen slots in parallel, one cache row each, in
               rounds of predict ([MASK] at unverified tokens, argmax) + verify (causal forward,
               extender); the cache manager merges the rows' KV (kv_concat / kv_recompute)

Committed slots are appended to the buffer, ahead of the remaining masks, with their original position
ids; the output is the committed tokens sorted by position. Variants, each off by default and chosen
by config: a ``remasker`` (``sub_slot``: keep a completed slot's confident prefix, remask the rest),
adaptive slots (``split_threshold``: cut a chosen slot before its first low-confidence draft),
a load-adaptive draft window (``draft_budget``: the Stage I tokens a forward may spend across the batch,
shared by the live sequences), ``fused`` scheduling (the next Stage I rides on the II-a forward) and a sliding ``draft_window``: the
masks follow the committed buffer in position order under causal attention, so a mask's logits do not
depend on the masks to its right and the W leftmost slots' drafts are those of the full Stage I; slots
further right wait, and the forward is narrower. Slots may therefore differ in size;
proposals are padded to the largest with a ``valid`` mask. Differences from the reference code:
docs/refusion.md.

Data path: logits, proposals, scores, selections, verdicts and the cache stay on the model's device;
each forward computes logits only for the rows read (Stage I: the drafted masks, never the prompt;
II-a: the drafts' predecessors; II-b: the unverified columns and the verified tokens' predecessors).
The loop reads the device on the host (:func:`refusion.core.host.to_host`) once after selection (the
chosen slots and the scores for the trace), once after Stage II-a (prefix length, whole slots
accepted, the drafted tokens) and once per Stage II-b round (rows finished, the common verified
prefix, an EOS row, the filled tokens): ``2 + rounds`` per iteration, plus one per decode for the
finiteness check. Adaptive slots and the ``sub_slot`` remasker each add one read where they act.

The loop is a generator (:meth:`RefusionDecoder._loop`) that yields its forwards, reads and commits
(the verified left-to-right prefix of the output, as it grows): run alone on a sequence's own cache, or
by :func:`~refusion.core.loop.run_loops` as a batch, every sequence's reads at one point in one host read
and their forwards (Stage I, II-a and every II-b row alike) in one model call over a
:class:`~refusion.models.kvcache.RaggedCache`, whose rows a finished sequence leaves.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator
from torch import Tensor

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.host import from_host
from refusion.core.interfaces import DecoderOptions
from refusion.core.loop import ForwardRequest, LoopSteps, Read
from refusion.core.probs import next_token_probs, row_argmax, row_logsumexp
from refusion.core.types import DecodeState, IterationTrace, LoopOutput, Slot
from refusion.decoders.common import FinalPrefix, LoopDecoder, cut_after_eos
from refusion.models.backend import ALL_ROWS


class RefusionOptions(DecoderOptions):
    slot_size: int = Field(8, ge=1, le=4096, description="tokens per slot (k)")
    serial_blocks: int = Field(1, ge=1, description="serial blocks decoded left to right")
    draft_window: int | None = Field(
        None, ge=1, description="Stage I drafts only this many leftmost pool slots (None: every pool slot, "
        "the reference)")
    draft_budget: int | None = Field(
        None, ge=1, description="adaptive draft window by load: Stage I drafts at most draft_budget // (live "
        "sequences x slot_size) leftmost pool slots (at least 1; within draft_window when set), the live "
        "sequences read from the cache at each iteration (None: off)")
    split_threshold: float | None = Field(
        None, ge=0.0, le=1.0,
        description="adaptive slots: cut a chosen slot before its first draft token with Stage-I prob below this")
    min_split: int = Field(2, ge=1, description="adaptive slots: a cut keeps at least this many tokens")
    fused: bool = Field(False, description="put the unchosen masks in the II-a forward and reuse their logits")
    correct: bool = Field(
        False, description="Stage II-b: the token after each row's verified prefix becomes the verify forward's "
        "AR argmax (speculative decoding's correction token) instead of the masked prediction")
    join_adjacent: bool = Field(
        False, description="Stage II-b: chosen slots that touch are completed in one row, so a slot sees the one "
        "before it (the reference completes every chosen slot in its own row, blind to the others)")
    scorer: PartSpec = PartSpec(name="first_token_prob")
    drafter: PartSpec = PartSpec(name="gumbel")
    selector: PartSpec = PartSpec(name="threshold")
    verifier: PartSpec = PartSpec(name="prefix")
    extender: PartSpec = PartSpec(name="prefix")
    cache: PartSpec = PartSpec(name="kv_concat")
    remasker: PartSpec = PartSpec(name="none")

    @property
    def padded_length(self) -> int:
        """gen_length rounded up to a multiple of slot_size (the reference pads the same way)."""
        return math.ceil(self.gen_length / self.slot_size) * self.slot_size

    @model_validator(mode="after")
    def _blocks_hold_whole_slots(self) -> "RefusionOptions":
        n_slots = self.padded_length // self.slot_size
        if n_slots % self.serial_blocks:
            raise ValueError(
                f"serial_blocks={self.serial_blocks} must divide the number of slots: gen_length "
                f"{self.gen_length} rounded up to a multiple of slot_size {self.slot_size} is {self.padded_length}, "
                f"i.e. {n_slots} slots; allowed serial_blocks: "
                f"{[d for d in range(1, n_slots + 1) if n_slots % d == 0]}"
            )
        return self


def grid_index(sizes: list[int], width: int) -> list[int]:
    """Flat indices of the real entries of a ``[S, width]`` grid whose row s holds ``sizes[s]`` entries."""
    return [row * width + j for row, size in enumerate(sizes) for j in range(size)]


def pad_slots(values: Tensor, sizes: list[int], fill: float | int = 0) -> tuple[Tensor, Tensor]:
    """Rows of a flat per-position tensor ``values [N, ...]`` grouped into slots of ``sizes`` (sum N) ->
    ``[S, k_max, ...]`` and ``valid [S, k_max]``, on ``values``' device. Equal sizes: a view, no copy."""
    S, k_max = len(sizes), max(sizes)
    if all(size == k_max for size in sizes):
        valid = torch.ones(S, k_max, dtype=torch.bool, device=values.device)
        return values.view(S, k_max, *values.shape[1:]), valid
    offsets = [sum(sizes[:s]) for s in range(S)]
    index = from_host([[offsets[s] + min(j, sizes[s] - 1) for j in range(k_max)] for s in range(S)],
                      values.device)  # [S, k_max]; padding repeats the slot's last entry
    valid = torch.arange(k_max, device=values.device)[None, :] < from_host(sizes, values.device)[:, None]
    out = values[index]
    fill_mask = ~valid.view(S, k_max, *([1] * (values.dim() - 1)))
    return out.masked_fill(fill_mask, fill), valid


class RefusionDecoder(LoopDecoder):
    name = "refusion"
    Options = RefusionOptions
    attention = ("causal",)

    def _loop(self, prompt_ids, generator, cache) -> LoopSteps:
        """One sequence's decode on ``cache``; yields its forwards, host reads and commits."""
        o: RefusionOptions = self.options
        bb = self.backbone
        P = len(prompt_ids)
        bb.check_length(P, o.padded_length)
        st = DecodeState(ids=list(prompt_ids), pos=list(range(P)), prompt_len=P)
        self._eos = from_host(sorted(bb.eos_ids), bb.device)
        block_len = o.padded_length // o.serial_blocks
        final = FinalPrefix(P, o.gen_length, bb.eos_ids)
        trace: list[IterationTrace] = []
        for b in range(o.serial_blocks):
            st.pool = [Slot(P + b * block_len + i, o.slot_size) for i in range(0, block_len, o.slot_size)]
            st.next_logits = None
            while st.pool:
                nfe0 = bb.nfe
                cache, it = yield from self._iteration(st, cache, b, generator)
                it.forwards = bb.nfe - nfe0
                trace.append(it)
                final.learn(st.pos[P:], st.ids[P:])
                if commit := final.commit():
                    yield commit
            if st.stop:
                break
        ids = cut_after_eos(st.generated_in_position_order(), bb.eos_ids)[: o.gen_length]
        if commit := final.finish(ids):
            yield commit
        ratios = [it.tokens / it.forwards for it in trace if it.forwards]
        return LoopOutput(ids, trace, st.ids, st.pos, sum(ratios) / len(ratios) if ratios else 0.0)

    # ------------------------------------------------------------------ one iteration
    def _iteration(self, st: DecodeState, cache, block: int, generator):
        """Stage I (draft, score, select), Stage II-a (verify the chosen drafts), else Stage II-b.
        -> (cache, trace)."""
        cache, drafted, proposal, fused = yield from self._stage_one(st, cache, generator)
        scores = self.parts["scorer"].score(proposal)  # [n_drafted]
        selected = self.parts["selector"].select(scores)  # [n_drafted] bool
        score_values, selected_flags = yield Read((scores, selected))  # host read 1
        rows = [i for i, flag in enumerate(selected_flags) if flag]
        chosen = [drafted[i] for i in rows]
        trace = IterationTrace(
            block=block, stage="II-a", scored=[(s.start, x) for s, x in zip(drafted, score_values)],
            chosen=[s.start for s in chosen], accepted=[], forwards=0, fused=fused,
        )
        row_index = from_host(rows, self.backbone.device)
        draft_ids, draft_probs = proposal.token_ids[row_index], proposal.probs[row_index]  # [S, k_max]
        if self.options.split_threshold is not None:
            chosen = yield from self._split(st, chosen, draft_probs, trace)
        return (yield from self._stage_two_a(st, cache, trace, chosen, draft_ids, draft_probs))

    # ------------------------------------------------------------------ Stage I
    def _stage_one(self, st: DecodeState, cache, generator):
        """One forward of the drafted slots' [MASK]s at their original positions after the committed
        buffer (KV dropped again) -> (cache, drafted slots, proposal ``[n_drafted, k_max]``, whether the
        logits came from the previous II-a forward: fused scheduling)."""
        bb = self.backbone
        drafted = st.pool[: self._window(cache)]
        fused = st.next_logits is not None
        if fused:
            logits, st.next_logits = st.next_logits, None
        else:
            mask_pos = [p for s in drafted for p in s.positions]  # [N]
            masks = [bb.mask_id] * len(mask_pos)
            if cache.length() == 0:  # first call: the prompt's prefill rides along, its logits are not computed
                base = len(st.ids)
                logits = (yield ForwardRequest(cache, torch.tensor(st.ids + masks), torch.tensor(st.pos + mask_pos),
                                               logits_at=slice(base, None)))[0]
                cache.crop(base)
            else:
                logits = (yield ForwardRequest(cache, torch.tensor(masks), torch.tensor(mask_pos), keep_kv=False,
                                               logits_at=ALL_ROWS))[0]  # [N, V]
        slot_logits, valid = pad_slots(logits, [s.size for s in drafted])  # [n_drafted, k_max, V]
        proposal = self.parts["drafter"].draft(slot_logits, generator)
        proposal.valid = valid
        return cache, drafted, proposal, fused

    # ------------------------------------------------------------------ Stage II-a
    def _stage_two_a(self, st, cache, trace, chosen, draft_ids, draft_probs):
        """One causal forward of the chosen drafts concatenated in position order; accept the verified
        prefix's whole slots (or up to an EOS in it), else hand every chosen slot to Stage II-b."""
        bb = self.backbone
        base, sizes, width = len(st.ids), [s.size for s in chosen], draft_ids.shape[1]
        real = from_host(grid_index(sizes, width), bb.device)  # [n] real drafts in the [S, k_max] grid
        valid = torch.zeros(len(chosen) * width, dtype=torch.bool, device=bb.device).index_fill_(0, real, True)
        valid = valid.view(len(chosen), width)  # [S, k_max]
        flat_ids = draft_ids.reshape(-1)[real]  # [n] slot after slot
        flat_pos = [p for s in chosen for p in s.positions]
        n = len(flat_pos)
        rest = self._fused_rest(st, chosen, cache)
        ids, pos, logits_at = flat_ids, torch.tensor(flat_pos), slice(0, n - 1)  # a draft's predecessor's row
        if rest:
            rest_pos = [p for s in rest for p in s.positions]
            ids = torch.cat([ids, torch.full((len(rest_pos),), bb.mask_id, device=bb.device)])
            pos = torch.tensor(flat_pos + rest_pos)
            logits_at = torch.cat([torch.arange(n - 1), torch.arange(n, n + len(rest_pos))])
        logits = (yield ForwardRequest(cache, ids, pos, logits_at=logits_at))[0]  # KV kept: exact for an accepted prefix
        ar_probs = torch.ones(len(chosen) * width, device=bb.device).index_copy_(
            0, real, next_token_probs(logits[: n - 1], flat_ids)).view(len(chosen), width)  # [S, k_max]
        verdict = self.parts["verifier"].verify(draft_probs, ar_probs, valid)
        prefix_len, accepted_slots, drafts = yield Read((verdict.prefix_len, verdict.accepted_slots, flat_ids))  # read 2
        eos_at = next((i for i, t in enumerate(drafts[:prefix_len]) if t in bb.eos_ids), None)
        if eos_at is None and accepted_slots == 0:
            cache.crop(base)
            return (yield from self._stage_two_b(st, cache, trace, chosen, draft_ids, valid, verdict.passed,
                                                 draft_probs, ar_probs))
        n_tok = eos_at + 1 if eos_at is not None else sum(sizes[:accepted_slots])
        cache.crop(base + n_tok)
        st.commit(drafts[:n_tok], flat_pos[:n_tok])
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        done = chosen[: next(i for i, e in enumerate(ends) if e >= n_tok) + 1]
        trace.accepted = [(s.start, min(s.size, n_tok - (e - s.size))) for s, e in zip(done, ends)]
        self._retire(st, done, eos_slot=done[-1] if eos_at is not None else None)
        if rest and eos_at is None and len(done) == len(chosen):
            st.next_logits = logits[n - 1 :]  # same committed prefix, same masks: the next Stage I's logits
        return cache, trace

    # ------------------------------------------------------------------ Stage II-b
    def _stage_two_b(self, st, cache, trace, chosen, drafts, valid, passed, draft_probs, ar_probs):
        """Complete every chosen slot in its own cache row, in rounds of predict + verify; merge the
        rows' KV with the cache manager; commit."""
        bb = self.backbone
        if self.options.join_adjacent:
            chosen, valid, (drafts, passed, draft_probs, ar_probs) = self._join_adjacent(
                chosen, valid, drafts, passed, draft_probs, ar_probs)
        base, S, k = len(st.ids), len(chosen), drafts.shape[1]
        trace.stage = "II-b"
        cache.repeat_rows(S)
        filled = drafts.clone()  # [S, k] tokens of every row, verified or not
        positions = from_host([[s.start + j for j in range(k)] for s in chosen], bb.device)  # [S, k]
        verified = torch.cumprod(passed.int(), dim=-1).bool() | ~valid  # [S, k] (padding counts as done)
        confidence = torch.where(verified, ar_probs, 0.0)  # [S, k] probability each token was accepted with
        confidence[:, 0] = draft_probs[:, 0]
        kept = 0  # columns of every row whose KV the cache keeps: the common verified prefix (minus one while open)
        eos_row = None
        while True:
            trace.rounds += 1
            before = verified[:, kept:]  # [S, m]; column 0 is verified in every row
            window = filled[:, kept:]  # a view: filled in place
            m = k - kept
            masked = torch.where(before, window, bb.mask_id)
            predicted = row_argmax((yield ForwardRequest(cache, masked, positions[:, kept:], keep_kv=False,
                                                         logits_at=slice(1, None))))  # [S, m-1]
            window[:, 1:] = torch.where(before[:, 1:], window[:, 1:], predicted)
            logits = yield ForwardRequest(cache, window, positions[:, kept:], logits_at=slice(0, m - 1))  # [S, m-1, V]
            norm = row_logsumexp(logits)  # [S, m-1]
            probs = next_token_probs(logits, window, norm)  # [S, m]
            after = self.parts["extender"].extend(probs, before) | ~valid[:, kept:]
            if self.options.correct:
                after = self._correct(window, logits, before, after, valid[:, kept:])
                probs = next_token_probs(logits, window, norm)  # a corrected token's own AR prob
            confidence[:, kept:] = torch.where(after & ~before, probs, confidence[:, kept:])
            verified[:, kept:] = after
            first_eos, gain, finished, tokens = yield from self._round_status(filled, verified, valid, kept)
            if first_eos < S:  # a verified EOS: drop the chosen slots after it; its row counts as done
                eos_row, S = first_eos, first_eos + 1
                filled, positions, verified, valid, confidence = (
                    t[:S] for t in (filled, positions, verified, valid, confidence))
                verified[eos_row] = True
                chosen = chosen[:S]
                cache.select(list(range(S)))
            kept = kept + gain if finished else kept + gain - 1
            cache.crop(base + kept)
            if finished:
                break
        return self._commit_rows(st, cache, trace, chosen, tokens[:S], confidence, eos_row)

    def _round_status(self, filled: Tensor, verified: Tensor, valid: Tensor, kept: int):
        """After a round, in one host read: the first row holding a verified EOS (``S`` if none), the
        common verified prefix gained from column ``kept`` over the rows still in play, whether they are
        all complete, and every row's tokens (``[S][k]`` host lists)."""
        S, k = filled.shape
        rows = torch.arange(S, device=filled.device)
        eos_hit = torch.isin(filled[:, kept:], self._eos) & verified[:, kept:] & valid[:, kept:]  # [S, m]
        has_eos = eos_hit.any(dim=1)
        first_eos = torch.where(has_eos.any(), has_eos.int().argmax(), S)  # []
        in_play = rows <= first_eos  # [S]
        done = verified | (rows == first_eos)[:, None]  # the EOS row counts as complete
        prefix = torch.cumprod(done[:, kept:].int(), dim=-1).sum(dim=1)  # [S]
        gain = torch.where(in_play, prefix, k).min()
        finished = (done | ~in_play[:, None]).all()
        return tuple((yield Read((first_eos, gain, finished, filled))))  # the one read of a round

    def _commit_rows(self, st, cache, trace, chosen, tokens, confidence, eos_row):
        """Commit the completed rows (``tokens [S][k]`` on the host): cut after the first EOS, keep what the
        remasker keeps, merge the rows' KV; remasked suffixes go back to the pool as shorter slots."""
        bb = self.backbone
        base = len(st.ids)
        flat = cut_after_eos([t for row, s in zip(tokens, chosen) for t in row[: s.size]], bb.eos_ids)
        lengths, left = [], len(flat)
        for s in chosen:
            lengths.append(max(0, min(s.size, left)))
            left -= s.size
        lengths = [m for m in lengths if m > 0]
        chosen = chosen[: len(lengths)]
        keep = self.parts["remasker"].keep(confidence[: len(lengths)], lengths)
        if eos_row is not None:
            keep[-1] = lengths[-1]  # the EOS slot is kept whole: it ends the text
        rows = [tokens[i][:m] for i, m in enumerate(keep)]
        rows_pos = [list(range(s.start, s.start + m)) for s, m in zip(chosen, keep)]
        if len(rows) < cache.n_rows():
            cache.select(list(range(len(rows))))
        cache = self.parts["cache"].merge_rows(bb, cache, base, rows, rows_pos)
        for r, p in zip(rows, rows_pos):
            st.commit(r, p)
        trace.accepted = [(s.start, len(r)) for s, r in zip(chosen, rows)]
        self._retire(st, chosen, eos_slot=chosen[-1] if eos_row is not None else None)
        grid = self.options.slot_size
        for s, m in zip(chosen, keep):  # remasked suffixes go back to the pool as shorter slots
            if m < s.size and (eos_row is None or s.start < chosen[-1].start):
                start, end = s.start + m, s.start + s.size
                while start < end:  # cut on the slot grid: a joined row's suffix returns as slots of <= k
                    cut = min(end, st.prompt_len + ((start - st.prompt_len) // grid + 1) * grid)
                    st.pool.append(Slot(start, cut - start))
                    trace.remasked.append((start, cut - start))
                    start = cut
        st.pool.sort(key=lambda s: s.start)
        return cache, trace

    # ------------------------------------------------------------------ opt-in variants
    def _window(self, cache) -> int | None:
        """Pool slots Stage I drafts now: ``draft_window`` (None: all), and with ``draft_budget`` at most
        ``draft_budget // (live sequences x slot_size)`` (at least 1), the live sequences read from the cache
        (:meth:`~refusion.core.loop.KVCache.live_sequences`: 1 alone, the unfinished sequences in a batch)."""
        o = self.options
        if o.draft_budget is None:
            return o.draft_window
        fit = max(1, o.draft_budget // (cache.live_sequences() * o.slot_size))
        return fit if o.draft_window is None else min(fit, o.draft_window)

    def _fused_rest(self, st: DecodeState, chosen: list[Slot], cache) -> list[Slot]:
        """Fused scheduling: the pool slots not chosen (within the draft window) whose [MASK]s ride on the
        II-a forward; if every chosen slot is accepted, their logits are the next Stage I's. [] when off."""
        if not self.options.fused:
            return []
        return [s for s in st.pool if s not in chosen][: self._window(cache)]

    def _split(self, st: DecodeState, chosen: list[Slot], probs: Tensor, trace: IterationTrace):
        """Adaptive slots: cut each chosen slot before its first draft below ``split_threshold`` (one host
        read of the chosen drafts' probabilities) -> the chosen slots after the cuts."""
        o = self.options
        (low_rows,) = yield Read((probs < o.split_threshold,))  # [S][k_max]
        out = []
        for slot, low in zip(chosen, low_rows):
            cut = next((j for j in range(o.min_split, slot.size) if low[j]), slot.size)
            if cut < slot.size:
                head, tail = Slot(slot.start, cut), Slot(slot.start + cut, slot.size - cut)
                i = st.pool.index(slot)
                st.pool[i : i + 1] = [head, tail]
                trace.split.append((tail.start, tail.size))
                slot = head
            out.append(slot)
        return out

    @staticmethod
    def _join_adjacent(chosen: list[Slot], valid: Tensor, *grids: Tensor) -> tuple[list[Slot], Tensor, list[Tensor]]:
        """Runs of touching chosen slots (``chosen`` in position order) -> one slot each; ``valid`` and each
        ``[S, k_max]`` tensor of ``grids`` regrouped to ``[G, K_max]`` (padding 0)."""
        joined: list[Slot] = []
        for s in chosen:
            if joined and joined[-1].start + joined[-1].size == s.start:
                joined[-1] = Slot(joined[-1].start, joined[-1].size + s.size)
            else:
                joined.append(Slot(s.start, s.size))
        if len(joined) == len(chosen):
            return chosen, valid, list(grids)
        real = from_host(grid_index([s.size for s in chosen], valid.shape[1]), valid.device)
        sizes = [s.size for s in joined]
        regrouped = [pad_slots(g.reshape(-1)[real], sizes)[0] for g in grids]  # the real entries, slot after slot
        return joined, pad_slots(valid.reshape(-1)[real], sizes)[1], regrouped

    @staticmethod
    def _correct(window: Tensor, logits: Tensor, before: Tensor, after: Tensor, valid: Tensor) -> Tensor:
        """AR correction: in each row, the first token not verified before this round becomes the argmax of
        its predecessor's causal logits (written into ``window`` in place); it is verified, and the tokens
        after it (drafted against the old token) are not, unless the argmax is the drafted token.
        ``window, before, after, valid [S, m]``, ``logits [S, m-1, V]``; column 0 of every row is verified."""
        S, m = window.shape
        rows, cols = torch.arange(S, device=window.device), torch.arange(m, device=window.device)
        open_ = ~before & valid
        has_open = open_.any(dim=1)  # [S]
        first_open = open_.int().argmax(dim=1)  # [S] (0 in rows with none, never used there)
        best = row_argmax(logits[rows, (first_open - 1).clamp_min(0)])  # [S]
        drafted = window[rows, first_open]
        replaced = has_open & (best != drafted)
        window[rows, first_open] = torch.where(has_open, best, drafted)
        after = torch.where(replaced[:, None] & (cols[None, :] > first_open[:, None]), ~valid, after)
        return after | (has_open[:, None] & (cols[None, :] == first_open[:, None]))

    @staticmethod
    def _retire(st: DecodeState, done: list[Slot], eos_slot: Slot | None) -> None:
        """Remove finished slots (and the pool slots inside a joined one) from the pool; after an EOS also
        every slot at or after it, and stop."""
        covered = {p for s in done for p in s.positions}
        st.pool = [s for s in st.pool if s.start not in covered and (eos_slot is None or s.start < eos_slot.start)]
        if eos_slot is not None:
            st.stop = True


@hookimpl
def register_decoders(register):
    register("refusion", RefusionDecoder)
