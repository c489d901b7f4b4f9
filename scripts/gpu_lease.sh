#!/bin/bash
# The checks that only a GPU can run and that wait for one, ordered and time-boxed to fit a short
# device lease in two commands of at most 600 s each: run from the repository root of a checkout
# of the bundle's commit, on the GPU machine.
#
# Usage: scripts/gpu_lease.sh BUNDLE OUT [PART | STEP:SECONDS...]
#   BUNDLE  scripts/cuda_bundle.sh's archive (built here, carried there)
#   OUT     where each step's folder goes packed (ARCHIVE_DIR of cuda_steps.sh), with log.txt
#   PART    route (the default), kernels or long; or cuda_check.sh's steps, each with its limit
#           (as `tests:120 fused-long:240`)
# TESTS, KERNELS_CHECK and KERNELS_BENCH (cuda_check.sh's) default to the values below.
#
# The steps, each under its own limit (a step that overruns costs only itself):
#   route:
#   doctor            20 s   the GPU, the driver and libtorch as the library sees them
#   sdpa-empty-rows   60 s   what SDPA's CUDA backends give a query no key may attend
#   tests            190 s   the external_variant, fused_cuda, normalizers, precision and tiled
#                            binaries: the embedded Triton kernels through the driver API against
#                            the float64 tiles and formulas (forward, gradients) and the backend's
#                            choice of them; softmax on SDPA's CUDA kernels against the eager form;
#                            every variant's bfloat16 tolerance, memory-efficient calls on the
#                            fused route; the tiles against the eager path on CUDA
#   sanitizer        180 s   compute-sanitizer's memcheck and racecheck on five of the fused route's
#                            GPU comparisons (softmax, DNAS, HNAS, Sinkhorn-3, causal BAM-WC)
#   fused-tf32        90 s   the route's float32 kernels (TF32 products) against SDPA in float32 with
#                            TF32 allowed, softmax and DNAS at S = 4,096 and 16,384
#   kernels:
#   sweep            240 s   the kernels' launch settings timed in bfloat16 at head dimensions 64 and
#                            128 (softmax, DNAS and BAM-WC, 1 x 4,096): the tuning table's entries
#   kernels          300 s   the Triton kernels' check in bfloat16 and float16 (their quick cases),
#                            then their benchmark against SDPA and FlexAttention at 8 x 1,024 and
#                            1 x 4,096
#   long:
#   fused-long       540 s   the fused route in bfloat16 against SDPA in one run per variant, at
#                            S = 4,096, 32,768 and 131,072 (B 1, H 8, E 512; softmax, DNAS, HNAS,
#                            Sinkhorn-3, BAM-WC, BAM-LC): time, TFLOP/s and peak memory
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,36p' "$0" >&2; exit 2; }
bundle=$(realpath "$1") out=$(realpath -m "$2") part=${3:-route}
case $part in
  route) steps=(doctor:20 sdpa-empty-rows:60 tests:190 sanitizer:180 fused-tf32:90) ;;
  kernels) steps=(sweep:240 kernels:300) ;;
  long) steps=(fused-long:540) ;;
  *:*) steps=("${@:3}") ;;
  *) echo "gpu_lease.sh: PART is route, kernels, long or STEP:SECONDS..., got $part" >&2; exit 2 ;;
esac
[ -f "$bundle" ] || { echo "gpu_lease.sh: no bundle at $bundle (scripts/cuda_bundle.sh builds it)" >&2; exit 2; }
here=$(dirname "$(realpath "$0")")
work=$(mktemp -d)
tar xJf "$bundle" -C "$work"
export TESTS=${TESTS:-external_variant fused_cuda normalizers precision tiled}
export KERNELS_CHECK=${KERNELS_CHECK:---quick --dtypes bfloat16,float16}
export KERNELS_BENCH=${KERNELS_BENCH:---shapes 8x1024,1x4096 --repeats 10}
bash "$here/cuda_steps.sh" "$work/bin" "$work/data" "$work/out" "$out" "${steps[@]}"
