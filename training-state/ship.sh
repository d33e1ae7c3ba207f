#!/usr/bin/env bash
# When every arm has round 8: the measurements v6 ships on, in one go, on an otherwise idle 2-core CPU
# (estimated ~20 min). Writes RUN/recipe_summary.json, RUN/report.md (docs/training.md's stage table) and two
# validation benches; read their tables in runs/eval-v6-*/log.txt before step 2 of the checklist
# (training-state/README.md): ReFusion on tiny-refusion must repeat the tuned run's 99.0% / 100% / 98.0% at
# TPF 9.38 / 21.2 / 9.54 (arith / code / facts) for bench_v6_preview.yaml's settings to stand.
#   training-state/ship.sh [RUN]     (default runs/v6; PY=python to use another interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/v6}; py=${PY:-.venv/bin/python}
for o in refusion ar block mdm; do
  [ -f "$run/work/refine8-$o/stage.json" ] || { echo "$run/work/refine8-$o is not finished" >&2; exit 2; }
done
$py -m refusion.training.recipe --out "$run" --jobs 2 --threads 1 --refine-rounds 8 --objectives refusion,ar,block,mdm
$py -m refusion.training.recipe --out "$run" --report | tee "$run/report.md"
bench() { local out=$1; shift; mkdir -p "$out"; $py -m refusion.cli bench --split validation --limit 0 --resume --out "$out" "$@" 2>&1 | tr '\r' '\n' | grep -v '%|' | tee "$out/log.txt"; }
bench runs/eval-v6-val --config docs/diagnostics/bench_v6_preview.yaml --model ar="$run/tiny-ar" \
    --model refusion="$run/tiny-refusion" --model llada="$run/tiny-mdm" --model block="$run/tiny-block"
bench runs/eval-v6-val-refusion-ar --decoders ar --tasks arith,facts --model ar="$run/tiny-refusion"
