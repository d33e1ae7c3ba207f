"""Why does the masked-diffusion arm lag? Teacher-forced accuracy of a model under the contexts its
training shows it and under the contexts a left-to-right decode shows it.

    .venv/bin/python scripts/mdm_gap.py [--n 50] [--tasks arith,code,facts] [--mdm tiny-mdm] [--ar tiny-ar]

For the first ``--n`` test examples of each task, with the target ``response + EOS padding`` up to the
task's ``max_new_tokens`` (the length LLaDA-style decoding fills):

- ``iid p``: the training layout of the ``mdm`` objective: every target token masked independently with
  probability ``p`` (0.25, 0.5, 0.75; seeded); accuracy of the argmax at masked response tokens.
- ``left-to-right``: the layout a one-token-per-step, left-to-right decode presents: the target's first
  ``j`` tokens given, every later one ``[MASK]``; accuracy at token ``j``, for every ``j`` of the response.
  ``all right`` is the share of examples whose every response token is right in this layout: the
  share a greedy left-to-right decode, one token per step, reproduces token for token.
- for the AR model, the same two figures for causal next-token prediction.

It also counts, for the masked model's left-to-right errors on arith, which line of the worked answer
they fall on (a part's line, the ``Total:`` line, the ``####`` line). One torch thread, float32.
"""

from __future__ import annotations

import argparse
import collections

import torch

from refusion.models.backend import find_mask_id
from refusion.models.loading import load_pretrained
from refusion.models.tokenizer import encode_prompt
from refusion.tasks import get_task
from refusion.training.data import encode_response

PROBS = (0.25, 0.5, 0.75)


def bidirectional_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``ids [B, L]`` -> float32 logits ``[B, L, V]`` with every position attending to every other; row i
    predicts token i (a model trained with shifted targets, ``refusion_logits_shifted``, has its rows
    moved right by one; row 0, never read here, repeats row 0)."""
    B, L = ids.shape
    logits = model(input_ids=ids, position_ids=torch.arange(L).expand(B, L),
                   attention_mask=torch.zeros(B, 1, L, L), use_cache=False).logits.float()
    if getattr(model.config, "refusion_logits_shifted", False):
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


def mdm_rows(model, tok, prompt: list[int], response: list[int], gen_length: int, seed: int):
    """Per-token correctness of the masked model: ``{layout: [bool per scored token]}`` and the
    left-to-right correctness per response position."""
    mask_id = find_mask_id(model, tok)
    target = response + [tok.eos_token_id] * (gen_length - len(response))
    P, R = len(prompt), len(response)
    full = torch.tensor(prompt + target)
    out: dict[str, list[bool]] = {}
    g = torch.Generator().manual_seed(seed)
    for p in PROBS:
        masked = torch.rand(gen_length, generator=g) < p
        masked[:R] |= ~masked[:R].any()  # at least one response token scored
        ids = full.clone()
        ids[P:][masked] = mask_id
        with torch.no_grad():
            pred = bidirectional_logits(model, ids[None])[0, P:].argmax(-1)
        scored = masked[:R]
        out[f"iid {p}"] = (pred[:R][scored] == full[P:P + R][scored]).tolist()
    rows = full.repeat(R, 1)  # row j: response tokens >= j masked
    cols = torch.arange(gen_length)
    for j in range(R):
        rows[j, P:][cols >= j] = mask_id
    with torch.no_grad():
        logits = torch.cat([bidirectional_logits(model, chunk) for chunk in rows.split(32)])
    pred = logits[torch.arange(R), P + torch.arange(R)].argmax(-1)
    l2r = (pred == full[P:P + R]).tolist()
    out["left-to-right"] = l2r
    return out, l2r


def ar_rows(model, prompt: list[int], response: list[int]) -> list[bool]:
    ids = torch.tensor(prompt + response)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
    P = len(prompt)
    return (logits[0, P - 1:-1].argmax(-1) == ids[0, P:]).tolist()


def line_kind(text_line: str) -> str:
    """Which line of a worked arith answer ``text_line`` (its text so far) is."""
    if text_line.startswith("####"):
        return "#### line"
    if text_line.startswith("Total"):
        return "Total: line"
    return "a part's line"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--tasks", default="arith,code,facts")
    ap.add_argument("--mdm", default="tiny-mdm")
    ap.add_argument("--ar", default="tiny-ar")
    a = ap.parse_args()
    torch.set_num_threads(1)
    mdm, mdm_tok = load_pretrained(a.mdm)
    ar, ar_tok = load_pretrained(a.ar)
    print(f"| task | model | layout | token accuracy | all right |\n|---|---|---|---|---|")
    for task_name in a.tasks.split(","):
        task = get_task(task_name)
        examples = task.examples("test", a.n)
        per_layout: dict[str, list[list[bool]]] = collections.defaultdict(list)
        error_lines: collections.Counter[str] = collections.Counter()
        for i, ex in enumerate(examples):
            prompt = encode_prompt(mdm_tok, ex.query)
            response = encode_response(mdm_tok, ex.response)
            rows, l2r = mdm_rows(mdm, mdm_tok, prompt, response, task.max_new_tokens, seed=i)
            for layout, ok in rows.items():
                per_layout[("mdm", layout)].append(ok)
            for j, ok in enumerate(l2r):
                if not ok:
                    line = mdm_tok.decode(response[:j]).split("\n")[-1]
                    error_lines[line_kind(line)] += 1
            per_layout[("ar", "causal next token")].append(
                ar_rows(ar, encode_prompt(ar_tok, ex.query), encode_response(ar_tok, ex.response)))
        for (model, layout), lists in per_layout.items():
            flat = [x for ok in lists for x in ok]
            name = a.mdm if model == "mdm" else a.ar
            all_right = f"{100 * sum(all(ok) for ok in lists) / len(lists):.0f}%" if layout in (
                "left-to-right", "causal next token") else "-"
            print(f"| {task_name} | {name} | {layout} | {100 * sum(flat) / len(flat):.2f}% | {all_right} |", flush=True)
        if task_name == "arith" and error_lines:
            print(f"\narith, left-to-right misses by line: {dict(error_lines)}\n", flush=True)


if __name__ == "__main__":
    main()
