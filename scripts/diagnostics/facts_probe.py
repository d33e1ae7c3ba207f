"""Greedy-decode the multiple-choice questions of a facts JSON file and count right letters.

    python scripts/diagnostics/facts_probe.py MODEL_DIR VALIDATION_JSON [N]
"""
import collections
import json
import re
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from refusion.training.data import encode_prompt

torch.set_num_threads(1)
path, data, n = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 100
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
rows = [r for r in json.loads(open(data).read()) if r["answer"] in "ABCD"][:n]
right, letters = 0, collections.Counter()
for r in rows:
    ids = torch.tensor([encode_prompt(tok, r["query"])])
    out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    match = re.search(r"answer is\W*([A-D])\b", tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    got = match.group(1) if match else None
    right += got == r["answer"]
    letters[got] += 1
print(f"{path} on {data}: {right}/{len(rows)} right; letters given: {dict(letters)}")
