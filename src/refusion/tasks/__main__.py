"""``python -m refusion.tasks``: per task, the split sizes and token-length percentiles of queries and
responses in the shipped tinybench tokenizer (``build_tinybench_tokenizer()``), over all splits."""

from __future__ import annotations

from refusion.core.stats import percentile
from refusion.tasks import SPLITS, TASKS
from refusion.tasks.tokenizer import build_tinybench_tokenizer


def main() -> None:
    tokenizer = build_tinybench_tokenizer()
    for name, task in TASKS.items():
        examples = {split: task.examples(split) for split in SPLITS}
        sizes = ", ".join(f"{split} {len(exs)}" for split, exs in examples.items())
        print(f"{name}: {sizes}; max_new_tokens {task.max_new_tokens}")
        for part in ("query", "response"):
            texts = [getattr(e, part) for exs in examples.values() for e in exs]
            lengths = sorted(len(ids) for ids in tokenizer(texts)["input_ids"])
            cuts = {q: percentile(lengths, q) for q in (10, 50, 90)}
            print(f"  {part:8s} tokens: min {lengths[0]}, p10 {cuts[10]:g}, median {cuts[50]:g}, p90 {cuts[90]:g}, "
                  f"max {lengths[-1]}")


if __name__ == "__main__":
    main()
