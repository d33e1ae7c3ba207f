#!/usr/bin/env bash
# What some tests cost now against an earlier commit, on this machine: pytest's wall seconds, interleaved.
#   scripts/suite_cost.sh BASE [ROUNDS] -- TEST_PATH...
# BASE is checked out (detached) into a temporary worktree and imported from there; the current tree is
# imported from src/. Each round runs BASE's tests, then the current tree's, so both see the same load.
set -euo pipefail
cd "$(dirname "$0")/.."
base=$1; rounds=${2:-2}; shift 2; [ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "usage: scripts/suite_cost.sh BASE ROUNDS -- TEST_PATH..." >&2; exit 2; }
python=${REFUSION_PYTHON:-.venv/bin/python}; case $python in /*) ;; *) python=$(pwd)/$python ;; esac
tree=$(mktemp -d); trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$tree" "$base"
for i in $(seq "$rounds"); do
  for side in base now; do
    dir=$([ "$side" = base ] && echo "$tree" || pwd)
    paths=(); for p in "$@"; do [ -e "$dir/$p" ] && paths+=("$p"); done
    line=$(cd "$dir" && PYTHONPATH="$dir/src" "$python" -m pytest -q -p no:cacheprovider "${paths[@]}" 2>&1 | tail -1 || true)
    echo "round $i $side: $line"
  done
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
