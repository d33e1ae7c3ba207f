#!/usr/bin/env bash
# Rebuild a recipe run folder from git: the shipped v5 checkpoints (round 3 of every arm, git 3618a7c) with
# the stages up to round 3 marked done, then what save.sh kept on top. The recipe resumes from there.
#   training-state/restore.sh [RUN] [SAVED]     (defaults: runs/v6 training-state/v6)
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/v6}; saved=${2:-training-state/v6}
[ -e "$run" ] && { echo "$run exists; move it away first" >&2; exit 2; }
mkdir -p "$run/tokenizer"
for o in refusion ar mdm block; do mkdir -p "$run/tiny-$o"; cp src/refusion/checkpoints/tiny-$o/* "$run/tiny-$o/"; done
cp src/refusion/checkpoints/tiny-ar/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$run/tokenizer/"
for s in tokenizer pretrain base-ar {finetune,refine,refine2,refine3}-{refusion,ar,mdm,block}; do
  mkdir -p "$run/work/$s"
  echo "{\"stage\": \"$s\", \"note\": \"seeded from the shipped v5 checkpoints, git 3618a7c\"}" > "$run/work/$s/stage.json"
done
if [ -d "$saved" ]; then
  cp -r "$saved"/work/. "$run/work/"
  for m in "$saved"/tiny-*/; do cp "$m"/* "$run/$(basename "$m")/"; done
fi
echo "restored $run; next: python -m refusion.training.recipe --out $run --jobs 2 --threads 1 --refine-rounds 8 --objectives ..."
