"""ReFusion decoding (arXiv 2512.13586): slot-level select-and-infill with KV reuse.

The generation span is cut into serial blocks, each block into slots of ``slot_size`` consecutive
positions. Per iteration, on the pool of the block's still-masked slots:

    Stage I   one forward of all pool [MASK]s at their ORIGINAL positions after the committed buffer
              (KV dropped again); drafter -> Proposal; scorer -> one score per slot; selector -> the
              slots to work on (threshold with top-1 fallback)
    Stage II-a one causal forward of the chosen drafts concatenated in position order; verifier ->
              longest passing prefix; EOS inside it -> accept up to the EOS and stop after this block;
              else accept its whole slots (their KV from this forward is exact) and return the rest
    Stage II-b if no whole slot passed: complete ALL chosen slots in parallel, one cache row each:
              rounds of predict ([MASK] at unverified tokens, argmax) + verify (causal forward,
              verifier.extend); then the cache manager merges the rows' KV (kv_concat / kv_recompute)

Committed slots are appended to the buffer (ahead of the remaining masks) with their original position
ids; the output is the committed tokens sorted by position. Deliberate differences from the reference
code are listed in docs/refusion.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field, model_validator

from refusion.core.config import PartSpec
from refusion.core.hookspecs import hookimpl
from refusion.core.interfaces import Decoder, DecoderOptions
from refusion.core.types import DecodeState, IterationTrace, LoopOutput, Slot
from refusion.decoders.common import cut_after_eos, next_token_probs


class RefusionOptions(DecoderOptions):
    slot_size: int = Field(8, ge=1, le=4096, description="tokens per slot (k)")
    serial_blocks: int = Field(1, ge=1, description="serial blocks decoded left to right")
    scorer: PartSpec = PartSpec(name="first_token_prob")
    drafter: PartSpec = PartSpec(name="gumbel")
    selector: PartSpec = PartSpec(name="threshold")
    verifier: PartSpec = PartSpec(name="prefix")
    cache: PartSpec = PartSpec(name="kv_concat")

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

    # ------------------------------------------------------------------ one iteration
    def _iteration(self, st: DecodeState, cache, block: int, generator) -> tuple[Any, IterationTrace]:
        bb, k = self.backbone, self.options.slot_size
        drafter, scorer, selector = self.parts["drafter"], self.parts["scorer"], self.parts["selector"]
        base = len(st.ids)

        # Stage I: all pool masks at their original positions; their KV is dropped again.
        mask_pos = torch.tensor([p for s in st.pool for p in s.positions])  # [n_pool * k]
        masks = torch.full_like(mask_pos, bb.mask_id)
        if cache is None:  # first call: the prompt's prefill rides along
            cache = bb.new_cache()
            logits = bb.forward(torch.tensor(st.ids + masks.tolist()), torch.tensor(st.pos + mask_pos.tolist()), cache)
            bb.crop(cache, base)
            logits = logits[0, base:]
        else:
            logits = bb.forward(masks, mask_pos, cache, keep_kv=False)[0]
        proposal = drafter.draft(logits.view(len(st.pool), k, -1), generator)  # [n_pool, k]
        scores = scorer.score(proposal)  # [n_pool]
        chosen_idx = selector.select(scores)
        chosen = [st.pool[i] for i in chosen_idx]
        drafts = proposal.token_ids[chosen_idx]  # [S, k]
        trace = IterationTrace(
            block=block, stage="II-a", scored=[(s.start, float(x)) for s, x in zip(st.pool, scores)],
            chosen=[s.start for s in chosen], accepted=[], forwards=0,
        )

        # Stage II-a: global causal verification of the concatenated drafts.
        S = len(chosen)
        flat_pos = torch.tensor([p for s in chosen for p in s.positions])  # [S * k]
        vlogits = bb.forward(drafts.flatten(), flat_pos, cache)[0]  # KV kept: exact for an accepted prefix
        ar_probs = next_token_probs(vlogits, drafts.flatten()).view(S, k)
        verdict = self.parts["verifier"].verify(proposal.probs[chosen_idx], ar_probs)
        prefix = drafts.flatten()[: verdict.prefix_len].tolist()
        eos_at = next((i for i, t in enumerate(prefix) if t in bb.eos_ids), None)
        if eos_at is not None or verdict.accepted_slots > 0:
            n_tok = eos_at + 1 if eos_at is not None else verdict.accepted_slots * k
            bb.crop(cache, base + n_tok)
            st.commit(prefix[:n_tok], flat_pos[:n_tok].tolist())
            done = chosen[: math.ceil(n_tok / k)]
            trace.accepted = [(s.start, min(k, n_tok - i * k)) for i, s in enumerate(done)]
            self._retire(st, done, eos_slot=done[-1] if eos_at is not None else None)
            return cache, trace
        bb.crop(cache, base)

        # Stage II-b: parallel iterative completion of every chosen slot, one cache row each.
        trace.stage = "II-b"
        bb.repeat_rows(cache, S)
        spec = drafts.clone()  # [S, k]
        pos = flat_pos.view(S, k)
        tags = torch.cumprod(verdict.passed.int(), dim=-1).bool()  # [S, k] verified marks
        a = 0  # tokens of every row whose KV is kept (a common verified prefix, minus one while incomplete)
        eos_row = None
        while not tags.all():
            trace.rounds += 1
            cur = tags[:, a:]
            masked = torch.where(cur, spec[:, a:], bb.mask_id)
            fill = bb.forward(masked, pos[:, a:], cache, keep_kv=False).argmax(-1)  # predict [S, k-a]
            spec[:, a:] = torch.where(cur, spec[:, a:], fill)
            vlog = bb.forward(spec[:, a:], pos[:, a:], cache)  # verify; KV kept, cropped below
            tags[:, a:] = self.parts["verifier"].extend(next_token_probs(vlog, spec[:, a:]), cur)
            eos_hit = torch.isin(spec[:, a:], torch.tensor(sorted(bb.eos_ids))) & tags[:, a:]
            if eos_hit.any():  # a verified EOS: drop the chosen slots after it; its row counts as done
                eos_row = int(eos_hit.any(dim=1).nonzero()[0])
                spec, pos, tags, chosen = spec[: eos_row + 1], pos[: eos_row + 1], tags[: eos_row + 1], chosen[: eos_row + 1]
                tags[eos_row] = True
                bb.select(cache, list(range(eos_row + 1)))
            gain = int(tags[:, a:].sum(dim=1).min())
            a = a + gain if tags.all() else a + gain - 1
            bb.crop(cache, base + a)

        tokens = cut_after_eos(spec.flatten().tolist(), bb.eos_ids)
        rows = [tokens[i * k : (i + 1) * k] for i in range(len(chosen))]
        rows_pos = [pos[i, : len(r)].tolist() for i, r in enumerate(rows)]
        cache = self.parts["cache"].merge_rows(bb, cache, base, rows, rows_pos)
        for r, p in zip(rows, rows_pos):
            st.commit(r, p)
        trace.accepted = [(s.start, len(r)) for s, r in zip(chosen, rows)]
        self._retire(st, chosen, eos_slot=chosen[-1] if eos_row is not None else None)
        return cache, trace

    @staticmethod
    def _retire(st: DecodeState, done: list[Slot], eos_slot: Slot | None) -> None:
        """Remove finished slots from the pool; after an EOS also every slot at or after it, and stop."""
        starts = {s.start for s in done}
        st.pool = [s for s in st.pool if s.start not in starts and (eos_slot is None or s.start < eos_slot.start)]
        if eos_slot is not None:
            st.stop = True


@hookimpl
def register_decoders(register):
    register("refusion", RefusionDecoder)
