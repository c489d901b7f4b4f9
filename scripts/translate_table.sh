#!/bin/bash
# Trains the rows of the Multi30k translation table (results/translate/table/README.md) into one
# folder, one run per row and seed, resuming a run that a stop left behind, then prints the table.
#
# Usage: scripts/translate_table.sh OUT [FLAG...]
#   OUT     the folder of the runs: OUT/<row>-s<seed>, each with its log beside it (<row>-s<seed>.log)
#   FLAG    given to every run: the budget and the machine, e.g. --max-epochs 13 --threads 1
#           (the table's CPU recipe) or --max-epochs 13 --device cuda
# Environment:
#   PROBATTN      the binary (default target/release/probattn)
#   TABLE_ROWS    the rows to train, by name (default: every row below)
#   TABLE_SEEDS   the seeds (default "1 2 3")
#   TABLE_JOBS    runs at a time (default 1); several share one GPU well, since the small model
#                 leaves it mostly idle
#   PROBATTN_PYTHON  the Python with probattn_tools' needs, for the table (default python3)
#
# Runs go seed by seed, so a stop leaves whole seeds, and a run whose folder has results.json is
# not run again. The table is probattn_tools.tables.translate over OUT (--diff --paper), also
# written to OUT/table.md; OUT/valid_bleu.svg draws the rows' validation curves (probattn plot).
set -u
[ $# -ge 1 ] || { sed -n '2,19p' "$0" >&2; exit 2; }
out=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
probattn=${PROBATTN:-$root/target/release/probattn}
jobs=${TABLE_JOBS:-1}

# NAME|FLAGS: the row as probattn_tools.tables.translate names it, and the flags of its runs. The
# bam-wc-w0.1-anneal1000 and lstm-bam-wc-w0.1 rows are BAM-WC tuned on validation for
# each architecture (results/translate/bam-tuning); lstm-dnas is the LSTM's causal DNAS.
rows() {
  cat <<'ROWS'
softmax|--attention softmax
dnas|--attention dnas
hnas|--attention hnas
bam-wc|--attention bam-wc
bam-wc-w0.1-anneal1000|--attention bam-wc --k 10 --kl-weight 0.1 --kl-anneal-updates 1000
softmax-svgd|--attention softmax --repulsive svgd --repulsive-stepsize 0.01
softmax-svgd-cross|--attention softmax --repulsive svgd --selection {"kinds":["cross"]}
softmax-spos-cross|--attention softmax --repulsive spos --selection {"kinds":["cross"]}
softmax-bf16|--attention softmax --precision bf16
dnas-bf16|--attention dnas --precision bf16
lstm-softmax|--arch lstm --attention softmax
lstm-bam-wc-w0.1|--arch lstm --attention bam-wc --k 10 --kl-weight 0.1
lstm-dnas|--arch lstm --attention dnas
ROWS
}

if [ -n "${TABLE_ROWS:-}" ]; then
  for name in $TABLE_ROWS; do
    rows | grep -q "^$name|" || { echo "error: no row named $name; the rows: $(rows | cut -d'|' -f1 | tr '\n' ' ')" >&2; exit 2; }
  done
fi
[ -x "$probattn" ] || { echo "error: no probattn binary at $probattn (cargo build --release, or set PROBATTN)" >&2; exit 2; }
mkdir -p "$out"
for seed in ${TABLE_SEEDS:-1 2 3}; do
  while IFS='|' read -r name flags; do
    if [ -n "${TABLE_ROWS:-}" ] && [[ " $TABLE_ROWS " != *" $name "* ]]; then continue; fi
    run=$out/$name-s$seed
    [ -f "$run/results.json" ] && continue
    resume=""
    [ -f "$run/config.json" ] && resume="--resume $run"
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    echo "start $name seed $seed ($(date -u +%H:%M:%S))"
    # FLAGS split into words (the selection JSON holds no spaces), without globbing its brackets.
    (
      set -f
      # shellcheck disable=SC2086
      "$probattn" translate --seeds 1 --seed-start "$seed" $flags "$@" --out "$run" $resume >> "$run.log" 2>&1
      echo "end $name seed $seed: exit $? ($(date -u +%H:%M:%S))"
    ) &
  done < <(rows)
done
wait
PYTHONPATH="$root/python" "${PROBATTN_PYTHON:-python3}" -m probattn_tools.tables.translate "$out" --diff --paper | tee "$out/table.md"
# The rows' validation curves, each the mean of its finished seeds.
plot=()
while IFS='|' read -r name _; do
  for seed in ${TABLE_SEEDS:-1 2 3}; do
    [ -f "$out/$name-s$seed/results.json" ] && plot+=("$out/$name-s$seed" --label "$name")
  done
done < <(rows)
if [ ${#plot[@]} -gt 0 ]; then
  "$probattn" plot "${plot[@]}" --metric valid_bleu --mean-seeds --title "validation sacreBLEU, mean over seeds" --out "$out/valid_bleu.svg"
fi
