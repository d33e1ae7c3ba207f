"""The task interface of tinybench: an :class:`Example` record and the :class:`Task` base class.

Splits are made disjoint by construction: every query is hashed (with the task name; a harder level
of a task with its base task's name, so that no query of its test split is in the base task's train
split) into one of 20 buckets; bucket 0 belongs to ``test``, bucket 1 to ``validation`` and the rest to ``train``. Each split
draws candidates from its own seeded generator (``random.Random(f"{task}:{split}")``) and keeps those
that hash into it, so a split never needs the others to be generated, ``examples(split, n)`` is a
prefix of ``examples(split, m)`` for ``n < m``, and no query of one split can appear in another.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import lru_cache

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Example:
    task: str  # "arith" | "code" | "facts"
    query: str  # the prompt text (no chat template)
    response: str  # the gold response (chain of thought / code / answer), without eos
    answer: str  # the gold final answer used for scoring
    meta: dict = field(default_factory=dict)  # task-specific, JSON-serialisable


def split_of(task: str, query: str) -> str:
    """The split a query belongs to (5% test, 5% validation, 90% train)."""
    bucket = int.from_bytes(hashlib.sha256(f"{task}\0{query}".encode()).digest()[:8], "big") % 20
    return SPLITS[2] if bucket == 0 else SPLITS[1] if bucket == 1 else SPLITS[0]


class Task(ABC):
    """A generated task: deterministic splits, answer extraction and scoring."""

    name: str
    split_name: str = ""  # whose hash buckets decide the splits (default: ``name``; a harder level: its base task's)
    max_new_tokens: int
    sizes: dict[str, int]  # default size of each split
    chance_accuracy: float = 0.0  # the accuracy of guessing (1/4 on four-option multiple choice)

    def examples(self, split: str, n: int | None = None) -> list[Example]:
        """The first ``n`` examples (default: the split's size) of a split, the same on every call."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        n = self.sizes[split] if n is None else n
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return list(self._cached(split, n))

    @lru_cache(maxsize=16)
    def _cached(self, split: str, n: int) -> tuple[Example, ...]:
        return tuple(self._generate(split, n))

    def _generate(self, split: str, n: int) -> list[Example]:
        """Draw from the split's seeded generator, keeping new queries that hash into the split."""
        rng = random.Random(f"{self.name}:{split}")
        out: list[Example] = []
        seen: set[str] = set()
        while len(out) < n:
            example = self.sample(rng)
            if example.query not in seen and split_of(self.split_name or self.name, example.query) == split:
                seen.add(example.query)
                out.append(example)
        return out

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """One random example (its split is decided by :func:`split_of`)."""

    @abstractmethod
    def extract(self, completion: str) -> str | None:
        """The answer a model completion gives, or None when it gives none."""

    @abstractmethod
    def score(self, example: Example, completion: str) -> bool:
        """Whether a completion solves the example."""
