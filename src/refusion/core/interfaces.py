"""The parts a decoder is built from, and the decoder itself.

Parts are pure functions of device tensors: they take and return tensors on the model's device and
read no value on the host (a synchronisation on a GPU); the decoding loop decides where it needs a
number and reads it through :func:`refusion.core.host.to_host`.

Each part is a small class with a nested pydantic ``Options`` model (unknown fields rejected) and one
method over tensors, so that a third-party part is a function of tensors a test can call without a
model. Parts know nothing about the loop that calls them.

Logits semantics every part relies on (causal ReFusion/Qwen3 backbone): logits at a [MASK] input
predict the token at that same position; logits at a real token predict the next token.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor

from refusion.core.loop import Commit, KVCache, exhaust
from refusion.core.types import DecodeResult, DecodeStats, LoopOutput, Proposal, Verdict

if TYPE_CHECKING:
    from refusion.models.backend import Backbone


class Options(BaseModel):
    """Base of every part's and decoder's options: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class Part(ABC):
    """A configurable component; ``kind`` is its registry kind. Abstract methods are enforced: a part that
    leaves one unimplemented cannot be instantiated."""

    kind: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = Options

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.Options()


class Drafter(Part):
    """Turns logits at [MASK] positions into a proposal."""

    kind = "drafter"

    @abstractmethod
    def draft(self, logits: Tensor, generator: torch.Generator | None = None) -> Proposal:
        """``logits [S, k, V]`` float32 (at [MASK] inputs: each predicts its own position) -> Proposal, on the
        logits' device. ``generator`` lives on that device too."""


class Scorer(Part):
    """Confidence of each drafted slot; higher means more confident."""

    kind = "scorer"

    @abstractmethod
    def score(self, proposal: Proposal) -> Tensor:
        """Proposal of S slots -> scores ``[S]`` float."""


class Selector(Part):
    """Chooses which slots to work on in this iteration."""

    kind = "selector"

    @abstractmethod
    def select(self, scores: Tensor) -> Tensor:
        """``scores [S]`` of the pool's slots (in position order) -> ``[S]`` bool, True at the chosen slots,
        at least one True; on the scores' device, without reading values on the host."""


class TokenSelector(Selector):
    """A selector over per-token scores (token-level diffusion decoders) that may use the step's budget and
    may choose nothing. Subclasses implement :meth:`_choose`; :meth:`select` restricts it to the eligible
    positions and adds the best one when something must be chosen."""

    def select(self, scores: Tensor, budget: int | None = None, at_least_one: bool = True,
               eligible: Tensor | None = None) -> Tensor:
        """``scores [n]`` -> ``[n]`` bool, True at the chosen positions; only ``eligible [n]`` ones (None: all)
        are chosen, and at least one when ``at_least_one`` and any is eligible. On the scores' device,
        without reading values on the host; ties go to the leftmost position."""
        if eligible is None:
            eligible = torch.ones_like(scores, dtype=torch.bool)
        ranked = torch.where(eligible, scores, -torch.inf)  # ineligible positions rank last and pass no rule
        chosen = self._choose(ranked, budget) & eligible
        if at_least_one and scores.numel():
            best = torch.arange(scores.numel(), device=scores.device) == ranked.argmax()  # first maximum
            chosen = torch.where(chosen.any(), chosen, best & eligible)
        return chosen

    @abstractmethod
    def _choose(self, scores: Tensor, budget: int | None) -> Tensor:
        """``scores [n]`` (ineligible positions at -inf) and the step's ``budget`` -> ``[n]`` bool: the rule's
        choice before eligibility and the at-least-one fallback."""


class Verifier(Part):
    """Accepts drafted tokens from their causal (next-token) probabilities. Pure functions of tensors."""

    kind = "verifier"

    @abstractmethod
    def verify(self, draft_probs: Tensor, ar_probs: Tensor, valid: Tensor | None = None) -> Verdict:
        """Stage II-a over a concatenation of S slots (their real tokens, in slot order).

        ``draft_probs [S, k]``: Stage-I probabilities of the drafts; ``ar_probs [S, k]``: probability of
        each draft token under the causal logits of its predecessor in the concatenation; ``valid [S, k]``
        marks real positions when slots differ in size (padding at the end of a row; None = all real).
        """


