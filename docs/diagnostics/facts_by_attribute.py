"""facts, split by attribute: where do the misses fall, and can the model judge the walk's options?

    python docs/diagnostics/facts_by_attribute.py accuracy RUN_DIR [RUN_DIR ...]
        per run of each bench/ablate output folder: right answers per attribute (validation split)
    python docs/diagnostics/facts_by_attribute.py judge MODEL [MODEL ...]
        teacher-forced on the gold answers of the validation capital questions, natural order: how often
        the model's next-token logits rank the gold judgement (" yes" / " no") above the other one
"""

from __future__ import annotations

import collections
import json
import re
import sys

import torch

from refusion.tasks import get_task


def attribute(response: str) -> str:
    return re.match(r"The (\w+)", response).group(1)


def accuracy(folders: list[str]) -> None:
    gold = get_task("facts").examples("validation")
    for folder in folders:
        right, total = collections.Counter(), collections.Counter()
        models = {}
        for rec in map(json.loads, open(f"{folder}/samples.jsonl")):
            if rec["task"] != "facts":
                continue
            key = (rec["run"], attribute(gold[rec["idx"]].response))
            total[key] += 1
            right[key] += rec["correct"]
            models[rec["run"]] = rec["model"]
        for run, model in models.items():
            cells = ", ".join(f"{a} {right[run, a]}/{total[run, a]}" for r, a in sorted(total) if r == run)
            print(f"{folder} {run} ({model}): {cells}")


def judge(models: list[str]) -> None:
    from refusion.cli import encode_prompt
    from refusion.models.backend import Backbone

    questions = [e for e in get_task("facts").examples("validation") if attribute(e.response) == "capital"]
    for path in models:
        bb = Backbone.from_pretrained(path)
        tok = bb.tokenizer
        (yes,), (no,) = tok.encode(" yes", add_special_tokens=False), tok.encode(" no", add_special_tokens=False)
        counts = collections.Counter()
        for e in questions:
            prompt, answer = encode_prompt(tok, e.query), tok.encode(e.response, add_special_tokens=False)
            ids = torch.tensor([prompt + answer])
            with torch.no_grad():
                logits = bb.model(ids, attention_mask=torch.ones_like(ids)).logits[0]  # [T, V]
            for j, t in enumerate(answer):
                if t in (yes, no):
                    row = logits[len(prompt) + j - 1]
                    guess = yes if row[yes] > row[no] else no
                    counts["yes" if t == yes else "no", guess == t] += 1
        print(f"{path}: gold yes judged right {counts['yes', True]}/{counts['yes', True] + counts['yes', False]}, "
              f"gold no judged right {counts['no', True]}/{counts['no', True] + counts['no', False]}")


if __name__ == "__main__":
    {"accuracy": accuracy, "judge": judge}[sys.argv[1]](sys.argv[2:])
