#!/usr/bin/env bash
# The Triton kernels of the plans on a GPU, as one step for a device machine (it needs Python with
# torch and Triton, no Rust): their check against the reference formulas in every dtype (bfloat16
# included, which Triton's interpreter cannot check), then their benchmark against SDPA and
# compiled FlexAttention. Writes check.json, check.log, bench.json and bench.log into OUT.
#
#   scripts/kernels_gpu.sh OUT [bench flags...]     # e.g. --shapes 8x1024,1x4096 --repeats 20
#   CHECK_FLAGS   flags of the check (e.g. "--quick" for its 32 cases, "--dtypes bfloat16,float16")
set -euo pipefail
out="${1:?usage: scripts/kernels_gpu.sh OUT [bench flags...]}"
shift
mkdir -p "$out"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
status=0
# shellcheck disable=SC2086  # CHECK_FLAGS are words
"$python" -m probattn_tools.kernels.check --device cuda ${CHECK_FLAGS:-} --json "$out/check.json" 2>&1 | tee "$out/check.log" || status=1
"$python" -m probattn_tools.kernels.bench --out "$out" "$@" 2>&1 | tee "$out/bench.log" || status=1
exit $status
