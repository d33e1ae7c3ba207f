"""``arith``: word problems made of 3-4 independent sub-computations and a final sum.

Each person in the story gets some objects by one small operation, stated on its own line of the query
(so that a sentence and its restatement in the answer start with the same token)::

    Ava buys 3 bags of 7 pens.
    Ben has 25 pens and finds 4 more.
    Cora has 30 pens and gives 7 away.
    How many pens do they have in total?

The response restates each part and works it out on its own line, then adds the results two at a time::

    Ava buys 3 bags of 7 pens, so Ava has 3 * 7 = 21 pens.
    Ben has 25 pens and finds 4 more, so Ben has 25 + 4 = 29 pens.
    Cora has 30 pens and gives 7 away, so Cora has 30 - 7 = 23 pens.
    Total: 21 + 29 + 23 = 50 + 23 = 73.
    #### 73

Numbers stay small so that a ~3M-parameter model can learn them: products are (2-5) x (2-9), sums
add 2-9 to 4-29, differences take 2-9 from 12-39; totals stay below 180. Scoring is exact match on the
integer after ``####``.

``arith_hard`` (:class:`ArithHardTask`), the harder level: always 4 parts, and a sum or difference
adds or takes 2-11 instead of 2-9, so some parts carry two two-digit operands, which the models were
not trained on.

Response length in tokens of the shipped tokenizer (``python -m refusion.tasks``, all splits):
min 96, p10 105, median 134, p90 151, max 156 (queries: median 49, max 57). ``max_new_tokens`` = 224:
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


def _part(rng: random.Random, name: str, obj: str, step_max: int = 9) -> tuple[str, str, int]:
    """One sub-computation: (query sentence, response line, value). The line restates the sentence.
    ``step_max``: the largest number a sum adds or a difference takes."""
    kind = rng.choice(("mul", "add", "sub"))
    if kind == "mul":
        a, b = rng.randint(2, 5), rng.randint(2, 9)
        sentence = f"{name} buys {a} {rng.choice(CONTAINERS)} of {b} {obj}"
        return f"{sentence}.", f"{sentence}, so {name} has {a} * {b} = {a * b} {obj}.", a * b
    if kind == "add":
        a, b = rng.randint(4, 29), rng.randint(2, step_max)
        sentence = f"{name} has {a} {obj} and finds {b} more"
        return f"{sentence}.", f"{sentence}, so {name} has {a} + {b} = {a + b} {obj}.", a + b
    a, b = rng.randint(12, 39), rng.randint(2, step_max)
    sentence = f"{name} has {a} {obj} and gives {b} away"
    return f"{sentence}.", f"{sentence}, so {name} has {a} - {b} = {a - b} {obj}.", a - b


def total_line(values: list[int]) -> str:
    """``Total: a + b + c = (a+b) + c = ...``: the sum reduced two terms at a time."""
    steps = [" + ".join(map(str, values))]
    while len(values) > 1:
        values = [values[0] + values[1], *values[2:]]
        steps.append(" + ".join(map(str, values)))
    return f"Total: {' = '.join(steps)}."


class ArithTask(Task):
    name = "arith"
    max_new_tokens = 224
    sizes = {"train": 20000, "validation": 200, "test": 200}
    parts = (3, 4)  # how many people (sub-computations), inclusive range
    step_max = 9  # the largest number a sum adds or a difference takes

    def sample(self, rng: random.Random) -> Example:
        obj = rng.choice(OBJECTS)
        parts = [_part(rng, name, obj, self.step_max) for name in rng.sample(NAMES, rng.randint(*self.parts))]
        total = sum(value for _, _, value in parts)
        query = "\n".join([q for q, _, _ in parts] + [f"How many {obj} do they have in total?"])
        lines = [line for _, line, _ in parts] + [total_line([v for _, _, v in parts]), f"#### {total}"]
        return Example(self.name, query, "\n".join(lines), str(total), {})

    def extract(self, completion: str) -> str | None:
        match = _ANSWER.search(completion)
        return str(int(match.group(1))) if match else None

    def score(self, example: Example, completion: str) -> bool:
        return self.extract(completion) == example.answer


class ArithHardTask(ArithTask):
    """The harder level: 4 parts, sums and differences with 2-11."""

    name = "arith_hard"
    split_name = "arith"
    sizes = {"train": 0, "validation": 200, "test": 200}
    parts = (4, 4)
    step_max = 11
