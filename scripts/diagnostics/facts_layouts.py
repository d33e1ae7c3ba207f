"""Write the facts train/validation splits in one of three answer layouts, as JSON for ``refusion train``.

    python scripts/diagnostics/facts_layouts.py LAYOUT OUT_DIR     # LAYOUT: v2 | walk_value_first | walk

``v2``: options "- swan (A)", answer "The animal of X is the owl (B). The answer is B."
``walk_value_first``: same options, answer "The animal of X is the owl. swan (A) no, owl (B) yes, ... The answer is B."
``walk`` (the v3 task): options "- (A) swan", answer "The animal of X is the owl. (A) swan no, (B) owl yes, ... The answer is B."
Statements (train's "What is the capital of X?" examples) are kept as they are.
"""
import json
import re
import sys
from pathlib import Path

from refusion.tasks.facts import ATTRIBUTES, LETTERS, FactsTask

task = FactsTask()
layout, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)


def convert(ex):
    if ex.answer not in LETTERS:  # a statement
        return ex.query, ex.response
    question, *lines = ex.query.splitlines()
    options = [re.sub(r" \([A-D]\)$", "", re.sub(r"^- (\([A-D]\) )?", "", line)) for line in lines]
    attribute = next(a for a in ATTRIBUTES if a.name == ex.meta["attribute"])
    statement = task.statement(ex.meta["country"], attribute)
    value = task.facts[ex.meta["country"]][attribute.name]
    judged = [(L, o, "yes" if o == value else "no") for L, o in zip(LETTERS, options)]
    if layout == "v2":
        q = "\n".join([question] + [f"- {o} ({L})" for L, o, _ in judged])
        return q, f"{statement[:-1]} ({ex.answer}). The answer is {ex.answer}."
    if layout == "walk_value_first":
        q = "\n".join([question] + [f"- {o} ({L})" for L, o, _ in judged])
        return q, f"{statement} {', '.join(f'{o} ({L}) {j}' for L, o, j in judged)}. The answer is {ex.answer}."
    if layout == "walk":
        q = "\n".join([question] + [f"- ({L}) {o}" for L, o, _ in judged])
        return q, f"{statement} {', '.join(f'({L}) {o} {j}' for L, o, j in judged)}. The answer is {ex.answer}."
    raise SystemExit(f"unknown layout {layout!r}; expected v2, walk_value_first or walk")


for split, n in (("train", 7200), ("validation", 100)):
    rows = [dict(zip(("query", "response"), convert(ex)), answer=ex.answer) for ex in task.examples(split, n)]
    (out / f"{split}.json").write_text(json.dumps(rows, indent=0))
print(rows[0])
