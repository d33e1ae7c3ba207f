"""Which ReFusion stage commits the first wrong token, and is the error the model's or the decoder's?

Decodes samples with the bench's per-task ReFusion settings and, for each wrong answer, finds the first
token that differs from the gold response and the iteration that committed it: Stage II-a or II-b, a
slot's first token (accepted on its Stage-I draft probability) or an inner one (passed the causal check
or was the AR correction), and how many slots that iteration chose. Whether the text to its left was
VISIBLE when it was committed: every earlier position committed in an earlier iteration, or in the same
slot of this one (slots completed side by side in Stage II-b never see each other). And whether the same
model decoded AR greedy (the ``ar`` decoder) also gets the sample wrong: then the error is the model's,
not parallel decoding's.

    python scripts/diagnostics/first_error.py MODEL TASK N [--split validation|test] [KEY=VALUE ...]

KEY=VALUE override the bench settings (``verifier.token_threshold=0.9``). One thread.
"""
import argparse
import collections

import torch

from refusion.models.tokenizer import encode_prompt
from refusion.core.config import build_decoder
from refusion.experiments.bench import load_bench_config
from refusion.models.backend import Backbone
from refusion.tasks import get_task

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("model")
ap.add_argument("task")
ap.add_argument("n", type=int)
ap.add_argument("--split", default="validation", choices=["validation", "test"])
ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
args = ap.parse_args()

torch.set_num_threads(1)
bb = Backbone.from_pretrained(args.model)
task = get_task(args.task)
bench = load_bench_config()
decoder = build_decoder(bb, bench.decoder_config(args.task, "refusion", task.max_new_tokens, args.overrides))
ar = build_decoder(bb, bench.decoder_config(args.task, "ar", task.max_new_tokens))
kinds: collections.Counter = collections.Counter()
wrong = ar_wrong_too = ar_right = 0
for i, ex in enumerate(task.examples(args.split, args.n)):
    prompt = encode_prompt(bb.tokenizer, ex.query)
    ar_ok = task.score(ex, ar.generate(prompt).text)
    ar_right += ar_ok
    res = decoder.generate(prompt)
    if task.score(ex, res.text):
        continue
    wrong += 1
    ar_wrong_too += not ar_ok
    out, gold = res.token_ids, bb.tokenizer.encode(ex.response, add_special_tokens=False)
    j = next((j for j, (a, b) in enumerate(zip(out, gold)) if a != b), min(len(out), len(gold)))
    if j >= len(out):
        kinds["ended early"] += 1
        continue
    pos = len(prompt) + j
    slot_of = {p: (k, s) for k, t in enumerate(res.trace) for s, m in t.accepted for p in range(s, s + m)}
    k, start = slot_of[pos]  # iteration and slot that committed the first wrong token
    it = res.trace[k]
    hidden = sum(1 for p in range(len(prompt), pos) if slot_of.get(p, (len(res.trace), -1))[0] > k
                 or (slot_of[p][0] == k and slot_of[p][1] != start))
    kind = (f"{it.stage}, {'first' if pos == start else 'inner'} token, {len(it.chosen)} chosen, "
            + ("left text visible" if not hidden else "left text partly hidden"))
    kinds[kind] += 1
    got, want = bb.tokenizer.decode([out[j]]), bb.tokenizer.decode([gold[j]]) if j < len(gold) else "<end>"
    print(f"#{i} {kind}, AR greedy {'right' if ar_ok else 'wrong'}: "
          f"...{bb.tokenizer.decode(out[max(0, j - 8):j])!r} -> {got!r} (gold {want!r})")
print(f"{args.split}: {wrong} of {args.n} wrong with ReFusion ({ar_wrong_too} of them also wrong AR greedy); "
      f"AR greedy right on {ar_right} of {args.n}. First wrong token committed by:")
for kind, c in kinds.most_common():
    print(f"  {c:3d}  {kind}")
