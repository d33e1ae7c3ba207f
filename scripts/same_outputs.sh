#!/usr/bin/env bash
# Whether a change leaves what the bench and batch-bench write from their samples unchanged: the code of
# revision BASE decodes a small bench and batch-bench; then BASE's code and this working tree's each write
# the outputs again from those same sample files (--resume: every sample is done, nothing is decoded) and
# the files and printed tables are compared byte for byte (results.json, the printed bench table and goal
# lines; batch-bench's results.json, crossover.json, results.md and its printed table; samples.jsonl
# untouched). The results page has its own check: tests/experiments/test_results.py's --doc-only test.
#   scripts/same_outputs.sh BASE [WORK_DIR]      e.g. scripts/same_outputs.sh 64d13b4 /tmp/same
# Exit 0 when every file is identical, 1 naming the ones that differ.
set -euo pipefail
base=${1:?usage: scripts/same_outputs.sh BASE_REVISION [WORK_DIR]}
work=${2:-$(mktemp -d)}
py=${REFUSION_PYTHON:-.venv/bin/python}
here=$(pwd)
mkdir -p "$work/base"
git archive "$base" src | tar -x -C "$work/base"
export COLUMNS=200  # the printed tables whole, whatever the terminal
bench=(bench --tasks arith,code,facts --limit 2 --threads 1)
batch=(batch-bench --tasks arith --decoders ar,refusion,block --batch-sizes 1,2 --limit 2 --threads 1)
PYTHONPATH="$work/base/src" "$py" -m refusion.cli "${bench[@]}" --out "$work/bench" > "$work/bench.log" 2>&1
PYTHONPATH="$work/base/src" "$py" -m refusion.cli "${batch[@]}" --out "$work/batch" > "$work/batch.log" 2>&1
differ=0
for kind in bench batch; do
  for side in base head; do
    rm -rf "$work/$kind-$side" && cp -r "$work/$kind" "$work/$kind-$side"
    src="$work/base/src"; [ "$side" = head ] && src="$here/src"
    if [ "$kind" = bench ]; then args=("${bench[@]}"); else args=("${batch[@]}"); fi
    PYTHONPATH="$src" "$py" -m refusion.cli "${args[@]}" --out "$work/$kind-$side" --resume 2>&1 \
      | grep -v -e 'decode/s' -e 'it/s' -e 'Loading' | sed "s#$work/$kind-$side#OUT#g" > "$work/$kind-$side.txt"
  done
  files=(results.json samples.jsonl); [ "$kind" = batch ] && files+=(crossover.json results.md)
  pairs=("$work/$kind-base.txt $work/$kind-head.txt printed")
  for f in "${files[@]}"; do pairs+=("$work/$kind-base/$f $work/$kind-head/$f $f"); done
  for pair in "${pairs[@]}"; do
    read -r a b name <<< "$pair"
    if cmp -s "$a" "$b"; then echo "same: $kind $name"; else echo "DIFFERS: $kind $name"; differ=1; fi
  done
done
exit $differ
