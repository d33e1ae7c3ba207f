"""Choose the speculative bench rows' settings on the VALIDATION split (the bench's rule: the fastest
setting within 2 points of AR greedy's accuracy; speculative decoding is lossless, so every setting has
AR's accuracy and the rule picks the fastest).

    python scripts/tune_speculative.py --limit 30 --out runs/tune_spec.json

Decodes the first ``--limit`` validation samples of each task with AR greedy on tiny-ar and with every
setting of the grid below (alone, batch 1, one thread; interleaved per sample, so load on the machine hits
all alike), checks each output is AR's, and prints per task and setting the tokens/s ratio to AR (summed
wall times), the acceptance rate, the mean accepted length and the drafter forwards per token.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

GRID = {
    "spec-ngram": [{"proposer": {"name": "ngram", "max_matching_ngram_size": n}, "k": k}
                   for n, k in ((1, 4), (2, 4), (3, 4), (3, 8))]
                  + [{"proposer": {"name": "ngram", "max_matching_ngram_size": 3}, "k": 4, "schedule": "heuristic"}],
    "spec-draft": [{"proposer": {"name": "model", "model": "tiny-ar-draft"}, "k": k} for k in (3, 5, 8)]
                  + [{"proposer": {"name": "model", "model": "tiny-ar-draft"}, "k": 4, "schedule": "heuristic"}],
    "spec-diffusion": [{"proposer": {"name": "diffusion", "model": m}, "k": k}
                       for m, k in (("tiny-block", 4), ("tiny-block", 8), ("tiny-block", 16), ("tiny-mdm", 8))],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--tasks", default="arith,code,facts")
    p.add_argument("--rows", default=",".join(GRID))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)

    from refusion.core.config import build_decoder
    from refusion.models.backend import Backbone
    from refusion.models.tokenizer import encode_prompt
    from refusion.tasks import get_task

    bb = Backbone.from_pretrained("tiny-ar")
    table = []
    for task_name in args.tasks.split(","):
        task = get_task(task_name)
        prompts = [encode_prompt(bb.tokenizer, e.query) for e in task.examples("validation", args.limit)]
        gen = task.max_new_tokens
        ar = build_decoder(bb, {"decoder": "ar", "gen_length": gen})
        settings = [(row, s) for row in args.rows.split(",") for s in GRID[row]]
        decoders = [build_decoder(bb, {"decoder": "speculative", "gen_length": gen, **s}) for _, s in settings]
        for dec in [ar, *decoders]:
            dec.generate(prompts[0])  # warm up
        ar_s, ar_out = 0.0, []
        walls = [0.0] * len(decoders)
        results: list[list] = [[] for _ in decoders]
        for prompt in prompts:  # interleaved per prompt: load on the machine hits every setting alike
            t0 = time.perf_counter()
            ar_out.append(ar.generate(prompt).token_ids)
            ar_s += time.perf_counter() - t0
            for i, dec in enumerate(decoders):
                t0 = time.perf_counter()
                results[i].append(dec.generate(prompt))
                walls[i] += time.perf_counter() - t0
        n_tokens = sum(len(o) for o in ar_out)
        for (row, setting), res, wall in zip(settings, results, walls):
            same = sum(r.token_ids == o for r, o in zip(res, ar_out))
            drafted = sum(r.stats.extra["drafted"] for r in res)
            acc = sum(r.stats.extra["accepted"] for r in res)
            ver = sum(r.stats.extra["verifications"] for r in res)
            dfw = sum(r.stats.extra["draft_forwards"] for r in res)
            line = dict(task=task_name, row=row, setting=setting, identical=f"{same}/{len(prompts)}",
                        speedup=round(ar_s / wall, 3), acceptance=round(acc / max(drafted, 1), 3),
                        mean_accepted_length=round(n_tokens / ver, 2),
                        draft_forwards_per_token=round(dfw / n_tokens, 2),
                        ar_tok_s=round(n_tokens / ar_s, 1), tok_s=round(n_tokens / wall, 1))
            print(json.dumps(line), flush=True)
            table.append(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
