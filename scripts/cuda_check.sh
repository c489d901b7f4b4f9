#!/bin/bash
# The CUDA checks on a GPU machine that has PyTorch 2.11 but no Rust toolchain: the doctor, the
# test suite's CUDA paths, a GAT run, the VQA and translation smoke tests, and the benchmark.
#
# Usage: scripts/cuda_check.sh BIN_DIR DATA_DIR OUT_DIR [STEP...]
#   BIN_DIR   the release `probattn` and the test binaries, built where Rust is: the bin/ folder
#             of scripts/cuda_bundle.sh's archive
#   DATA_DIR  the data folder (planetoid/, multi30k/), as PROBATTN_DATA names it
#   OUT_DIR   where logs and run folders go
#   GAT_SEEDS seeds of the GAT run over every variant (default 1)
#   PRECISIONS     the precision step's benchmark precisions (default "f32 bf16"; float32 is also the
#                  memory-efficient step's long run, so "bf16" alone saves a repeat)
#   ME_VARIANTS    the memory-efficient step's variants at length (default: all six, one run each)
#   TESTS          the test binaries of the tests step (default: every one with a CUDA form)
#   PYTHON_TESTS   a unittest -k pattern for the python step (default: every test; "Cuda" for the
#                  CUDA class alone)
#   NCCL_PAIRS     the nccl step's pairs of one process and one NCCL rank (default 4). Runs of 300
#                  updates drifted by 12-33% on the H100, mostly faster run after run, so the step
#                  runs one warm-up first (not counted) and alternates the order from pair to pair
#                  (single first, then NCCL first, ...); probattn_tools.tables.nccl reports each
#                  pair's ratio and their geometric mean, from which an even number of pairs cancels
#                  a steady drift
#   TABLE_ROWS, TABLE_SEEDS, TABLE_JOBS   the table steps' rows, seeds and runs at a time on the one
#                  GPU (default 6, the CPU cores shared out), as scripts/translate_table.sh reads them
#   KERNELS_CHECK, KERNELS_BENCH   the kernels step's check flags (default: every case in every
#                  dtype) and benchmark flags (default "--shapes 8x1024,1x4096,1x16384"), the
#                  latter the kernels-bench step's too (the benchmark alone, with each
#                  implementation's time kernel by kernel)
#   KERNELS_SWEEP  the sweep step's flags (python -m probattn_tools.kernels.sweep; default: its own)
#   SANITIZER_CASES  the fused_cuda cases the sanitizer step runs (FUSED_CUDA_CASES; default
#                  "1,2,7,9,17": softmax, DNAS with GQA and padding, HNAS, Sinkhorn-3, causal BAM-WC)
#   FUSED_VARIANTS, FUSED_LENGTHS  the fused-long step's variants (default: the six benchmarked)
#                  and lengths (default "4096,32768,131072")
#   STEP      any of doctor tests gat vqa translate bench bench-quick pt2 memory-efficient precision
#             nccl python python-bench sdpa-empty-rows kernels kernels-bench sweep sanitizer fused-long fused-tf32
#             table table-converged (default: all but bench-quick, kernels, sweep, sanitizer,
#             fused-long, fused-tf32 and the table steps, the long-sequence and NCCL runs first)
#
# The sweep step times the kernels' launch settings (python -m probattn_tools.kernels.sweep) and
# writes the winners to OUT_DIR/sweep/table.json, which `--merge` takes into the tuning table the
# ahead-of-time build reads. The sanitizer step runs the fused CUDA route's GPU comparison under
# compute-sanitizer's memcheck, then racecheck (the embedded cubins, launched through the driver).
#
# The python-bench step runs the Python package's benchmarks on CUDA (python/probattn/benchmarks:
# bench.py, whose Rust side runs inside the package's extension, and mlm.py's tiny Llama and BERT
# against sdpa), each into its folder under OUT_DIR.
#
# The python step runs the Python package's tests (python/probattn/tests) from BIN_DIR/python-package:
# the package as python/probattn/tests/python.rs assembles it (target/tmp/python-package, after
# `cargo test -p probattn-py --test python`), copied into BIN_DIR.
#
# The test binaries hold the paths they were built at (the workspace root for python/ and the
# `probattn` binary for the CLI tests): set BUILT_ROOT to the workspace root of the build machine
# (scripts/cuda_bundle.sh writes it into BIN_DIR/BUILT_ROOT, read when BUILT_ROOT is unset) and
# this checkout is linked there when that path is free.
#
# The table step trains the Multi30k translation table's rows (scripts/translate_table.sh, with
# --device cuda) at its 13-epoch budget, seed by seed, several runs at a time; the table-converged
# step trains them until validation BLEU has not risen for 10 epochs (--patience, at most 100
# epochs). Each prints the table at its end, and a run a time limit stops keeps its folder
# (configuration, metrics so far), which the same script resumes or tabulates elsewhere.
set -u
bin=$(realpath "$1") data=$(realpath "$2") out=$(realpath -m "$3")
shift 3
steps=${*:-doctor sdpa-empty-rows memory-efficient precision nccl tests python python-bench pt2 gat vqa translate bench}
mkdir -p "$out"
root=$PWD
python=${PROBATTN_PYTHON:-$(command -v python3)}
torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))') || exit 1
# The subcommands' data folders default to subfolders of PROBATTN_DATA.
export LD_LIBRARY_PATH=$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PROBATTN_PYTHON=$python PROBATTN_DATA=$data
built_root=${BUILT_ROOT:-$(cat "$bin/BUILT_ROOT" 2>/dev/null || true)}
if [ -n "$built_root" ] && [ "$built_root" != "$root" ] && [ ! -e "$built_root" ]; then
  mkdir -p "$(dirname "$built_root")" && ln -s "$root" "$built_root"
