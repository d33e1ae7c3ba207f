"""The external check of the ``speculative`` decoder: transformers' own implementations on the same
checkpoints and prompts.

    python scripts/spec_vs_transformers.py --limit 50 --out runs/spec_vs_hf.json

* ``ngram`` against ``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)``;
* ``model`` (``tiny-ar-draft``) against ``generate(assistant_model=...)`` with the assistant's generation
  config set to ``num_assistant_tokens=k``, ``num_assistant_tokens_schedule="constant"`` and
  ``assistant_confidence_threshold=0`` (transformers reads these from the assistant's config, not from
  ``generate``'s arguments).

Both greedy on ``tiny-ar`` (float32, one thread), ``max_new_tokens`` = the task's, the [MASK] token
suppressed on both sides (our backbone never emits it). Per task and method: prompts whose tokens are
identical, target forwards (ours: ``stats.nfe``; theirs: a forward hook on the target model) equal on how
many prompts, and the wall-time ratio ours / theirs, each prompt decoded by both back to back (summed
walls). Every differing prompt is printed with its first differing position.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def table(rows: list[dict]) -> str:
    """Per task and method: identical outputs, equal target forwards, forwards and time ours / theirs (Markdown)."""
    from refusion.experiments.tables import markdown

    return markdown(["task", "method", "identical", "equal target forwards", "target forwards ours / theirs",
                     "time ours / theirs"],
                    [[r["task"], r["method"], f"{r['identical']}/{r['n']}", f"{r['equal_target_forwards']}/{r['n']}",
                      f"{r['target_forwards_ours']} / {r['target_forwards_theirs']}",
                      f"{r['time_ratio_ours_to_theirs']:.2f}"] for r in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=50, help="test samples per task")
    p.add_argument("--tasks", default="arith,code,facts")
    p.add_argument("--k", type=int, default=4, help="prompt_lookup_num_tokens / num_assistant_tokens")
    p.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size")
    p.add_argument("--draft", default="tiny-ar-draft")
    p.add_argument("--methods", default="ngram,model")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.models.tokenizer import encode_prompt
    from refusion.tasks import get_task

    bb = Backbone.from_pretrained("tiny-ar")
    draft = Backbone.from_pretrained(args.draft) if "model" in args.methods else None
    calls = {"n": 0}
    bb.model.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
    rows = []
    for task_name in args.tasks.split(","):
        task = get_task(task_name)
        prompts = [encode_prompt(bb.tokenizer, e.query) for e in task.examples("test", args.limit)]
        gen = task.max_new_tokens
        for method in args.methods.split(","):
            if method == "ngram":
                cfg = {"proposer": {"name": "ngram", "max_matching_ngram_size": args.ngram}}
                hf_kw = dict(prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.ngram)
            else:
                cfg = {"proposer": {"name": "model", "model": args.draft}}
                hf_kw = dict(assistant_model=draft.model)
                gc = draft.model.generation_config  # transformers reads the assistant's settings from it
                gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = args.k, "constant"
                gc.assistant_confidence_threshold = 0.0
            dec = build_decoder(bb, {"decoder": "speculative", "gen_length": gen, "k": args.k, **cfg})
            same = same_nfe = 0
            ours_s = hf_s = 0.0
            ours_nfe = hf_nfe = 0
            diffs = []
            for i, prompt in enumerate(prompts):
                calls["n"] = 0
                t0 = time.perf_counter()
                ours = dec.generate(prompt)
                ours_s += time.perf_counter() - t0
                with torch.no_grad():
                    calls["n"] = 0
                    t0 = time.perf_counter()
                    out = bb.model.generate(torch.tensor([prompt]), max_new_tokens=gen, do_sample=False,
                                            suppress_tokens=[bb.mask_id], eos_token_id=bb.eos_id,
                                            pad_token_id=bb.tokenizer.pad_token_id, **hf_kw)
                    hf_s += time.perf_counter() - t0
                theirs = out[0, len(prompt):].tolist()
                n_hf = calls["n"]
                ours_nfe += ours.stats.nfe
                hf_nfe += n_hf
                same += ours.token_ids == theirs
                same_nfe += ours.stats.nfe == n_hf
                if ours.token_ids != theirs:
                    at = next((j for j, (a, b) in enumerate(zip(ours.token_ids, theirs)) if a != b),
                              min(len(ours.token_ids), len(theirs)))
                    diffs.append({"sample": i, "first_difference": at, "ours": ours.token_ids[at:at + 5],
                                  "theirs": theirs[at:at + 5], "len_ours": len(ours.token_ids),
                                  "len_theirs": len(theirs)})
            row = {"task": task_name, "method": method, "k": args.k, "n": len(prompts), "identical": same,
                   "equal_target_forwards": same_nfe, "target_forwards_ours": ours_nfe,
                   "target_forwards_theirs": hf_nfe, "time_ratio_ours_to_theirs": round(ours_s / hf_s, 3),
                   "ours_s": round(ours_s, 2), "theirs_s": round(hf_s, 2), "differences": diffs}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print()
    print(table(rows), end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
