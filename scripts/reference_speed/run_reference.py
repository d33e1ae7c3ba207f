"""Replay a job file written by ``run_ours.py`` with the authors' own decoder, ``generate_refusion`` from
``generate.py`` of github.com/ML-GSAI/ReFusion, in a clone the user points at (nothing of it is copied here).

Runs under the reference's environment (transformers 4.x, see docs/reference_speed.md), NOT this
project's:

    /tmp/refenv/bin/python scripts/reference_speed/run_reference.py --reference-repo ~/src/ReFusion \
        --job OUT/job.json --out OUT/reference.json --threads 1

The model folder of the job is loaded in float32 on the CPU with the class ``generate.py`` itself imports
(``qwen3.modeling_qwen3_refusion.Qwen3ForCausalLM``, a stock Qwen3 whose forward creates the
``DiffusionDynamicCache`` that ``generate_refusion`` needs: it calls ``full_update`` on the cache, which
transformers' own ``DynamicCache``, as ``AutoModelForCausalLM`` would build it, lacks). With
``--check-auto`` the folder is also loaded with ``AutoModelForCausalLM`` and its logits compared, to show
both classes compute the same model. The tokenizer is not loaded: ``generate_refusion`` reads only
``tokenizer.eos_token_id``, which the job file carries (and our checkpoints' tokenizer files are written
by transformers 5, which 4.x cannot read).

One untimed warm-up call, then each prompt timed with ``time.perf_counter`` around ``generate_refusion``.
Each output is cut as our decoder cuts: the generated part (after the prompt), up to and including the
first EOS, at most ``gen_length`` tokens.

With ``--positions`` every prompt is decoded once more, untimed, to record which positions the reference
left empty: ``generate_refusion`` returns its committed tokens sorted by position, so a slot it dropped
(docs/refusion.md, deliberate difference 1) closes up without a trace in the token ids. The second pass
reads the positions from the argument of the last ``torch.sort`` call the function makes (its final
``torch.sort(cur_pos)``), through a wrapper around ``torch.sort`` that is in place only during that pass.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import types
from pathlib import Path


def cut_output(generated: list[int], eos_ids: set[int], gen_length: int) -> list[int]:
    """Up to and including the first EOS, at most ``gen_length`` tokens (our decoder's cut)."""
    for i, t in enumerate(generated):
        if t in eos_ids:
            generated = generated[: i + 1]
            break
    return generated[:gen_length]


def reference_commit(repo: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference-repo", required=True, help="a clone of github.com/ML-GSAI/ReFusion")
    parser.add_argument("--job", required=True, help="job file written by run_ours.py")
    parser.add_argument("--out", required=True, help="reference results (JSON)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the job's)")
    parser.add_argument("--positions", action="store_true",
                        help="an extra untimed pass recording the positions the reference left empty")
    parser.add_argument("--check-auto", action="store_true",
                        help="also load with AutoModelForCausalLM and check that the logits agree")
    args = parser.parse_args(argv)

    repo = Path(args.reference_repo).expanduser().resolve()
    if not (repo / "generate.py").is_file():
        parser.error(f"--reference-repo {str(repo)!r} has no generate.py; clone github.com/ML-GSAI/ReFusion")
    job = json.loads(Path(args.job).read_text())
    threads = args.threads or int(job["threads"])

    import torch
    import transformers

    torch.set_num_threads(threads)
    sys.path.insert(0, str(repo))
    import generate as reference  # the authors' generate.py (it imports its qwen3 package from the clone)

    model_cls = reference.Qwen3ForCausalLM
    model = model_cls.from_pretrained(job["model"], torch_dtype=torch.float32).to("cpu").eval()
    if int(model.config.vocab_size) != int(job["vocab_size"]):
        raise SystemExit(f"vocab size {model.config.vocab_size} != the job's {job['vocab_size']}")
    if args.check_auto:
        auto = transformers.AutoModelForCausalLM.from_pretrained(job["model"], torch_dtype=torch.float32).eval()
        ids = torch.tensor([job["tasks"][0]["prompts"][0]])
        with torch.no_grad():
            diff = (model(input_ids=ids).logits - auto(input_ids=ids).logits).abs().max().item()
        print(f"AutoModelForCausalLM ({type(auto).__name__}) vs the reference's class: max |logit diff| {diff:.3g}",
              file=sys.stderr)
        del auto
    tokenizer = types.SimpleNamespace(eos_token_id=int(job["eos_token_id"]))
    eos_ids = {int(e) for e in job["eos_ids"]}
    mask_id = int(job["mask_id"])

    def decode(ids: list[int], s: dict) -> tuple[list[int], float, float]:
        prompt = torch.tensor([ids], dtype=torch.long)
        t0 = time.perf_counter()
        x, tpf = reference.generate_refusion(
            model, tokenizer, prompt, gen_length=s["gen_length"], temperature=s["temperature"], mask_id=mask_id,
            slot_size=s["slot_size"], model_path=job["model"], serial_num_blocks=s["serial_num_blocks"],
            slot_threshold=s["slot_threshold"], token_threshold=s["token_threshold"],
        )
        wall = time.perf_counter() - t0
        generated = x[0, len(ids):].tolist()
        return generated, wall, float(tpf)

    def empty_positions(ids: list[int], s: dict) -> list[int]:
        """Generated-token indices (0 = first after the prompt) below the last committed one that the
        reference never filled."""
        seen: list[torch.Tensor] = []
        real_sort = torch.sort

        def spy(input, *a, **k):
            seen.append(input)
            return real_sort(input, *a, **k)

        torch.sort = spy
        try:
            decode(ids, s)
        finally:
            torch.sort = real_sort
        pos = sorted(p - len(ids) for p in seen[-1].flatten().tolist() if p >= len(ids))
        return sorted(set(range(pos[-1] + 1)) - set(pos)) if pos else []

    records = []
    warmed = False
    for t in job["tasks"]:
        s = t["settings"]
        if not warmed and t["prompts"]:
            decode(t["prompts"][0], s)
            warmed = True
        for i, ids in enumerate(t["prompts"]):
            generated, wall, tpf = decode(ids, s)
            out_ids = cut_output(generated, eos_ids, s["gen_length"])
            records.append({
                "task": t["name"], "index": i, "prompt_len": len(ids), "token_ids": out_ids, "wall_s": wall,
                "raw_len": len(generated), "contains_mask": mask_id in out_ids, "tpf_reference": tpf,
            })
            if args.positions:
                records[-1]["empty_positions"] = empty_positions(ids, s)
            print(f"reference {t['name']}[{i}]: {len(out_ids)} tokens, {wall:.3f} s", file=sys.stderr)

    out = {
        "decoder": "reference",
        "model": job["model"],
        "vocab_size": job["vocab_size"],
        "threads": threads,
        "reference_repo": str(repo),
        "reference_commit": reference_commit(repo),
        "model_class": f"{model_cls.__module__}.{model_cls.__name__}",
        "timing": "time.perf_counter around generate_refusion",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "settings": {t["name"]: t["settings"] for t in job["tasks"]},
        "results": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({len(records)} prompts)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
