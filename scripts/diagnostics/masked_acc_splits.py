"""Does a diffusion-trained model fit its training examples better than unseen ones? Per task, the
objective's masked accuracy on train examples against validation examples, under the same fixed noise.

    python scripts/diagnostics/masked_acc_splits.py MODEL [OBJECTIVE] [N]

MODEL: a model folder or shipped checkpoint name; OBJECTIVE: `refusion` (default), `mdm` or `block`;
N: examples per task and split (default 192, in batches of 64, noise seeded per batch). facts' train
examples are its multiple-choice questions only (the train split also holds bare statements, which
validation has not). One CPU thread.

A train figure well above the validation one means the model memorises training examples and more
(fresh) data would help; equal figures mean it does not.
"""

from __future__ import annotations

import sys

import torch

from refusion.models.loading import load_pretrained
from refusion.plugins.objectives import OBJECTIVES
from refusion.tasks import get_task
from refusion.training.data import encode_pair


def masked_accuracy(model, objective, pairs, batch: int = 64) -> float:
    right = total = 0.0
    for i in range(0, len(pairs), batch):
        b = objective.make_batch(pairs[i:i + batch], torch.Generator().manual_seed(1234 + i))
        with torch.no_grad():
            _, metrics = objective.loss(model, b)
        right += metrics["masked_acc"] * metrics["n_masked"]
        total += metrics["n_masked"]
    return right / total


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    name, objective_name, n = argv[0], (argv[1:2] or ["refusion"])[0], int((argv[2:3] or [192])[0])
    model, tok = load_pretrained(name)
    objective = OBJECTIVES[objective_name].from_tokenizer(tok)
    print(f"{'task':6} {'train':>7} {'valid':>7}")
    for task_name in ("arith", "code", "facts"):
        task = get_task(task_name)
        accs = []
        for split in ("train", "validation"):
            examples = task.examples(split)
            if task_name == "facts" and split == "train":
                examples = [e for e in examples if "- (A)" in e.query]
            pairs = [encode_pair(tok, e.query, e.response) for e in examples[:n]]
            accs.append(masked_accuracy(model, objective, pairs))
        print(f"{task_name:6} {accs[0]:7.4f} {accs[1]:7.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