class Extender(Part):
    """Stage II-b: one verification round over rows completed in parallel. Pure functions of tensors."""

    kind = "extender"

    def bind(self, verifier: Verifier) -> "Extender":
        """This extender as it runs beside ``verifier`` (called once, when a config is validated): an extender
        may take what its options leave unset from the verifier's. Default: ``self``. Raises ValueError,
        naming the option to set, when it cannot run beside ``verifier``."""
        return self

    @abstractmethod
    def extend(self, ar_probs: Tensor, verified: Tensor) -> Tensor:
        """``ar_probs [S, m]``: causal probability of each filled token; ``verified [S, m]`` bool before the
        round (a prefix per row, column 0 verified) -> ``[S, m]`` bool verified after the round: a prefix per
        row that keeps every verified token and gains at least one per row that still has an unverified one."""


class CacheManager(Part):
    """How the KV of slots completed in separate cache rows enters the single-row cache."""

    kind = "cache"
    #: True when the merged cache equals a fresh forward of the prefix and every slot in buffer order (with
    #: their position ids); False when only the prefix and the first slot are exact (kv_concat's reuse).
    #: ``refusion.testing.check_cache_manager`` holds a manager to what it declares.
    exact: ClassVar[bool] = False

    @abstractmethod
    def merge_rows(
        self, backbone: "Backbone", rows: "KVCache", base_len: int, tokens: list[list[int]], positions: list[list[int]]
    ) -> "KVCache":
        """``rows``: S-row cache (:class:`~refusion.core.loop.KVCache`), each row = committed prefix
        (``base_len``) + its slot's tokens (at least ``len(tokens[s])`` of them). Return a one-row cache
        holding the prefix followed by ``tokens[0] + tokens[1] + ...`` in that order."""


class Remasker(Part):
    """After slots are filled, decides how much of each to keep; the rest goes back to [MASK]."""

    kind = "remasker"

    @abstractmethod
    def keep(self, confidence: Tensor, lengths: list[int]) -> list[int]:
        """``confidence [S, k]``: the probability each filled token was accepted with (Stage-I prob for a
        slot's first token, causal verification prob for the others); ``lengths``: real tokens per slot.
        -> tokens to keep per slot, each in ``1 .. lengths[s]`` (a kept part is always a prefix). A remasker
        that reads ``confidence`` on the host does so through :func:`refusion.core.host.to_host` (one
        synchronisation per call)."""


@dataclass
class Draft:
    """What a :class:`Proposer` proposes after a sequence's verified prefix: ``tokens [n]`` long (0 <= n <= k,
    on the device), ``n`` on the host, and ``probs [n, V]`` float32, the distribution each token was drawn
    from (speculative sampling needs it; None for a deterministic proposer: a point mass on the token)."""

    tokens: Tensor
    n: int
    probs: Tensor | None = None


class Proposer(Part):
    """Proposes the next k tokens of a sequence after its verified prefix (speculative decoding).

    A proposer keeps whatever it needs per sequence in a state object (:meth:`start`): a draft model's KV
    cache, for example. :meth:`propose` sees the verified ``context`` (prompt + accepted output, host ints)
    and returns a :class:`Draft`; after verification :meth:`accept` tells it the new context, so it can crop
    what it cached beyond it.

    A proposer that runs a model of its own writes :meth:`propose` as a generator over the loop protocol
    (:mod:`refusion.core.loop`): it yields a :class:`~refusion.core.loop.ForwardRequest` on its own cache
    (``state.cache``) per forward, receives the logits, and returns the Draft. The decoder runs those
    requests on the sequence's own cache of the drafter alone, and in a batch passes them on, so the
    drafter's forwards of every sequence share one model call over a second ragged cache, the drafter's
    (:meth:`new_batch_cache`). It counts its forwards in ``state.forwards``."""

    kind = "proposer"

    def bind(self, backbone: "Backbone") -> "Proposer":
        """This proposer beside the target ``backbone`` (called once, when the decoder is built): load a draft
        model on the target's device, check the vocabulary. Default: ``self``."""
        return self

    def start(self, prompt_ids: list[int], cache: "KVCache | None" = None) -> "ProposerState":
        """A new sequence's state; ``cache``: its rows of the drafter's batch cache (given only to a proposer
        whose :meth:`new_batch_cache` makes one, in a batch). Default: an empty state."""
        return ProposerState(cache=cache)

    @abstractmethod
    def propose(self, state: "ProposerState", context: list[int], k: int, temperature: float,
                generator: torch.Generator | None) -> "Draft | Generator":
        """Up to ``k`` tokens after ``context``; with ``temperature > 0`` drawn from ``generator`` (on the
        device), their distributions in ``Draft.probs``. A Draft, or a generator of forward requests that
        returns one."""

    def accept(self, state: "ProposerState", context: list[int], accepted: int) -> None:
        """Verification ended: ``context`` is the new verified prefix, the one last proposed after followed
        by the first ``accepted`` drafted tokens and one token of the target's. Default: nothing."""

    def new_batch_cache(self):
        """The drafter model's shared cache for a batch (a :class:`~refusion.core.loop.BatchCache`), or None
        for a proposer without a model (the default)."""
        return None