fi
# The CLI tests run the binary they were built beside; a checkout without a build gets this one.
[ -e "$root/target/debug/probattn" ] || { mkdir -p "$root/target/debug" && cp "$bin/probattn" "$root/target/debug/probattn"; }
p=$bin/probattn

step() { echo "=== $1 ($(date -u +%H:%M:%S))"; }

# table OUT FLAGS...: scripts/translate_table.sh on CUDA, TABLE_JOBS runs at a time (default 6), the
# CPU cores shared out among them.
table() {
  local jobs=${TABLE_JOBS:-6}
  local threads=$(( $(nproc) / jobs > 0 ? $(nproc) / jobs : 1 ))
  PROBATTN=$p TABLE_JOBS=$jobs bash "$(dirname "$(realpath "$0")")/translate_table.sh" "$@" --device cuda --threads "$threads"
}
failed=
for s in $steps; do
  case $s in
    doctor)
      step doctor
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.csv"
      "$p" doctor --require-cuda --device cuda 2>&1 | tee "$out/doctor.txt"
      "$p" doctor --json --device cuda > "$out/doctor.json" ;;
    tests)
      step tests
      for t in ${TESTS:-bam edges external_variant fused_cuda interop normalizers parity precision repulsive pt2 tiled}; do
        (cd "$root" && "$bin/$t" --test-threads 4 2>&1) | tee -a "$out/tests.log" | grep -A3 -E "^test |test result|panicked|Error"
        [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed $t"
      done
      # Of the CLI's tests, the doctor's is the one with a CUDA form (the others run the CPU).
      (cd "$root/experiments" && "$bin/cli" doctor --test-threads 4 2>&1) | tee -a "$out/tests.log" | grep -A3 -E "^test |test result|panicked|Error"
      [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed cli" ;;
    gat)
      step gat
      "$p" gat --dataset cora --attention all --seeds "${GAT_SEEDS:-1}" --device cuda --out "$out/gat-cora-all" 2>&1 | tail -20 ;;
    vqa)
      step vqa
      "$p" vqa --quick --fusion all --device cuda --out "$out/vqa-quick" 2>&1 | tail -20 ;;
    translate)
      step translate
      "$p" translate --quick --device cuda --out "$out/translate-quick" 2>&1 | tail -20 ;;
    bench)
      step bench
      "$p" bench --device cuda --out "$out/bench" 2>&1 | tail -40 ;;
    bench-quick)
      step bench-quick
      "$p" bench --quick --device cuda --out "$out/bench-quick" 2>&1 | tail -40 ;;
    pt2)
      # A package compiled for CUDA (AOTInductor needs the GPU where it compiles), compared with
      # the native module on the GPU, then refused by name on the CPU.
      step pt2
      PYTHONPATH="$root/python" "$python" -m probattn_tools.export.pt2 mha --embed-dim 64 --heads 4 --key-padding --device cuda \
        --out "$out/mha-cuda.pt2" --inputs "$out/mha-cuda.safetensors" 2>&1 | tail -3
      "$p" compare --pt2 "$out/mha-cuda.pt2" --native mha --heads 4 --inputs "$out/mha-cuda.safetensors" --device cuda 2>&1 | tee "$out/pt2-cuda.txt"
      "$p" compare --pt2 "$out/mha-cuda.pt2" --native mha --heads 4 --inputs "$out/mha-cuda.safetensors" --device cpu 2>&1 | tee -a "$out/pt2-cuda.txt" ;;
    memory-efficient)
      # At length, every variant against SDPA and DNAS against FlexAttention's composition; then
      # the tiled path against the eager one and PyTorch's where those fit, with the caching
      # allocator's peaks.
      # One benchmark per variant: each writes its folder when it ends, so a time limit that stops
      # the step keeps the variants measured before it.
      step memory-efficient
      for v in ${ME_VARIANTS:-softmax dnas hnas sinkhorn-3 bam-wc bam-lc}; do
        "$p" bench --device cuda --batch 1 --memory-efficient --no-eager --variants "$v" --seq-lens 4096,8192,16384,32768 \
          --repeats 3 --out "$out/bench-me-long-$v" 2>&1 | tee "$out/bench-me-long-$v.log" | tail -12
      done
      "$p" bench --device cuda --batch 1 --memory-efficient --seq-lens 1024,4096 --out "$out/bench-me" 2>&1 | tee "$out/bench-me.log" | tail -30 ;;
    fused-long)
      # The fused CUDA route at length in bfloat16 against SDPA (and DNAS against FlexAttention's
      # composition) in the same run, up to S = 131,072 (past 2^32 score entries, BAM's draws
      # included). One benchmark per variant: each writes its folder when it ends.
      step fused-long
      for v in ${FUSED_VARIANTS:-softmax dnas hnas sinkhorn-3 bam-wc bam-lc}; do
        "$p" bench --device cuda --batch 1 --fused --no-eager --precision bf16 --variants "$v" \
          --seq-lens "${FUSED_LENGTHS:-4096,32768,131072}" --repeats 3 --out "$out/bench-fused-long-$v" 2>&1 \
          | tee "$out/bench-fused-long-$v.log" | tail -12
      done ;;
    fused-tf32)
      # The fused CUDA route's float32 kernels (TF32 products) against SDPA in float32 with TF32
      # allowed, both sides in one run: softmax and DNAS at S = 4,096 and 16,384.
      step fused-tf32
      "$p" bench --device cuda --batch 1 --fused --no-eager --precision tf32 --variants softmax,dnas \
        --seq-lens 4096,16384 --repeats 3 --out "$out/bench-fused-tf32" 2>&1 | tee "$out/bench-fused-tf32.log" | tail -12 ;;
    precision)
      # bfloat16 (docs/precision.md): the memory-efficient path against SDPA in bfloat16 up to
      # S = 32,768, float32 beside it, and a quick translation run in bfloat16.
      step precision
      for prec in ${PRECISIONS:-f32 bf16}; do
        "$p" bench --device cuda --batch 1 --memory-efficient --no-eager --variants softmax,dnas --seq-lens 4096,8192,16384,32768 \
          --repeats 3 --precision $prec --out "$out/bench-me-long-$prec" 2>&1 | tee "$out/bench-me-long-$prec.log" | tail -20
      done
      "$p" translate --quick --precision bf16 --device cuda --out "$out/translate-quick-bf16" 2>&1 | tail -5 ;;
    nccl)
      # torchrun with NCCL, one rank, against one process without a process group, NCCL_PAIRS pairs
      # after a warm-up run, the order alternating from pair to pair (tokens/s of training, each
      # pair's ratio); all the GPUs in one job where there are several.
      step nccl
      torchrun=$(dirname "$python")/torchrun
      short=(translate --device cuda --max-updates 300 --limit-valid 20 --limit-test 20)
      mkdir -p "$out/nccl"
      run_single() { "$p" "${short[@]}" --out "$out/nccl/$1" > "$out/nccl/$1.log" 2>&1; tail -2 "$out/nccl/$1.log"; }
      run_nccl() {
        "$torchrun" --nproc-per-node 1 --no-python "$p" "${short[@]}" --dist-backend nccl --out "$out/nccl/$1" \
          > "$out/nccl/$1.log" 2>&1; tail -2 "$out/nccl/$1.log"
      }
      run_single warmup
      for i in $(seq "${NCCL_PAIRS:-4}"); do
        if [ $((i % 2)) -eq 1 ]; then run_single "single-$i"; run_nccl "ranks1-$i"; else run_nccl "ranks1-$i"; run_single "single-$i"; fi
      done
      gpus=$(nvidia-smi -L | wc -l)
      if [ "$gpus" -gt 1 ]; then
        "$torchrun" --nproc-per-node "$gpus" --no-python "$p" "${short[@]}" --dist-backend nccl --out "$out/nccl/ranks$gpus" \
          > "$out/nccl/ranks$gpus.log" 2>&1; tail -2 "$out/nccl/ranks$gpus.log"
      fi
      PYTHONPATH="$root/python" "$python" -m probattn_tools.tables.nccl "$out/nccl" | tee "$out/nccl/tokens.md" ;;
    python)
      step python
      (cd "$bin/python-package" && PYTHONPATH="$bin/python-package:$root/python" "$python" -m unittest discover -v \
        -s "$root/python/probattn/tests" ${PYTHON_TESTS:+-k "$PYTHON_TESTS"} 2>&1) | tee "$out/python.log" | grep -E "^test_|Cuda|OK|FAILED|Error" | tail -40 ;;
    sdpa-empty-rows)
      # What SDPA's CUDA kernels give a query no key may attend: softmax takes them under masks
      # that can empty a row only where they give zeros, as the CPU's kernel does.
      step sdpa-empty-rows
      PYTHONPATH="$root/python" "$python" -m probattn_tools.baselines.sdpa_empty_rows --device cuda --out "$out/sdpa-empty-rows" \
        2>&1 | tee "$out/sdpa-empty-rows.log" | tail -40 ;;
    kernels)
      # The Triton kernels of the plans, JIT-compiled on this GPU: their check against the formulas
      # in every dtype, then their benchmark against SDPA and compiled FlexAttention.
      step kernels
      # shellcheck disable=SC2086  # KERNELS_BENCH are words
      CHECK_FLAGS="${KERNELS_CHECK:-}" PYTHON="$python" bash "$(dirname "$(realpath "$0")")/kernels_gpu.sh" "$out/kernels" \
        ${KERNELS_BENCH:---shapes 8x1024,1x4096,1x16384} 2>&1 | tail -60 ;;
    kernels-bench)
      # The kernels step's benchmark alone (its KERNELS_BENCH flags), each implementation's time
      # also kernel by kernel (--profile), and ours also with the key pass in the form the build
      # leaves out (--key-tiles both).
      step kernels-bench
      # shellcheck disable=SC2086  # KERNELS_BENCH are words
      PYTHONPATH="$root/python" "$python" -m probattn_tools.kernels.bench --out "$out/kernels-bench" --profile \
        --key-tiles both \
        ${KERNELS_BENCH:---shapes 8x1024,1x4096,1x16384} 2>&1 | tee "$out/kernels-bench.log" | tail -80 ;;
    sweep)
      step sweep
      # shellcheck disable=SC2086  # KERNELS_SWEEP are words
      PYTHONPATH="$root/python" "$python" -m probattn_tools.kernels.sweep --out "$out/sweep" ${KERNELS_SWEEP:-} 2>&1 \
        | tee "$out/sweep.log" | tail -20 ;;
    sanitizer)
      step sanitizer
      sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      [ -n "$sanitizer" ] || { echo "no compute-sanitizer on this machine" | tee "$out/sanitizer.log"; continue; }
      # Without the caching allocator every tensor is its own allocation, so memcheck sees an
      # access past a tensor's end instead of into the pool's next block.
      for tool in memcheck racecheck; do
        (cd "$root" && PYTORCH_NO_CUDA_MEMORY_CACHING=1 FUSED_CUDA_CASES=${SANITIZER_CASES:-1,2,7,9,17} "$sanitizer" --tool "$tool" --error-exitcode 3 \
          "$bin/fused_cuda" on_a_gpu_the_route_matches --test-threads 1 --nocapture 2>&1) | tee "$out/sanitizer-$tool.log" \
          | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result|panicked|within" | tail -20
        echo "$tool rc ${PIPESTATUS[0]}" | tee -a "$out/sanitizer.log"
      done ;;
    python-bench)
      step python-bench
      pp="$bin/python-package:$root/python"
      # A call takes 0.2-4 ms on a GPU at S = 1,024, where 10 calls a round (the CPU's default)
      # left the Python / Rust ratios between 0.74 and 1.21: 100 calls a round, 5 rounds.
      PYTHONPATH=$pp "$python" "$root/python/probattn/benchmarks/bench.py" --device cuda --overhead \
        --repeats 100 --rounds 5 --out "$out/python-bench" 2>&1 | tee "$out/python-bench.log" | tail -30
      for model in llama bert; do
        PYTHONPATH=$pp "$python" "$root/python/probattn/benchmarks/mlm.py" --device cuda --model $model --data "$data/multi30k" \
          --tokenizer "$root/results/translate/multi30k-softmax-seed1/tokenizer.json" --out "$out/python-$model" 2>&1 \
          | tee "$out/python-$model.log" | tail -12
      done ;;
    table)
      step table
      table "$out/table" --max-epochs 13 ;;
    table-converged)
      step table-converged
      table "$out/table-converged" --max-epochs 100 --patience 10 ;;
    *) echo "unknown step $s" >&2; exit 1 ;;
  esac
done
step done
# A failing test binary fails the run (after every step has had its turn).
[ -z "$failed" ] || { echo "failed test binaries:$failed" >&2; exit 1; }
