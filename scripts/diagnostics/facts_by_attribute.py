"""facts, split by attribute: where do the misses fall, and can the model judge the walk's options?

    python scripts/diagnostics/facts_by_attribute.py accuracy [--split test] RUN_DIR [RUN_DIR ...]
        per run of each bench/ablate output folder: right answers per attribute (the folders' split:
        validation unless --split names another)
    python scripts/diagnostics/facts_by_attribute.py judge [--n N] MODEL [MODEL ...]
        teacher-forced on the gold answers of the validation capital questions, natural order: how often
        the model's next-token logits rank the gold judgement (" yes" / " no") above the other one, and
        on how many questions all four judgements are right; --n N: N capital questions drawn afresh
        (seed 0) among those whose query falls in the validation split, for a finer measure than the
        split's 39
    python scripts/diagnostics/facts_by_attribute.py layout MODEL [SLOT_SIZES]
        the `refusion` objective's training layout of the train split's capital questions (slot sizes:
        the objective's default, or e.g. 16,32; 5 draws each, seed 0, the MODEL's tokenizer): how often
        the right option's " yes" is a training target (AR: from the clean token before it; MDM: as a
        masked token) with the whole stated capital ("The capital of X is <value>.") visible to it, i.e.
        clean and earlier in the buffer
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


def accuracy(args: list[str]) -> None:
    split, folders = (args[1], args[2:]) if args[:1] == ["--split"] else ("validation", args)
    gold = get_task("facts").examples(split)
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


def capital_questions(n: int) -> list:
    """``n`` capital questions, drawn with seed 0, whose queries fall in the validation split."""
    import random

    from refusion.tasks import split_of
    from refusion.tasks.facts import ATTRIBUTES

    task, rng, out = get_task("facts"), random.Random(0), []
    countries = sorted(task.facts)
    while len(out) < n:
        e = task.question(rng, rng.choice(countries), ATTRIBUTES[0])
        if split_of("facts", e.query) == "validation":
            out.append(e)
    return out


def judge(args: list[str]) -> None:
    from refusion.models.tokenizer import encode_prompt
    from refusion.models.backend import Backbone

    n, models = (int(args[1]), args[2:]) if args[:1] == ["--n"] else (0, args)
    questions = (capital_questions(n) if n else
                 [e for e in get_task("facts").examples("validation") if attribute(e.response) == "capital"])
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
            all_right = True
            for j, t in enumerate(answer):
                if t in (yes, no):
                    row = logits[len(prompt) + j - 1]
                    guess = yes if row[yes] > row[no] else no
                    counts["yes" if t == yes else "no", guess == t] += 1
                    all_right &= guess == t
            counts["question", all_right] += 1
        print(f"{path}: gold yes judged right {counts['yes', True]}/{counts['yes', True] + counts['yes', False]}, "
              f"gold no judged right {counts['no', True]}/{counts['no', True] + counts['no', False]}, "
              f"every judgement right on {counts['question', True]}/{len(questions)} questions")


def layout(args: list[str]) -> None:
    from refusion.models.loading import load_pretrained
    from refusion.plugins.objectives import RefusionObjective
    from refusion.training.data import encode_pair

    _, tok = load_pretrained(args[0])
    questions = [e for e in get_task("facts").examples("train") if attribute(e.response) == "capital"
                 and " (A)" in e.response]
    options = {"slot_sizes": [int(k) for k in args[1].split(",")]} if len(args) > 1 else None
    objective = RefusionObjective.from_tokenizer(tok, options)
    (yes,) = tok.encode(" yes", add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    counts = collections.Counter()
    for _ in range(5):
        for start in range(0, len(questions), 64):
            pairs = [encode_pair(tok, e.query, e.response) for e in questions[start : start + 64]]
            batch = objective.make_batch(pairs, generator)
            for r, (prompt, response) in enumerate(pairs):
                pieces = [tok.decode([t]).strip() for t in response]
                value = {len(prompt) + k for k in range(pieces.index("is") + 1, pieces.index("."))}
                target = len(prompt) + response.index(yes)  # original position of the right option's " yes"
                ids, pos = batch.input_ids[r].tolist(), batch.position_ids[r].tolist()
                labels, masked = batch.labels[r].tolist(), batch.masked[r].tolist()
                for i in range(len(ids)):
                    if masked[i] and pos[i] == target:
                        kind = "MDM"
                    elif not masked[i] and pos[i] == target - 1 and labels[i] == yes:
                        kind = "AR"
                    else:
                        continue
                    visible = {pos[j] for j in range(i + 1) if ids[j] != objective.mask_id}
                    counts[kind, value <= visible] += 1
    draws = 5 * len(questions)
    for kind in ("AR", "MDM"):
        n = counts[kind, True] + counts[kind, False]
        print(f"{kind}: target in {n} of {draws} draws, the stated capital visible in {counts[kind, True]}")


if __name__ == "__main__":
    {"accuracy": accuracy, "judge": judge, "layout": layout}[sys.argv[1]](sys.argv[2:])
