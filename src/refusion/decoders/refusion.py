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
               verifier.extend); the cache manager merges the rows' KV (kv_concat / kv_recompute)

Committed slots are appended to the buffer, ahead of the remaining masks, with their original position
ids; the output is the committed tokens sorted by position. Variants, each off by default and chosen
by config: a ``remasker`` (``sub_slot``: keep a completed slot's confident prefix, remask the rest),
adaptive slots (``split_threshold``: cut a chosen slot before its first low-confidence draft),
``fused`` scheduling (the next Stage I rides on the II-a forward) and a sliding ``draft_window``: the
masks follow the committed buffer in position order under causal attention, so a mask's logits do not
depend on the masks to its right and the W leftmost slots' drafts are those of the full Stage I; slots
further right wait, and the forward is narrower. Slots may therefore differ in size;
proposals are padded to the largest with a ``valid`` mask. Differences from the reference code:
docs/refusion.md.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, model_validator
from torch import Tensor

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Decoder, DecoderOptions
from refusion.core.types import DecodeState, IterationTrace, LoopOutput, Proposal, Slot
from refusion.decoders.common import cut_after_eos, next_token_probs


class RefusionOptions(DecoderOptions):
    slot_size: int = Field(8, ge=1, le=4096, description="tokens per slot (k)")
    serial_blocks: int = Field(1, ge=1, description="serial blocks decoded left to right")
    draft_window: int | None = Field(
        None, ge=1, description="Stage I drafts only this many leftmost pool slots (None: every pool slot, "
        "the reference)")
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


def pad_slots(values: Tensor, slots: list[Slot], fill: float | int = 0) -> tuple[Tensor, Tensor]:
    """Rows of a flat per-position tensor ``[N, ...]`` grouped by slot -> ``[S, k_max, ...]`` and ``valid [S, k_max]``."""
    k_max = max(s.size for s in slots)
    offsets = torch.tensor([0] + [s.size for s in slots]).cumsum(0)[:-1]  # [S]
    j = torch.arange(k_max)
    valid = j[None, :] < torch.tensor([s.size for s in slots])[:, None]  # [S, k_max]
    idx = torch.where(valid, offsets[:, None] + j[None, :], 0)
    out = values[idx]
    out[~valid] = fill
    return out, valid


class RefusionDecoder(Decoder):
    name = "refusion"
    Options = RefusionOptions
    attention = ("causal",)

    def _decode(self, prompt_ids, generator):
        o: RefusionOptions = self.options
        bb, k = self.backbone, o.slot_size
        P = len(prompt_ids)
        self.backbone.check_length(P, o.padded_length)
        st = DecodeState(ids=list(prompt_ids), pos=list(range(P)), prompt_len=P)
        block_len = o.padded_length // o.serial_blocks
        cache = None
        trace: list[IterationTrace] = []
        for b in range(o.serial_blocks):
            st.pool = [Slot(P + b * block_len + i, k) for i in range(0, block_len, k)]
            st.next_logits = None
            while st.pool:
                nfe0 = bb.nfe
                cache, it = self._iteration(st, cache, b, generator)
                it.forwards = bb.nfe - nfe0
                trace.append(it)
            if st.stop:
                break
        ids = cut_after_eos(st.generated_in_position_order(), bb.eos_ids)[: o.gen_length]
        ratios = [it.tokens / it.forwards for it in trace if it.forwards]
        return LoopOutput(ids, trace, st.ids, st.pos, sum(ratios) / len(ratios) if ratios else 0.0)

    # ------------------------------------------------------------------ Stage I
    def _stage_one(self, st: DecodeState, cache, generator) -> tuple[object, Proposal, bool]:
        """Draft the pool's window: -> (cache, proposal [n_drafted, k_max], whether the logits were reused)."""
        bb = self.backbone
        drafted = st.pool[: self.options.draft_window]
        base = len(st.ids)
        fused = st.next_logits is not None
        if fused:
            logits, st.next_logits = st.next_logits, None
        else:
            mask_pos = [p for s in drafted for p in s.positions]  # [N]
            masks = [bb.mask_id] * len(mask_pos)
            if cache is None:  # first call: the prompt's prefill rides along
                cache = bb.new_cache()
                logits = bb.forward(torch.tensor(st.ids + masks), torch.tensor(st.pos + mask_pos), cache)[0, base:]
                bb.crop(cache, base)
            else:
                logits = bb.forward(torch.tensor(masks), torch.tensor(mask_pos), cache, keep_kv=False)[0]
        padded, valid = pad_slots(logits, drafted)  # [n_drafted, k_max, V]
        proposal = self.parts["drafter"].draft(padded, generator)
        proposal.valid = valid
        return cache, proposal, fused

    def _split(self, st: DecodeState, chosen: list[Slot], probs: Tensor, trace: IterationTrace) -> list[Slot]:
        """Adaptive slots: cut each chosen slot before its first draft below ``split_threshold``."""
        o = self.options
        out = []
        for slot, row in zip(chosen, probs):
            low = (row[: slot.size] < o.split_threshold).nonzero().flatten().tolist()
            cut = next((j for j in low if j >= o.min_split), slot.size)
            if cut < slot.size:
                head, tail = Slot(slot.start, cut), Slot(slot.start + cut, slot.size - cut)
                i = st.pool.index(slot)
                st.pool[i : i + 1] = [head, tail]
                trace.split.append((tail.start, tail.size))
                slot = head
            out.append(slot)
        return out

    # ------------------------------------------------------------------ one iteration
    def _iteration(self, st: DecodeState, cache, block: int, generator) -> tuple[object, IterationTrace]:
        bb, o = self.backbone, self.options
        base = len(st.ids)
        cache, proposal, fused = self._stage_one(st, cache, generator)
        scores = self.parts["scorer"].score(proposal)  # [n_drafted]: the pool's first slots
        chosen_idx = self.parts["selector"].select(scores)
        chosen = [st.pool[i] for i in chosen_idx]
        trace = IterationTrace(
            block=block, stage="II-a", scored=[(s.start, float(x)) for s, x in zip(st.pool, scores)],
            chosen=[s.start for s in chosen], accepted=[], forwards=0, fused=fused,
        )
        draft_probs = proposal.probs[chosen_idx]  # [S, k_max]
        if o.split_threshold is not None:
            chosen = self._split(st, chosen, draft_probs, trace)
        S = len(chosen)
        drafts = proposal.token_ids[chosen_idx]  # [S, k_max]
        valid = torch.arange(drafts.shape[1])[None, :] < torch.tensor([s.size for s in chosen])[:, None]
        flat_ids = drafts[valid]  # [n] real draft tokens, slot after slot
        flat_pos = torch.tensor([p for s in chosen for p in s.positions])  # [n]

        # Stage II-a: global causal verification of the concatenated drafts (+ unchosen masks if fused).
        rest = [s for s in st.pool if s not in chosen][: o.draft_window]  # the next Stage I's slots if all pass
        ids, pos = flat_ids, flat_pos
        if o.fused and rest:
            rest_pos = torch.tensor([p for s in rest for p in s.positions])
            ids, pos = torch.cat([ids, torch.full_like(rest_pos, bb.mask_id)]), torch.cat([pos, rest_pos])
        vlogits = bb.forward(ids, pos, cache)[0]  # KV kept: exact for an accepted prefix
        ar_flat = next_token_probs(vlogits[: len(flat_ids)], flat_ids)
        ar_probs = torch.ones_like(draft_probs)
        ar_probs[valid] = ar_flat
        verdict = self.parts["verifier"].verify(draft_probs, ar_probs, valid)
        prefix = flat_ids[: verdict.prefix_len].tolist()
        eos_at = next((i for i, t in enumerate(prefix) if t in bb.eos_ids), None)
        if eos_at is not None or verdict.accepted_slots > 0:
            n_tok = eos_at + 1 if eos_at is not None else sum(s.size for s in chosen[: verdict.accepted_slots])
            bb.crop(cache, base + n_tok)
            st.commit(prefix[:n_tok], flat_pos[:n_tok].tolist())
            ends = torch.tensor([s.size for s in chosen]).cumsum(0).tolist()
            done = chosen[: next(i for i, e in enumerate(ends) if e >= n_tok) + 1]
            trace.accepted = [(s.start, min(s.size, n_tok - (e - s.size))) for s, e in zip(done, ends)]
            self._retire(st, done, eos_slot=done[-1] if eos_at is not None else None)
            if o.fused and rest and eos_at is None and len(done) == S:
                st.next_logits = vlogits[len(flat_ids):]  # same prefix, same masks: next Stage I's logits
            return cache, trace
        bb.crop(cache, base)
        return self._stage_two_b(st, cache, trace, chosen, drafts, valid, verdict.passed, draft_probs, ar_probs)

    # ------------------------------------------------------------------ Stage II-b
    @staticmethod
    def _join_adjacent(chosen: list[Slot], valid: Tensor, *rows: Tensor) -> tuple[list[Slot], Tensor, list[Tensor]]:
        """Runs of touching chosen slots (``chosen`` in position order) -> one slot each; ``valid`` and each
        ``[S, k_max]`` tensor of ``rows`` regrouped to ``[G, K_max]`` (padding 0)."""
        joined: list[Slot] = []
        for s in chosen:
            if joined and joined[-1].start + joined[-1].size == s.start:
                joined[-1] = Slot(joined[-1].start, joined[-1].size + s.size)
            else:
                joined.append(Slot(s.start, s.size))
        if len(joined) == len(chosen):
            return chosen, valid, list(rows)
        regrouped = [pad_slots(r[valid], joined)[0] for r in rows]  # the real entries, slot after slot
        return joined, pad_slots(valid[valid], joined)[1], regrouped

    def _stage_two_b(self, st, cache, trace, chosen, drafts, valid, passed, draft_probs, ar_probs):
        """Complete every chosen slot in its own cache row (with ``join_adjacent``, every run of touching
        chosen slots in one row); merge the rows' KV; commit."""
        bb = self.backbone
        if self.options.join_adjacent:
            chosen, valid, (drafts, passed, draft_probs, ar_probs) = self._join_adjacent(
                chosen, valid, drafts, passed, draft_probs, ar_probs)
        base, S, k = len(st.ids), len(chosen), drafts.shape[1]
        trace.stage = "II-b"
        bb.repeat_rows(cache, S)
        spec = drafts.clone()  # [S, k]
        pos = torch.tensor([s.start for s in chosen])[:, None] + torch.arange(k)[None, :]  # padding runs on
        tags = torch.cumprod(passed.int(), dim=-1).bool() | ~valid  # [S, k] verified (padding counts as done)
        conf = torch.where(tags, ar_probs, 0.0)  # acceptance probability of each verified token
        conf[:, 0] = draft_probs[:, 0]
        eos = torch.tensor(sorted(bb.eos_ids))
        a = 0  # tokens of every row whose KV is kept (a common verified prefix, minus one while incomplete)
        eos_row = None
        while not tags.all():
            trace.rounds += 1
            cur = tags[:, a:]
            masked = torch.where(cur, spec[:, a:], bb.mask_id)
            fill = bb.forward(masked, pos[:, a:], cache, keep_kv=False).argmax(-1)  # predict [S, k-a]
            spec[:, a:] = torch.where(cur, spec[:, a:], fill)
            vlog = bb.forward(spec[:, a:], pos[:, a:], cache)  # verify; KV kept, cropped below
            probs = next_token_probs(vlog, spec[:, a:])
            new = self.parts["verifier"].extend(probs, cur) | ~valid[:, a:]
            if self.options.correct:
                new = self._correct(spec[:, a:], vlog, cur, new, valid[:, a:])
                probs = next_token_probs(vlog, spec[:, a:])  # a corrected token's own AR prob
            conf[:, a:] = torch.where(new & ~cur, probs, conf[:, a:])
            tags[:, a:] = new
            eos_hit = torch.isin(spec[:, a:], eos) & new & valid[:, a:]
            if eos_hit.any():  # a verified EOS: drop the chosen slots after it; its row counts as done
                eos_row = int(eos_hit.any(dim=1).nonzero()[0])
                keep = slice(0, eos_row + 1)
                spec, pos, tags, valid, conf, chosen = spec[keep], pos[keep], tags[keep], valid[keep], conf[keep], chosen[keep]
                tags[eos_row] = True
                bb.select(cache, list(range(eos_row + 1)))
            gain = int(torch.cumprod(tags[:, a:].int(), dim=-1).sum(dim=1).min())
            a = a + gain if tags.all() else a + gain - 1
            bb.crop(cache, base + a)

        tokens = cut_after_eos(spec[valid].tolist(), bb.eos_ids)
        lengths, n = [], len(tokens)
        for s in chosen:
            lengths.append(max(0, min(s.size, n)))
            n -= s.size
        lengths = [m for m in lengths if m > 0]
        chosen = chosen[: len(lengths)]
        keep = self.parts["remasker"].keep(conf, lengths)
        if eos_row is not None:
            keep[-1] = lengths[-1]  # the EOS slot is kept whole: it ends the text
        rows = [spec[i, :m].tolist() for i, m in enumerate(keep)]
        rows_pos = [pos[i, :m].tolist() for i, m in enumerate(keep)]
        if len(rows) < bb.cache_rows(cache):
            bb.select(cache, list(range(len(rows))))
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

    @staticmethod
    def _correct(spec: Tensor, vlog: Tensor, cur: Tensor, new: Tensor, valid: Tensor) -> Tensor:
        """Replace, in place, each row's first token that was unverified before this round by the AR argmax
        of its predecessor's logits; that token is verified, the ones after it (drafted against the old
        token) are not, unless the argmax is the drafted token. ``spec, cur, new, valid [S, m]``,
        ``vlog [S, m, V]``; position 0 of every row is verified (the decoder keeps one verified token)."""
        open_rows = (~cur & valid).any(dim=1).nonzero().flatten()
        for r in open_rows.tolist():
            u = int((~cur[r]).nonzero()[0])
            best = int(vlog[r, u - 1].argmax())
            if best != int(spec[r, u]):
                spec[r, u] = best
                new[r, u + 1 :] = ~valid[r, u + 1 :]
            new[r, u] = True
        return new

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
