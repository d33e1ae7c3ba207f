#!/usr/bin/env bash
# Our ReFusion decoder against the authors' generate_refusion (github.com/ML-GSAI/ReFusion, the user's own
# clone), at identical settings, on tinybench test prompts (arith, code, facts): token-identical outputs
# and time ratios, for (a) the shipped tiny-refusion (1,024-token vocabulary) and (b) the same model with
# its vocabulary widened to Qwen3's 151,936 rows (new rows zero). See docs/reference_speed.md.
#
#   scripts/reference_speed/run.sh --reference-repo PATH [--limit 20] [--threads 1] [--out runs/reference_speed]
#                                  [--vocab both|shipped|wide] [--model tiny-refusion]
#                                  [--ref-python /tmp/refenv/bin/python] [--python .venv/bin/python]
#
# Writes OUT/<vocab>/{job,ours,reference,summary}.json and OUT/<vocab>/table.md, and prints the tables.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
ref_repo=""
limit=20
threads=1
out=runs/reference_speed
vocab=both
model=tiny-refusion
ref_python=${REF_PYTHON:-/tmp/refenv/bin/python}
python=${PYTHON:-$root/.venv/bin/python}
tasks=arith,code,facts
wide_rows=151936

while [ $# -gt 0 ]; do
  case "$1" in
    --reference-repo) ref_repo=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --vocab) vocab=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --ref-python) ref_python=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --tasks) tasks=$2; shift 2 ;;
    -h|--help) sed -n 2,11p "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[ -n "$ref_repo" ] || { echo "--reference-repo PATH (a clone of github.com/ML-GSAI/ReFusion) is required" >&2; exit 2; }
[ -f "$ref_repo/generate.py" ] || { echo "$ref_repo has no generate.py" >&2; exit 2; }
[ -x "$ref_python" ] || { echo "reference python $ref_python not found; see docs/reference_speed.md (set-up)" >&2; exit 2; }
case "$vocab" in both) vocabs="shipped wide" ;; shipped|wide) vocabs=$vocab ;; *) echo "--vocab both|shipped|wide" >&2; exit 2 ;; esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/reference_speed.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

model_path=$("$python" -c "import sys; from refusion.models.loading import resolve_model_path; print(resolve_model_path(sys.argv[1]).resolve())" "$model")

for v in $vocabs; do
  dir=$out/$v
  mkdir -p "$dir"
  m=$model_path
  if [ "$v" = wide ]; then
    m=$tmp/wide-model
    echo "== widening $model_path to $wide_rows rows -> $m" >&2
    "$python" - "$model_path" "$m" "$wide_rows" <<'EOF'
import sys

src, dst, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:  # the project's own helper, where this checkout has it
    from refusion.models.build import widen_vocabulary
except ImportError:
    widen_vocabulary = None
if widen_vocabulary is not None:
    widen_vocabulary(src, dst, rows)
else:  # the same steps by hand
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from refusion.models.loading import save_pretrained

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():  # the new rows are zero in the input and the output embeddings (tied or not)
        model.get_input_embeddings().weight[old:].zero_()
        model.get_output_embeddings().weight[old:].zero_()
    model.config.vocab_size = rows
    save_pretrained(model, tok, dst)  # safetensors, weights in bfloat16 as shipped; the tokenizer beside them
EOF
  fi
  echo "== [$v] ours ($tasks, $limit prompts per task, $threads thread(s))" >&2
  "$python" "$here/run_ours.py" --model "$m" --tasks "$tasks" --limit "$limit" --threads "$threads" \
    --job "$dir/job.json" --out "$dir/ours.json"
  echo "== [$v] reference ($ref_repo)" >&2
  "$ref_python" "$here/run_reference.py" --reference-repo "$ref_repo" --job "$dir/job.json" --positions \
    --out "$dir/reference.json" --threads "$threads"
  "$python" "$here/compare.py" "$dir/reference.json" "$dir/ours.json" --json "$dir/summary.json" > "$dir/table.md"
  echo
  echo "## $v vocabulary"
  echo
  cat "$dir/table.md"
done