@dataclass
class ProposerState:
    """A sequence's proposer state: the proposer's own forwards (its model's calls) and whatever else a
    proposer keeps (``data``)."""

    forwards: int = 0
    cache: "KVCache | None" = None  # the drafter's cache of this sequence (a proposer with a model)
    data: dict = field(default_factory=dict)


class DecoderOptions(Options):
    """Options every decoder has."""

    gen_length: int = Field(128, ge=1, le=1_000_000, description="maximum number of tokens to generate")
    seed: int = Field(0, description="seed of the sampling generator (used when temperature > 0)")
    batch_schedule: dict[int, dict[str, Any]] | None = Field(
        None, description="settings by batch size: {N: {option: value, ...}}; a decode of B sequences uses the "
        "entry of the largest N <= B over these options (a part's options merge into the part's; a part named "
        "anew starts from its defaults), B below every N these options alone")

    @field_validator("batch_schedule")
    @classmethod
    def _schedule_keys(cls, value: dict[int, dict[str, Any]] | None) -> dict[int, dict[str, Any]] | None:
        for n, entry in (value or {}).items():
            if n < 1:
                raise ValueError(f"entry {n}: batch sizes are at least 1")
            if not isinstance(entry, dict):
                raise ValueError(f"entry {n}: give a mapping of options, got {entry!r}")
            for key in ("decoder", "batch_schedule"):
                if key in entry:
                    raise ValueError(f"entry {n}: {key!r} cannot be scheduled")
        return value


