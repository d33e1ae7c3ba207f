"""``arith``: word problems made of 3-5 independent sub-computations and a final sum.

Each person in the story gets some objects by one small operation, stated in the query::

    Ava buys 3 bags of 12 pens. Ben has 25 pens and finds 14 more. Cora has 40 pens and gives 15 away.
    How many pens do they have in total?

The response works each part out on its own line, then adds the results two at a time::

    Ava has 3 * 12 = 36 pens.
    Ben has 25 + 14 = 39 pens.
    Cora has 40 - 15 = 25 pens.
    Total: 36 + 39 + 25 = 75 + 25 = 100.
    #### 100

Numbers stay small so that a ~3M-parameter model can learn them: products are (2-6) x (2-12),
sums add two numbers of 3-39, differences take 2-19 from 20-60; totals stay below 400.
Scoring is exact match on the integer after ``####``.

Response length in tokens of the shipped tokenizer (``python -m refusion.tasks``, all splits):
min 64, p10 72, median 105, p90 141, max 146 (queries: median 56, max 74). ``max_new_tokens`` = 192:
the longest gold response plus ~30%, rounded up to a multiple of 32.
"""

from __future__ import annotations

import random
import re

from refusion.tasks.base import Example, Task

NAMES = (
    "Ava", "Ben", "Cora", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jack", "Kim", "Leo",
    "Mia", "Ned", "Olga", "Paul", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yara", "Zoe",
)
OBJECTS = (
    "apples", "pens", "books", "cards", "shells", "coins", "eggs", "stickers", "marbles",
    "cookies", "stamps", "beads",
)
CONTAINERS = ("bags", "boxes", "packs", "jars", "baskets", "bowls")
_ANSWER = re.compile(r"####\s*(-?\d+)")


def _part(rng: random.Random, name: str, obj: str) -> tuple[str, str, int]:
    """One sub-computation: (query sentence, response line, value)."""
    kind = rng.choice(("mul", "add", "sub"))
    if kind == "mul":
        a, b = rng.randint(2, 6), rng.randint(2, 12)
        container = rng.choice(CONTAINERS)
        return f"{name} buys {a} {container} of {b} {obj}.", f"{name} has {a} * {b} = {a * b} {obj}.", a * b
    if kind == "add":
        a, b = rng.randint(3, 39), rng.randint(3, 39)
        return f"{name} has {a} {obj} and finds {b} more.", f"{name} has {a} + {b} = {a + b} {obj}.", a + b
    a, b = rng.randint(20, 60), rng.randint(2, 19)
    return f"{name} has {a} {obj} and gives {b} away.", f"{name} has {a} - {b} = {a - b} {obj}.", a - b


def total_line(values: list[int]) -> str:
    """``Total: a + b + c = (a+b) + c = ...``: the sum reduced two terms at a time."""
    steps = [" + ".join(map(str, values))]
    while len(values) > 1:
        values = [values[0] + values[1], *values[2:]]
        steps.append(" + ".join(map(str, values)))
    return f"Total: {' = '.join(steps)}."


class ArithTask(Task):
    name = "arith"
    max_new_tokens = 192
    sizes = {"train": 20000, "validation": 200, "test": 200}

    def sample(self, rng: random.Random) -> Example:
        obj = rng.choice(OBJECTS)
        parts = [_part(rng, name, obj) for name in rng.sample(NAMES, rng.randint(3, 5))]
        total = sum(value for _, _, value in parts)
        query = " ".join(q for q, _, _ in parts) + f" How many {obj} do they have in total?"
        lines = [line for _, line, _ in parts] + [total_line([v for _, _, v in parts]), f"#### {total}"]
        return Example(self.name, query, "\n".join(lines), str(total), {})

    def extract(self, completion: str) -> str | None:
        match = _ANSWER.search(completion)
        return str(int(match.group(1))) if match else None

    def score(self, example: Example, completion: str) -> bool:
        return self.extract(completion) == example.answer
