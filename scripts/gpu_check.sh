#!/usr/bin/env bash
# The GPU check in one run (a few minutes on one CUDA device): the `gpu` tests (CPU and CUDA outputs
# identical in float32 on the shipped models, bfloat16 decodes, no synchronisation beyond the documented
# host reads under torch.cuda.set_sync_debug_mode) and ReFusion against AR on a random Qwen3 of 0.6B
# shape in bfloat16: batch 1, the forward-cost table (the cost model fitted on this GPU, its predicted
# ReFusion / AR ratio per batch size and crossover), the forward under torch.compile with CUDA graphs
# (mode reduce-overhead) against eager on a few shapes and its token check (ar and refusion on their shipped
# models, float32, alone and in a batch: token ids eager against compiled), then batches of 4 and 16 (aggregate tokens/s);
# parts that would start after 240 s are skipped and named.
# Output goes to OUT_DIR (default runs/gpu_check): pytest.log, gpu_bench.json, report.md.
#   scripts/gpu_check.sh [OUT_DIR]        PYTHON=... to choose the interpreter (default .venv/bin/python,
#                                         else python3 with src/ on PYTHONPATH)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}; fi
fi
export PYTHONUNBUFFERED=1
{
  echo "# GPU check"
  "$py" -c "import torch, transformers; print(f'- device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, transformers {transformers.__version__}')"
  echo
  echo '## pytest -m gpu'
  echo '```'
  "$py" -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$out/pytest.log" | tail -n 40
  echo '```'
  echo
  echo '## ReFusion vs AR, random Qwen3 of 0.6B shape, bfloat16'
  "$py" scripts/gpu_bench.py --device cuda --dtype bfloat16 --shape 0.6b --compile reduce-overhead --out "$out" 2>&1
} | tee "$out/report.md"