class Decoder(ABC):
    """A decoding loop built from parts. Subclasses implement :meth:`_decode`."""

    name: ClassVar[str]
    Options: ClassVar[type[DecoderOptions]] = DecoderOptions
    #: attention kinds of the backbones this decoder can drive
    attention: ClassVar[tuple[str, ...]] = ("causal",)

    def __init__(self, backbone: "Backbone", options: DecoderOptions, parts: dict[str, Part]) -> None:
        if backbone.attention not in self.attention:
            raise ValueError(
                f"decoder {self.name!r} needs a model with {' or '.join(self.attention)} attention, "
                f"but this model's attention is {backbone.attention!r}"
            )
        self.backbone = backbone
        self.options = options
        self.parts = parts
        #: batch size -> the decoder of that ``batch_schedule`` entry (filled by ``build_decoder``)
        self.schedule: dict[int, Decoder] = {}

    def for_batch(self, n: int) -> "Decoder":
        """The decoder that decodes a batch of ``n`` sequences: the ``batch_schedule`` entry of the largest
        batch size <= n, else this one."""
        keys = [k for k in self.schedule if k <= n]
        return self.schedule[max(keys)] if keys else self

    #: True when :meth:`_decode_batch` decodes several prompts in shared forward calls; otherwise
    #: :meth:`generate_batch` decodes them one after another with :meth:`generate`
    batched: ClassVar[bool] = False

    def generate(self, prompt_ids: list[int], on_commit: Callable[[Commit], None] | None = None) -> DecodeResult:
        """Decode a completion of ``prompt_ids``; stats count only this call's forwards. ``on_commit``
        receives each :class:`~refusion.core.loop.Commit` (output that has become final) as it happens."""
        return exhaust(self.stream(prompt_ids), on_commit)

    def stream(self, prompt_ids: list[int]) -> Generator[Commit, None, DecodeResult]:
        """Decode a completion of ``prompt_ids``, yielding its commits (concatenated: the output, left to
        right; a committed token never changes) and returning the :class:`DecodeResult`."""
        if (chosen := self.for_batch(1)) is not self:
            return (yield from chosen.stream(prompt_ids))
        prompt_ids = self._checked_prompt(prompt_ids)
        nfe0, tok0 = self.backbone.nfe, self.backbone.tokens_in
        t0 = time.perf_counter()
        out = yield from self._decode_steps(prompt_ids, self.new_generator())
        self.backbone.check_finite()  # one synchronisation: every queued kernel has run
        wall = time.perf_counter() - t0
        stats = DecodeStats(
            generated_tokens=len(out.token_ids), nfe=self.backbone.nfe - nfe0,
            tokens_in=self.backbone.tokens_in - tok0, wall_s=wall, iterations=len(out.trace),
            tpf_reference_mean=out.tpf_reference_mean, extra=out.extra,
        )
        return self._result(out, stats)

    def generate_batch(self, prompts: list[list[int]],
                       on_commit: Callable[[int, Commit], None] | None = None) -> list[DecodeResult]:
        """Decode a completion of each prompt; results in prompt order. ``on_commit(i, commit)`` receives
        prompt i's commits as they happen.

        A decoder with ``batched = True`` decodes them together (:meth:`_decode_batch`): each forward call
        serves every sequence still decoding, and a finished sequence leaves the batch. Each result's
        stats then count the forward calls it took part in (``nfe``), the tokens fed in its rows, its
        latency from the batch's start (``wall_s``) and the batch's totals (``batch_*``). Other decoders
        (the default for a third-party decoder) run :meth:`generate` on each prompt in turn. With a
        ``batch_schedule``, the decoder of its entry for ``len(prompts)`` decodes them (:meth:`for_batch`)."""
        if (chosen := self.for_batch(len(prompts))) is not self:
            return chosen.generate_batch(prompts, on_commit)
        prompts = [self._checked_prompt(p) for p in prompts]
        if not self.batched or len(prompts) == 1:
            return [self.generate(p, None if on_commit is None else (lambda c, i=i: on_commit(i, c)))
                    for i, p in enumerate(prompts)]
        attn = getattr(self.backbone.model.config, "_attn_implementation", None)
        if attn == "flash_attention_2":
            raise ValueError(
                "a batch attends through per-row 4D attention masks, which attn_implementation "
                "'flash_attention_2' does not take; use sdpa or eager (--attn-implementation), or batch size 1"
            )
        nfe0 = self.backbone.nfe
        t0 = time.perf_counter()
        outs = self._decode_batch(prompts, self.new_generator(), on_commit=on_commit)
        self.backbone.check_finite()
        end = time.perf_counter()
        batch_tokens = sum(len(o.token_ids) for o in outs)
        results = []
        for out in outs:
            stats = DecodeStats(
                generated_tokens=len(out.token_ids), nfe=int(out.nfe or 0), tokens_in=int(out.tokens_in or 0),
                wall_s=(out.finished_at or end) - t0, iterations=len(out.trace),
                tpf_reference_mean=out.tpf_reference_mean, batch_size=len(prompts), batch_wall_s=end - t0,
                batch_nfe=self.backbone.nfe - nfe0, batch_tokens=batch_tokens, extra=out.extra,
            )
            results.append(self._result(out, stats))
        return results

    def new_generator(self) -> torch.Generator:
        """A sampling generator on the model's device, seeded with the ``seed`` option."""
        return torch.Generator(device=self.backbone.device).manual_seed(self.options.seed)

    def _checked_prompt(self, prompt_ids: list[int]) -> list[int]:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        self.backbone.check_length(len(prompt_ids), self.options.gen_length)
        return prompt_ids

    def _result(self, out: LoopOutput, stats: DecodeStats) -> DecodeResult:
        text = self.backbone.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return DecodeResult(text=text, token_ids=out.token_ids, stats=stats, trace=out.trace,
                            buffer_ids=out.buffer_ids, buffer_pos=out.buffer_pos)

    @abstractmethod
    def _decode(self, prompt_ids: list[int], generator: torch.Generator) -> LoopOutput:
        """Run the loop on a validated, non-empty prompt."""

    def _decode_steps(self, prompt_ids: list[int], generator: torch.Generator) -> Generator[Commit, None, LoopOutput]:
        """:meth:`_decode` as a stream of commits. This default commits the whole output at the end; a
        decoder written as a loop (:class:`~refusion.decoders.common.LoopDecoder`) commits as it goes."""
        out = self._decode(prompt_ids, generator)
        if out.token_ids:
            P = len(prompt_ids)
            yield Commit(list(range(P, P + len(out.token_ids))), list(out.token_ids))
        return out

    def _decode_batch(self, prompts: list[list[int]], generator: torch.Generator,
                      on_commit: Callable[[int, Commit], None] | None = None) -> list[LoopOutput]:
        """Run the loop on several validated, non-empty prompts in shared forward calls (``batched``
        decoders only); each output fills ``nfe``, ``tokens_in`` and ``finished_at``."""
        raise NotImplementedError(f"decoder {self.name!r} has no batched loop")
