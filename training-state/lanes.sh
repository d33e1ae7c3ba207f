#!/usr/bin/env bash
# Train recipe stages in lanes, one one-thread process per lane, so that a core never idles while the
# other lane's arm is still training (`--jobs 2` waits for both of its arms before the next pair starts).
# Each lane is a space-separated list of OBJECTIVE:ROUND trained in turn; save.sh runs after every
# finished stage. A stage already done is skipped; one cut off resumes from its last 100-step save.
#   training-state/lanes.sh "refusion:8 block:8" "ar:8 mdm:8"     (logs: RUN/lane-<obj>.log, RUN/chain.log)
#   RUN=runs/v6 PY=.venv/bin/python by default.
set -uo pipefail
cd "$(dirname "$0")/.."
run=${RUN:-runs/v6}; py=${PY:-.venv/bin/python}
log() { echo "[lanes $(date +%T)] $*" >> "$run/chain.log"; }
lane() {
  for item in $1; do
    local obj=${item%%:*} r=${item##*:}
    log "start $obj round $r"
    OMP_NUM_THREADS=1 $py -m refusion.training.recipe --out "$run" --threads 1 --no-progress \
        --refine-rounds "$r" --objectives "$obj" >> "$run/lane-$obj.log" 2>&1
    log "$obj round $r ended rc=$?"
    [ -f "$run/work/refine$r-$obj/stage.json" ] || { log "refine$r-$obj unfinished; lane stops"; return 1; }
    training-state/save.sh "$run" >> "$run/chain.log" 2>&1
  done
}
for l in "$@"; do lane "$l" & done
wait
