#!/usr/bin/env bash
# Builds the probattn Python package as the wheel users get: maturin over python/probattn (abi3,
# Python 3.10 and later, linked against the set-up's libtorch 2.11.0), release profile.
#
#   scripts/build_wheel.sh [--out DIR] [--install]
#
# --out: the folder for the wheel (default target/wheels); --install: also pip-install it into the
# set-up's virtualenv. Prints the wheel's path last. Needs ./download_libtorch.sh first (it writes
# .cargo/config.toml, whose PROBATTN_PYTHON is the interpreter used here); maturin (pinned below) is
# installed into that interpreter's environment when it is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MATURIN_VERSION=1.9.6
out=target/wheels
install=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --install) install=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "error: unknown argument '$1' (--out DIR, --install)" >&2; exit 2 ;;
  esac
done
[ -f .cargo/config.toml ] || { echo "error: no .cargo/config.toml: run ./download_libtorch.sh first" >&2; exit 1; }
python=$(sed -n 's/^PROBATTN_PYTHON *= *"\(.*\)"/\1/p' .cargo/config.toml)
[ -x "$python" ] || { echo "error: PROBATTN_PYTHON ($python) in .cargo/config.toml is not an interpreter: run ./download_libtorch.sh" >&2; exit 1; }
if ! "$python" -m maturin --version 2>/dev/null | grep -q "$MATURIN_VERSION"; then
  "$python" -m pip install --quiet "maturin==$MATURIN_VERSION"
fi
mkdir -p "$out"
# A fresh file name each build is not guaranteed (the version is the crate's): the old wheel goes.
rm -f "$out"/probattn-*.whl
# --compatibility linux: the wheel links the libtorch of the torch it is imported beside, which no
# manylinux policy covers (auditwheel would try to vendor it).
"$python" -m maturin build --release --manifest-path python/probattn/Cargo.toml --interpreter "$python" \
  --compatibility linux --out "$out" >&2
wheel=$(ls "$out"/probattn-*.whl)
if [ "$install" = 1 ]; then
  "$python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
fi
echo "$wheel"
