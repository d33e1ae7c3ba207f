"""What decoding loops share: :class:`LoopDecoder` (a decoder written as one generator loop), the
tracker of the output's final prefix (:class:`FinalPrefix`) and cutting at EOS."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Generator

import torch

from refusion.core.interfaces import Decoder
from refusion.core.loop import Commit, LoopSteps, drive, exhaust, run_loops
from refusion.core.types import LoopOutput
from refusion.models.kvcache import RaggedCache


def cut_after_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """``ids`` up to and including the first EOS."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


class FinalPrefix:
    """The left-to-right prefix of a loop's output that can no longer change, as :class:`Commit` events.

    A loop tells it the tokens it has decided (:meth:`learn`: sequence positions and token ids, in any
    order); :meth:`commit` returns the tokens that extend the contiguous decided prefix of the output
    (from ``prompt_len``), cut after the first EOS and at ``gen_length`` tokens, or None. :meth:`finish`
    commits the rest of the loop's final output and checks that the commits are a prefix of it."""

    def __init__(self, prompt_len: int, gen_length: int, eos_ids: set[int]) -> None:
        self.prompt_len, self.gen_length, self.eos_ids = prompt_len, gen_length, eos_ids
        self.decided: dict[int, int] = {}  # position -> token
        self.sent: list[int] = []  # committed tokens, in output order
        self.closed = False  # the output ended (EOS or gen_length)

    def learn(self, positions: list[int], token_ids: list[int]) -> None:
        self.decided.update(zip(positions, token_ids))

    def commit(self) -> Commit | None:
        start = self.prompt_len + len(self.sent)
        new: list[int] = []
        while not self.closed and start + len(new) in self.decided:
            token = self.decided[start + len(new)]
            new.append(token)
            self.closed = token in self.eos_ids or len(self.sent) + len(new) >= self.gen_length
        if not new:
            return None
        self.sent += new
        return Commit(list(range(start, start + len(new))), new)

    def finish(self, output: list[int]) -> Commit | None:
        """The final ``output``'s tokens not committed yet (None if none); raises if a commit disagrees."""
        if output[: len(self.sent)] != self.sent:
            raise RuntimeError(f"a committed token changed: committed {self.sent}, output {output}")
        rest = output[len(self.sent) :]
        start = self.prompt_len + len(self.sent)
        self.sent += rest
        self.closed = True
        return Commit(list(range(start, start + len(rest))), rest) if rest else None

    def end(self, prompt_ids: list[int], output: list[int], trace: list) -> Generator[Commit, None, LoopOutput]:
        """Commit the rest of ``output`` (:meth:`finish`) and return the loop's output, whose buffer is the
        prompt followed by ``output`` in position order."""
        if commit := self.finish(output):
            yield commit
        return LoopOutput(output, trace, list(prompt_ids) + output, list(range(len(prompt_ids) + len(output))))


class LoopDecoder(Decoder):
    """A decoder written as one generator loop over the loop protocol (:mod:`refusion.core.loop`).

    Subclasses implement :meth:`_loop` for one sequence; the single decode (:meth:`_decode`), the stream
    of commits and the batched decode (:meth:`_decode_batch`, a ragged batch whose sequences may sit at
    different stages) all run that one body. In a batch each sequence samples from its own generator,
    seeded as a single decode's, so a batched decode draws what the single decode draws."""

    batched = True
    #: whether the batched decode runs :meth:`batch_loop` over :meth:`new_batch_cache`, as a server's engine
    #: does (None: so when the subclass keeps :meth:`_decode_batch`; a subclass that overrides it around
    #: the default sets True)
    batch_by_batch_loop: bool | None = None

    @classmethod
    def serves_batch_loop(cls) -> bool:
        """Whether a server may run this decoder's loops from :meth:`batch_loop` (see ``batch_by_batch_loop``)."""
        if cls.batch_by_batch_loop is not None:
            return cls.batch_by_batch_loop
        return cls._decode_batch is LoopDecoder._decode_batch

    @abstractmethod
    def _loop(self, prompt_ids: list[int], generator: torch.Generator, cache) -> LoopSteps:
        """One sequence's decode on ``cache`` (a :class:`~refusion.core.loop.KVCache`): yields forward
        requests, reads and commits; returns its :class:`~refusion.core.types.LoopOutput`."""

    def _decode(self, prompt_ids, generator):
        return exhaust(self._decode_steps(prompt_ids, generator))

    def _decode_steps(self, prompt_ids, generator) -> Generator[Commit, None, LoopOutput]:
        return (yield from drive(self._loop(prompt_ids, generator, self.backbone.new_cache())))

    def new_batch_cache(self) -> RaggedCache:
        """The shared cache of a running batch of this decoder's loops (a server's engine keeps one)."""
        return RaggedCache(self.backbone)

    def batch_loop(self, prompt_ids: list[int], generator: torch.Generator, batch_cache: RaggedCache) -> LoopSteps:
        """One sequence's loop on a new view of ``batch_cache`` (from :meth:`new_batch_cache` of a decoder of
        the same class on the same backbone: loops of decoders that differ only in options share a batch)."""
        return self._loop(prompt_ids, generator, batch_cache.new_view())

    def _decode_batch(self, prompts, generator, on_commit: Callable[[int, Commit], None] | None = None):
        shared = self.new_batch_cache()
        loops = [self.batch_loop(p, self.new_generator(), shared) for p in prompts]
        return run_loops(loops, shared, on_commit=on_commit)
