#!/usr/bin/env bash
# Decode every shipped setting and keep each sample's token ids, NFE and correctness: the bench (whole
# test split, all four decoders) and every shipped ablation (20 samples per task; the tuning grid 5).
# Two such folders are compared with scripts/compare_decodes.py, e.g. before and after a change to a
# decoding data path:   scripts/record_decodes.sh runs/before ... scripts/record_decodes.sh runs/after
#                       .venv/bin/python scripts/compare_decodes.py runs/before runs/after
# A second argument N decodes in batches of N (generate_batch), to compare batched decodes the same way.
# One torch thread, so the float reductions are the same from run to run on one machine.
set -euo pipefail
out=${1:?usage: scripts/record_decodes.sh OUT_DIR [BATCH_SIZE]}
batch=${2:-1}
bin=${REFUSION_BIN:-.venv/bin/refusion}
mkdir -p "$out"
"$bin" bench --out "$out/bench" --resume --threads 1 --batch-size "$batch"
for cfg in src/refusion/experiments/configs/ablations/*.yaml src/refusion/experiments/configs/tuning/tune_refusion*.yaml; do
  name=$(basename "$cfg" .yaml)
  limit=20; [ "$name" = tune_refusion ] && limit=5
  "$bin" ablate "$name.yaml" --out "$out/$name" --limit "$limit" --resume --threads 1 --batch-size "$batch"
done
echo "recorded every shipped setting in $out"
