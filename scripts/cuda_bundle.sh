#!/bin/bash
# Builds here (where Rust is) everything scripts/cuda_check.sh runs on a GPU machine that has
# PyTorch 2.11 but no Rust toolchain and no network, and packs it into one archive:
#   bin/probattn         the release CLI
#   bin/<test>           the test binaries with a CUDA form, and the CLI's tests (`cli`), stripped
#   bin/python-package   the Python package as python/probattn/tests/python.rs assembles it
#   bin/BUILT_ROOT       this checkout's path, which the test binaries hold (cuda_check.sh links
#                        the machine's checkout there)
#   data/                multi30k/ and planetoid/ from the data folder, when it has them
#
# Usage: scripts/cuda_bundle.sh ARCHIVE.tar.xz [DATA_DIR]
#   DATA_DIR  the data folder (default $PROBATTN_DATA, else data/)
# The binaries embed the fused CUDA kernels of PROBATTN_CUDA_ARCHS alone (default 90: the H100's
# and H200's), half the whole set: with the tracked files the archive must stay within the 64 MiB
# a GPU machine takes (the whole set's archive, 34.6 MiB, and 36.6 MiB of tracked files do not).
# Building with another PROBATTN_CUDA_ARCHS than the last build's rebuilds the crates above
# probattn-kernels (here, and again in the next build without it).
# On the GPU machine, from a checkout of the same commit:
#   mkdir -p /tmp/cb && tar xJf ARCHIVE.tar.xz -C /tmp/cb
#   scripts/cuda_steps.sh /tmp/cb/bin /tmp/cb/data /tmp/cuda ARCHIVE_DIR doctor:20 memory-efficient:300 ...
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,20p' "$0" >&2; exit 2; }
archive=$(realpath -m "$1")
data=$(realpath -m "${2:-${PROBATTN_DATA:-data}}")
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PROBATTN_PYTHON:-python3}
export PROBATTN_CUDA_ARCHS=${PROBATTN_CUDA_ARCHS:-90}
tests="bam edges external_variant fused_cuda interop normalizers parity precision repulsive pt2 tiled"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/data"

cargo build --release -p probattn-experiments --bin probattn
cargo build --release -p probattn-py
cp target/release/probattn "$stage/bin/"

# The test binaries, named by their targets: cargo prints where it wrote each.
cargo test --workspace --no-run --message-format=json 2>/dev/null | "$python" -c '
import json, sys
wanted = set(sys.argv[1].split()) | {"cli"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"] \
            and m["target"]["name"] in wanted and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' "$tests" | while read -r name exe; do
  strip -o "$stage/bin/$name" "$exe"
done
for t in $tests cli; do
  [ -x "$stage/bin/$t" ] || { echo "error: no test binary for $t in cargo's output" >&2; exit 1; }
done

pkg=$stage/bin/python-package/probattn
mkdir -p "$pkg"
cp python/probattn/probattn/*.py "$pkg/"
cp target/release/lib_native.so "$pkg/_native.abi3.so"
echo "$root" > "$stage/bin/BUILT_ROOT"

for d in multi30k planetoid; do
  if [ -d "$data/$d" ]; then cp -r "$data/$d" "$stage/data/"; else echo "note: $data/$d not found; not packed" >&2; fi
done
mkdir -p "$(dirname "$archive")"
# One xz stream with a window over the whole archive: every binary embeds the same packed GPU
# kernels (probattn-kernels), which a window this wide stores once.
tar cf - -C "$stage" bin data | xz -T1 --lzma2=preset=6,dict=512MiB > "$archive.part"
mv "$archive.part" "$archive"
echo "$archive: $(du -h "$archive" | cut -f1), kernels for sm_$PROBATTN_CUDA_ARCHS, commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (dirty tree)')"
# The GPU machines take the checkout's tracked files and the carried archive, 64 MiB together.
tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$(( $(stat -c %s "$archive") + tracked ))
echo "with the tracked files: $(( total / 1048576 )) MiB of the 64 MiB a GPU machine takes"
(( total <= 64 * 1048576 )) || echo "warning: over 64 MiB: the archive cannot travel with this checkout" >&2
