#!/usr/bin/env bash
# The CPU scaling target (docs/distributed.md), measured in one run on the same two cores: Multi30k, the small
# preset, the same seeded batches and the same number of updates in each of
#   1 rank x 1 thread, 1 rank x 2 threads, 2 ranks x 1 thread (torchrun, Gloo over loopback),
# then `python/probattn_tools/tables/distributed.py` writes the table (tokens/s and ratios) beside the runs.
#
#   scripts/distributed_scaling.sh [OUT]      (default results/distributed/scaling)
#
# Environment: PROBATTN_BIN (default target/release/probattn), UPDATES (default 60), ROUNDS
# (default 2: the three configurations are run in turn this many times, in the same order),
# PROBATTN_PYTHON (default: the one ./download_libtorch.sh wrote into .cargo/config.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${PROBATTN_BIN:-target/release/probattn}"
out="${1:-results/distributed/scaling}"
updates="${UPDATES:-60}"
rounds="${ROUNDS:-2}"
python="${PROBATTN_PYTHON:-$(sed -n 's/^PROBATTN_PYTHON = "\(.*\)"$/\1/p' .cargo/config.toml 2>/dev/null)}"
[ -x "$bin" ] || { echo "no $bin: cargo build --release first" >&2; exit 1; }
[ -x "$python" ] || { echo "no Python: run ./download_libtorch.sh or set PROBATTN_PYTHON" >&2; exit 1; }
torchrun="$(dirname "$python")/torchrun"
[ -e "$out" ] && { echo "$out exists: remove it or name another folder" >&2; exit 1; }

common=(translate --preset small --max-updates "$updates" --limit-valid 100 --limit-test 100 --seeds 1 --device cpu)
for round in $(seq 1 "$rounds"); do
  "$bin" "${common[@]}" --threads 1 --out "$out/round-$round/1rank-1thread"
  "$bin" "${common[@]}" --threads 2 --out "$out/round-$round/1rank-2threads"
  OMP_NUM_THREADS=1 "$torchrun" --nproc-per-node 2 --no-python "$bin" "${common[@]}" --threads 1 \
    --out "$out/round-$round/2ranks-1thread"
done
PYTHONPATH=python "$python" -m probattn_tools.tables.distributed "$out"
