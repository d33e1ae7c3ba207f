"""``code``: write a small Python function from a spec built by a fixed grammar.

A function takes a list of integers (and sometimes an integer ``k``), may return early on a guard,
keeps the elements that satisfy one or two predicates, maps each kept element through 1-3
arithmetic steps (none for a count), and reduces the results (sum, count, largest, smallest, list,
sorted list)::

    Write a Python function tally(nums) that takes a list of integers nums. If the list is empty,
    return 0. Keep the numbers that are even and greater than 3. For each one, multiply by 3, then
    add 1. Return the sum of the results.

    def tally(nums):
        if not nums:
            return 0
        result = []
        for x in nums:
            if x % 2 == 0 and x > 3:
                y = x * 3
                y = y + 1
                result.append(y)
        return sum(result)

Every spec sentence maps to fixed lines of code, so the parts can be written independently. The
hidden tests are 3-5 ``assert`` lines whose expected values come from evaluating the spec on seeded
inputs (about half of each list passes the filter; the expected values are not all equal). pass@1:
the completion's function (from its first ``def`` to the end of that indented block; a surrounding
```python fence is fine) passes every assert in the sandbox, and the run reaches its end.

Response length in tokens of the shipped tokenizer (``python -m refusion.tasks``, all splits):
min 31, p10 45, median 61, p90 76, max 91 (queries: median 57, max 86). ``max_new_tokens`` = 128:
the longest gold response plus ~30%, rounded up to a multiple of 32.

``code_hard`` (:class:`CodeHardTask`), the harder level: every function that maps takes 3-4 map steps
(``code`` takes 1-3), so its programs are longer than any the models were trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache
from typing import Callable

from refusion.tasks.base import Example, Task
from refusion.tasks.sandbox import run_sandboxed

FUNCTION_NAMES = (
    "solve", "process", "compute", "score", "transform", "collect", "measure", "summarize",
    "pick", "gather", "tally", "evaluate", "scan", "combine", "select", "digest",
)
LIST_NAMES = ("nums", "xs", "values", "items", "data")
PASSED = "all tests passed"


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: fast cache keys
class Rule:
    """A grammar element: spec text and code templates (``{c}`` a constant drawn from ``lo..hi``,
    ``{v}`` the input variable of a map step) and its meaning ``fn(value, k, c)``."""

    group: str  # a filter takes at most one predicate of a group; "map" for map steps
    text: str
    code: str
    fn: Callable[[int, int, int], object]
    lo: int = 0
    hi: int = 0


PREDICATES = (
    Rule("parity", "even", "x % 2 == 0", lambda x, k, c: x % 2 == 0),
    Rule("parity", "odd", "x % 2 == 1", lambda x, k, c: x % 2 == 1),
    Rule("bound", "positive", "x > 0", lambda x, k, c: x > 0),
    Rule("bound", "negative", "x < 0", lambda x, k, c: x < 0),
    Rule("bound", "greater than {c}", "x > {c}", lambda x, k, c: x > c, 0, 9),
    Rule("bound", "less than {c}", "x < {c}", lambda x, k, c: x < c, 0, 9),
    Rule("divisor", "divisible by {c}", "x % {c} == 0", lambda x, k, c: x % c == 0, 3, 5),
    Rule("equal", "not equal to {c}", "x != {c}", lambda x, k, c: x != c, 0, 9),
)
K_PREDICATES = (
    Rule("bound", "greater than k", "x > k", lambda x, k, c: x > k),
    Rule("bound", "less than k", "x < k", lambda x, k, c: x < k),
)
MAPS = (
    Rule("map", "add {c}", "{v} + {c}", lambda v, k, c: v + c, 1, 9),
    Rule("map", "subtract {c}", "{v} - {c}", lambda v, k, c: v - c, 1, 9),
    Rule("map", "multiply by {c}", "{v} * {c}", lambda v, k, c: v * c, 2, 5),
    Rule("map", "square it", "{v} * {v}", lambda v, k, c: v * v),
    Rule("map", "negate it", "-{v}", lambda v, k, c: -v),
    Rule("map", "take the absolute value", "abs({v})", lambda v, k, c: abs(v)),
    Rule("map", "take the remainder modulo {c}", "{v} % {c}", lambda v, k, c: v % c, 3, 7),
)
K_MAPS = (
    Rule("map", "add k", "{v} + k", lambda v, k, c: v + k),
    Rule("map", "multiply by k", "{v} * k", lambda v, k, c: v * k),
)
INPUTS = range(-9, 21)  # list elements of the hidden tests
K_VALUES = range(-3, 10)


@dataclass(frozen=True, eq=False)
class Reduce:
    kind: str
    text: str
    code: tuple[str, ...]  # the function's closing lines
    fn: Callable[[list[int]], object]


REDUCES = (
    Reduce("sum", "Return the sum of the results.", ("    return sum(result)",), sum),
    Reduce("count", "Return how many numbers are kept.", ("    return len(result)",), len),
    Reduce("list", "Return the list of results.", ("    return result",), list),
    Reduce("sorted", "Return the results in increasing order.", ("    return sorted(result)",), sorted),
    *(
        Reduce(f"{kind}{d}", f"Return the {word} result, or {d} if there is none.",
               ("    if not result:", f"        return {d}", f"    return {kind}(result)"),
               lambda r, fn=fn, d=d: fn(r) if r else d)
        for kind, word, fn in (("max", "largest", max), ("min", "smallest", min)) for d in (0, -1)
    ),
)


@cache
def _filter(preds: tuple[tuple[Rule, int], ...], k: int) -> tuple[frozenset[int], tuple[int, ...]]:
    """(the test input values that pass the filter, the values to draw from: all, and those again)."""
    kept = tuple(x for x in INPUTS if all(rule.fn(x, k, c) for rule, c in preds))
    return frozenset(kept), tuple(INPUTS) + kept


def _instantiate(rule: Rule, rng: random.Random) -> tuple[Rule, int]:
    return rule, (rng.randint(rule.lo, rule.hi) if "{c}" in rule.text else 0)


class CodeTask(Task):
    name = "code"
    max_new_tokens = 128
    sizes = {"train": 20000, "validation": 200, "test": 200}
    maps = (1, 3)  # map steps of a function that maps, inclusive range

    def sample(self, rng: random.Random) -> Example:
        fname, arr = rng.choice(FUNCTION_NAMES), rng.choice(LIST_NAMES)
        reduce = rng.choice(REDUCES)
        returns_list = reduce.kind in ("list", "sorted")
        uses_k = rng.random() < 0.4
        params = f"{arr}, k" if uses_k else arr

        # the filter (1-2 predicates of distinct groups) and the maps (1-3, none for a count);
        # a function taking k always uses it, in a predicate or a map
        n_maps = 0 if reduce.kind == "count" else rng.randint(*self.maps)
        k_in_map = uses_k and n_maps > 0 and rng.random() < 0.5
        n_preds = rng.randint(1, 2)
        preds = [(rng.choice(K_PREDICATES), 0)] if uses_k and not k_in_map else []
        for rule in rng.sample(PREDICATES, len(PREDICATES)):
            if len(preds) < n_preds and rule.group not in {r.group for r, _ in preds}:
                preds.append(_instantiate(rule, rng))
        if len(preds) == 2 and any(r.group == "divisor" and c == 4 for r, c in preds):  # "odd and divisible by 4"
            preds = [(r, c) for r, c in preds if r.group != "parity"]
        maps = [_instantiate(rule, rng) for rule in rng.sample(MAPS, n_maps - k_in_map)]
        if k_in_map:
            maps.insert(rng.randint(0, len(maps)), (rng.choice(K_MAPS), 0))

        spec = [f"Write a Python function {fname}({params}) that takes a list of integers {arr}"
                + (" and an integer k." if uses_k else ".")]
        code = [f"def {fname}({params}):"]
        guard: tuple[Callable[[list[int], int], bool], object] | None = None
        if rng.random() < 0.6:
            value = "[]" if returns_list else str(rng.choice((0, -1)))
            size = rng.randint(2, 4)
            text, test, check = rng.choice((
                ("the list is empty", f"not {arr}", lambda xs, k: not xs),
                (f"the list has fewer than {size} elements", f"len({arr}) < {size}", lambda xs, k: len(xs) < size),
                *([("k is negative", "k < 0", lambda xs, k: k < 0)] if uses_k else []),
            ))
            spec.append(f"If {text}, return {value}.")
            code += [f"    if {test}:", f"        return {value}"]
            guard = (check, [] if returns_list else int(value))
        spec.append("Keep the numbers that are " + " and ".join(r.text.format(c=c) for r, c in preds) + ".")
        code += ["    result = []", f"    for x in {arr}:",
                 "        if " + " and ".join(r.code.format(c=c) for r, c in preds) + ":"]
        if maps:
            spec.append("For each one, " + ", then ".join(r.text.format(c=c) for r, c in maps) + ".")
        var = "x"
        for rule, c in maps:
            code.append(f"            y = {rule.code.format(v=var, c=c)}")
            var = "y"
        code += [f"            result.append({var})", *reduce.code]
        spec.append(reduce.text)

        k_matters = any(rule in K_PREDICATES for rule, _ in preds)

        def run(xs: list[int], k: int) -> object:
            if guard is not None and guard[0](xs, k):
                return guard[1]
            passing = _filter(tuple(preds), k if k_matters else 0)[0]
            kept = []
            for x in xs:
                if x in passing:
                    for rule, c in maps:
                        x = rule.fn(x, k, c)
                    kept.append(x)
            return reduce.fn(kept)

        tests = self._tests(rng, fname, uses_k, tuple(preds), k_matters, run)
        return Example(self.name, " ".join(spec), "\n".join(code), fname, {"tests": tests, "entry": fname})

    @staticmethod
    def _tests(rng: random.Random, fname: str, uses_k: bool, preds: tuple[tuple[Rule, int], ...], k_matters: bool,
               run: Callable[[list[int], int], object]) -> list[str]:
        """3-5 asserts on lists of 0-8 elements, about half of which pass the filter; resampled (a few
        times) until the expected values are not all the same."""
        for _ in range(8):
            cases = []
            for _ in range(rng.randint(3, 5)):
                k = rng.choice(K_VALUES)
                cases.append((rng.choices(_filter(preds, k if k_matters else 0)[1], k=rng.randint(0, 8)), k))
            expected = [run(xs, k) for xs, k in cases]
            if any(e != expected[0] for e in expected):
                break
        return [f"assert {fname}({f'{xs}, {k}' if uses_k else xs}) == {e!r}" for (xs, k), e in zip(cases, expected)]

    def extract(self, completion: str) -> str | None:
        lines = completion.splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("def ")), None)
        if start is None:
            return None
        indent = len(lines[start]) - len(lines[start].lstrip())
        block = [lines[start][indent:]]
        for line in lines[start + 1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break
            block.append(line[indent:])
        return "\n".join(block).rstrip() + "\n"

    def score(self, example: Example, completion: str) -> bool:
        source = self.extract(completion)
        if source is None:
            return False
        result = run_sandboxed("\n".join([source, *example.meta["tests"], f"print({PASSED!r})", ""]))
        return result.ok and result.stdout.endswith(PASSED + "\n")  # an exit(0) in the function is no pass


class CodeHardTask(CodeTask):
    """The harder level: a function that maps takes 3-4 map steps (4 is longer than any trained program)."""

    name = "code_hard"
    split_name = "code"
    maps = (3, 4)
