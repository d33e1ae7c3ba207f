"""Small typed records that pass between the parts of a decoder.

Shapes use S = number of slots in play, k = slot size, V = vocabulary size.
Logits semantics (ReFusion / Qwen3 causal backbone, ``logits_shifted=False`` in our terms):

* at a **[MASK] input position** the logits predict the token *at that same position* (MDM style);
* at a **real token position** the logits predict the *next* token (AR style).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor


@dataclass
class Proposal:
    """Drafted tokens for S slots of k positions each (from logits at [MASK] inputs)."""

    token_ids: Tensor  # [S, k] long: drafted token per position
    probs: Tensor  # [S, k] float32: softmax probability (of the un-noised logits) of the drafted token
    logits: Tensor  # [S, k, V] float32: the logits the draft came from (scorers may need the distribution)
    valid: Tensor | None = None  # [S, k] bool: real positions when slots differ in size (padding after); None = all

    @property
    def mask(self) -> Tensor:
        """``[S, k]`` bool: True at real (non-padding) positions. Position 0 of every slot is real."""
        return self.valid if self.valid is not None else torch.ones_like(self.token_ids, dtype=torch.bool)


@dataclass
class Verdict:
    """What the Stage II-a verifier accepted from a concatenation of S drafted slots."""

    passed: Tensor  # [S, k] bool: per-token pass mark (first token of every slot forced True)
    prefix_len: Tensor  # [] long: longest all-pass run from the start of the concatenation, in (real) tokens
    accepted_slots: Tensor  # [] long: leading slots lying wholly inside that prefix


@dataclass
class Acceptance:
    """What a speculative-decoding acceptance rule decided for B sequences' drafts (on the device)."""

    accepted: Tensor  # [B] long in 0..n: the leading drafts accepted
    next_token: Tensor  # [B] long: the token after them (the correction, or the bonus token when all n pass)


@dataclass
class Slot:
    """A slot of consecutive generation positions ``start .. start+size-1`` (original positions)."""

    start: int
    size: int

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.size)


@dataclass
class DecodeState:
    """The decode buffer.

    ``ids`` and ``pos`` are the committed tokens in BUFFER order (prompt first, then committed slots in
    the order they were accepted) with their ORIGINAL position ids; the KV cache holds exactly these
    tokens in this order. ``pool`` holds the slots still [MASK] in the current serial block.
    """

    ids: list[int]
    pos: list[int]
    prompt_len: int
    pool: list[Slot] = field(default_factory=list)
    stop: bool = False  # an EOS was committed: finish this block, then stop
    next_logits: Tensor | None = None  # [n_pool_masks, V] Stage-I logits already computed (fused scheduling)

    def commit(self, ids: list[int], pos: list[int]) -> None:
        assert len(ids) == len(pos)
        self.ids.extend(ids)
        self.pos.extend(pos)

    def generated_in_position_order(self) -> list[int]:
        """The generated tokens restored to position order (inverts any reordering of slots)."""
        pairs = sorted(zip(self.pos[self.prompt_len:], self.ids[self.prompt_len:]))
        return [t for _, t in pairs]


Stage = Literal["II-a", "II-b", "ar", "mdm", "block", "spec"]


@dataclass
class IterationTrace:
    """One decoder iteration: what was scored, chosen and accepted, by which stage, at which positions."""

    block: int
    stage: Stage
    scored: list[tuple[int, float]]  # (slot start position, score) for every slot scored in Stage I
    chosen: list[int]  # start positions of the chosen slots
    accepted: list[tuple[int, int]]  # (slot start position, tokens committed from it)
    forwards: int  # forward calls this iteration used
    rounds: int = 0  # Stage II-b rounds (predict + verify)
    remasked: list[tuple[int, int]] = field(default_factory=list)  # (start, size) of suffixes sent back to the pool
    split: list[tuple[int, int]] = field(default_factory=list)  # (start, size) of tails split off chosen slots
    fused: bool = False  # Stage I logits came from the previous iteration's verification forward

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.accepted)


@dataclass
class DecodeStats:
    generated_tokens: int
    nfe: int  # forward calls
    tokens_in: int  # tokens fed through the model (sum over forwards of batch x length)
    wall_s: float
    iterations: int
    tpf_reference_mean: float | None = None  # the reference's mean of per-iteration tokens/forwards
    # decoded in a batch (``Decoder.generate_batch``): nfe counts the batch's forward calls this sequence
    # took part in, tokens_in its own rows' tokens, wall_s the time from the batch's start to this
    # sequence's end (its latency); the batch's own totals follow
    batch_size: int = 1
    batch_wall_s: float | None = None  # the whole batch's decode wall time
    batch_nfe: int | None = None  # the whole batch's forward calls
    batch_tokens: int | None = None  # tokens generated by the whole batch
    extra: dict | None = None  # a decoder's own counts (speculative decoding: drafted, accepted, drafter forwards)

    @property
    def tpf(self) -> float:
        """Tokens per forward: generated tokens / forward calls."""
        return self.generated_tokens / self.nfe if self.nfe else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def batch_tokens_per_second(self) -> float:
        """Aggregate throughput of the batch this sequence was decoded in (its own at batch size 1)."""
        if self.batch_wall_s is None:
            return self.tokens_per_second
        return (self.batch_tokens or 0) / self.batch_wall_s if self.batch_wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        """Plain values; the batch keys only for a sequence decoded in a batch of more than one."""
        out = {
            "generated_tokens": self.generated_tokens,
            "nfe": self.nfe,
            "tokens_in": self.tokens_in,
            "tpf": self.tpf,
            "tpf_reference_mean": self.tpf_reference_mean,
            "tokens_per_second": self.tokens_per_second,
            "wall_s": self.wall_s,
            "iterations": self.iterations,
        }
        if self.batch_size > 1:
            out.update(batch_size=self.batch_size, batch_wall_s=self.batch_wall_s, batch_nfe=self.batch_nfe,
                       batch_tokens_per_second=self.batch_tokens_per_second)
        if self.extra:
            out.update(self.extra)
        return out


@dataclass
class LoopOutput:
    """What a decoding loop hands back to :meth:`Decoder.generate`."""

    token_ids: list[int]  # generated tokens in position order
    trace: list[IterationTrace]
    buffer_ids: list[int]  # prompt + committed tokens in BUFFER order
    buffer_pos: list[int]  # their original position ids
    tpf_reference_mean: float | None = None
    # a batched loop (``Decoder._decode_batch``) fills these per sequence; a single decode leaves them None
    nfe: int | None = None  # forward calls this sequence took part in
    tokens_in: int | None = None  # tokens fed in this sequence's rows
    finished_at: float | None = None  # time.perf_counter() when this sequence's decode ended
    extra: dict | None = None  # the decoder's own counts, passed on to DecodeStats.extra


@dataclass
class DecodeResult:
    text: str
    token_ids: list[int]  # generated tokens in position order (ending with EOS if one was generated)
    stats: DecodeStats
    trace: list[IterationTrace] = field(default_factory=list)
    buffer_ids: list[int] = field(default_factory=list)  # prompt + committed tokens in BUFFER order
    buffer_pos: list[int] = field(default_factory=list)  # their original position ids

    def as_dict(self, with_trace: bool = False) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.as_dict()}
        if with_trace:
            out["trace"] = [
                {**t.__dict__, "tokens": t.tokens} for t in self.trace
            ]
        return out
