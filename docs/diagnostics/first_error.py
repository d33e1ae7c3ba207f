"""Which ReFusion stage commits the first wrong token? Decodes validation samples with the bench's
per-task settings, and for each wrong answer finds the first token that differs from the gold response
and the iteration that committed it: Stage II-a or II-b, a slot's first token (accepted on its Stage-I
draft probability) or an inner one (passed the causal check or was the AR correction), how many
slots were chosen in that iteration, and whether all the text to its left was committed before it.

    python docs/diagnostics/first_error.py MODEL TASK N [KEY=VALUE ...]

KEY=VALUE override the bench settings (``verifier.token_threshold=0.9``). One thread.
"""
import collections
import sys

import torch

from refusion.cli import encode_prompt
from refusion.core.config import build_decoder
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.tasks import get_task

torch.set_num_threads(1)
model, task_name, n, overrides = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
bb = Backbone.from_pretrained(model)
task = get_task(task_name)
decoder = build_decoder(bb, load_bench_config().decoder_config(task_name, "refusion", task.max_new_tokens, overrides))
kinds: collections.Counter = collections.Counter()
wrong = 0
for i, ex in enumerate(task.examples("validation", n)):
    prompt = encode_prompt(bb.tokenizer, ex.query)
    res = decoder.generate(prompt)
    if task.score(ex, res.text):
        continue
    wrong += 1
    out, gold = res.token_ids, bb.tokenizer.encode(ex.response, add_special_tokens=False)
    j = next((j for j, (a, b) in enumerate(zip(out, gold)) if a != b), min(len(out), len(gold)))
    if j >= len(out):
        kinds["ended early"] += 1
        continue
    pos = len(prompt) + j
    when = {p: k for k, t in enumerate(res.trace) for s, m in t.accepted for p in range(s, s + m)}  # position -> iteration
    it = res.trace[when[pos]]
    start = next(s for s, m in it.accepted if s <= pos < s + m)
    later = sum(1 for p in range(len(prompt), pos) if when.get(p, len(res.trace)) > when[pos])
    kind = (f"{it.stage}, {'first' if pos == start else 'inner'} token, {len(it.chosen)} chosen, "
            + ("left text complete" if not later else "left text incomplete"))
    kinds[kind] += 1
    got, want = bb.tokenizer.decode([out[j]]), bb.tokenizer.decode([gold[j]]) if j < len(gold) else "<end>"
    print(f"#{i} {kind}: ...{bb.tokenizer.decode(out[max(0, j - 8):j])!r} -> {got!r} (gold {want!r})")
print(f"{wrong} of {n} wrong; first wrong token committed by:")
for kind, c in kinds.most_common():
    print(f"  {c:3d}  {kind}")
