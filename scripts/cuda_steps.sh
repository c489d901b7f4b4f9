#!/bin/bash
# Runs steps of scripts/cuda_check.sh one at a time, each under its own time limit, and packs each
# step's folder into ARCHIVE_DIR/<step>.tgz as soon as the step ends, so a step that overruns
# costs only itself and what finished is kept. Meant for a GPU machine held for a short while.
#
# Usage: scripts/cuda_steps.sh BIN_DIR DATA_DIR OUT_DIR ARCHIVE_DIR STEP:SECONDS...
#   e.g.   scripts/cuda_steps.sh bin data /tmp/cuda archive doctor:20 memory-efficient:300 nccl:80
# BIN_DIR, DATA_DIR and the environment variables are cuda_check.sh's (its header says which);
# each step writes under OUT_DIR/<step>. ARCHIVE_DIR/log.txt collects every step's output, with
# its start, end and exit status (124: stopped at its limit). Checkpoints are left out.
set -u
[ $# -ge 5 ] || { sed -n '2,10p' "$0" >&2; exit 2; }
bin=$1 data=$2 out=$3 archive=$4
shift 4
here=$(dirname "$(realpath "$0")")
mkdir -p "$out" "$archive"
log=$archive/log.txt
for spec in "$@"; do
  name=${spec%%:*} limit=${spec#*:}
  [ "$name" != "$spec" ] && [ -n "$limit" ] || { echo "error: $spec is not STEP:SECONDS" >&2; exit 2; }
  echo "##### $name (limit ${limit}s) start $(date -u +%T)" | tee -a "$log"
  timeout --kill-after 5 "$limit" bash "$here/cuda_check.sh" "$bin" "$data" "$out/$name" "$name" 2>&1 | tee -a "$log"
  echo "##### $name rc ${PIPESTATUS[0]} end $(date -u +%T)" | tee -a "$log"
  tar czf "$archive/$name.tgz" --exclude='checkpoint_*' -C "$out" "$name"
done
