#!/usr/bin/env bash
# Copy what a recipe run has finished into git: every stage's stage.json and train_log.jsonl, and each
# arm's latest finished model (OUT/tiny-<obj>, bf16). Run it while no stage is just finishing.
#   training-state/save.sh [RUN] [DEST]     (defaults: runs/v6 training-state/v6)
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/v6}; dest=${2:-training-state/v6}
for d in "$run"/work/*/; do
  s=$(basename "$d")
  [ -f "$d/stage.json" ] || continue                     # unfinished: its state is too big for git
  mkdir -p "$dest/work/$s"
  cp "$d/stage.json" "$dest/work/$s/"
  [ -f "$d/train_log.jsonl" ] && cp "$d/train_log.jsonl" "$dest/work/$s/"
done
for m in "$run"/tiny-*/; do
  o=$(basename "$m")
  mkdir -p "$dest/$o"
  cp "$m"/{config.json,generation_config.json,model.safetensors,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$dest/$o/"
done
echo "saved $run -> $dest:"; ls "$dest/work" | tr '\n' ' '; echo
