#!/usr/bin/env bash
# Installs PyTorch 2.11.0 from PyPI (it carries libtorch 2.11.0, which tch 0.24 needs) into a
# virtualenv, and points cargo at it through .cargo/config.toml, so that plain `cargo build`,
# `cargo test` and `cargo run` work with nothing exported by hand.
# The same virtualenv is the project's Python for the PyTorch reference (python/).
# A second run finds everything in place and only rewrites .cargo/config.toml (seconds).
set -euo pipefail

TORCH_VERSION="2.11.0"
# numpy below 2.4: Triton 3.6's interpreter, which runs the Triton kernels' tests on the CPU, fails
# on loop bounds given at run time with numpy 2.4.
PY_PACKAGES=("torch==${TORCH_VERSION}" "numpy<2.4" "safetensors" "sacrebleu==2.6.0" "tokenizers==0.23.3" "transformers==5.24.0")
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_VENV="${XDG_CACHE_HOME:-$HOME/.cache}/probattn/torch-${TORCH_VERSION}-venv"

usage() {
  cat <<USAGE
Usage: ./download_libtorch.sh [--local | --venv DIR | --python PY] [--help]

Installs PyTorch ${TORCH_VERSION} (libtorch ${TORCH_VERSION}) plus numpy, safetensors and sacrebleu from PyPI,
installs gloo's headers (Debian's libgloo-dev, when run as root on Debian; distributed training
needs them), then writes .cargo/config.toml so cargo builds and runs against it.

  (no flag)      per-user cache shared by every clone: ${CACHE_VENV}
  --local        a project-local virtualenv: ${ROOT}/.venv
  --venv DIR     a virtualenv at DIR (created if absent)
  --python PY    reuse an existing Python whose torch is ${TORCH_VERSION}; installs nothing
                 into it, only checks it (numpy, safetensors and sacrebleu are needed by the tests)
  --help         this text

Environment: PYTHON (default python3) is the interpreter that creates the virtualenv;
PROBATTN_GLOO_INCLUDE a folder with gloo/algorithm.h, if not the system's.
USAGE
}

die() { echo "download_libtorch.sh: error: $*" >&2; exit 1; }

venv="$CACHE_VENV"
reuse_python=""
while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h) usage; exit 0 ;;
    --local) venv="$ROOT/.venv" ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a directory"; venv="$2"; shift ;;
    --python) [ $# -ge 2 ] || die "--python needs an interpreter"; reuse_python="$2"; shift ;;
    *) usage >&2; die "unknown argument '$1'" ;;
  esac
  shift
done

# Prints nothing and fails unless $1 is a Python with torch $TORCH_VERSION, numpy, safetensors and sacrebleu.
# With a second argument "own" (the set-up's virtualenv), numpy must also be below 2.4.
check_python() {
  "$1" - "$TORCH_VERSION" "${2:-}" <<'PY' 2>/dev/null
import sys
import numpy, safetensors, sacrebleu, torch, transformers
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert sys.argv[2] != "own" or tuple(map(int, numpy.__version__.split(".")[:2])) < (2, 4), numpy.__version__
PY
}

if [ -n "$reuse_python" ]; then
  command -v "$reuse_python" >/dev/null || die "no Python at '$reuse_python'"
  check_python "$reuse_python" || die "'$reuse_python' lacks torch==${TORCH_VERSION}, numpy, safetensors, sacrebleu or transformers; \
install them with: $reuse_python -m pip install ${PY_PACKAGES[*]}"
  python="$(command -v "$reuse_python")"
else
  python="$venv/bin/python"
  if [ -x "$python" ] && check_python "$python" own; then
    echo "PyTorch ${TORCH_VERSION} already installed in $venv"
  else
    base="${PYTHON:-python3}"
    command -v "$base" >/dev/null || die "no '$base' to create the virtualenv with (set PYTHON)"
    if [ -x "$python" ]; then
      echo "Bringing the packages in $venv to: ${PY_PACKAGES[*]}"
    else
      echo "Installing PyTorch ${TORCH_VERSION} into $venv (about 4.7 GB with its CUDA libraries)..."
    fi
    mkdir -p "$(dirname "$venv")"
    [ -x "$python" ] || "$base" -m venv "$venv"
    "$python" -m pip install --quiet --upgrade pip
    "$python" -m pip install --quiet "${PY_PACKAGES[@]}"
    check_python "$python" own || die "the install in $venv did not give a working torch ${TORCH_VERSION} with numpy < 2.4"
  fi
fi

# probattn's Python package (python/probattn_tools: references, data, baselines, tables, exports)
# on the interpreter's path, so that `python -m probattn_tools.<role>.<script>` runs from anywhere:
# a .pth file naming this checkout's python/ folder, in our own virtualenv only (the binary and the
# tests set PYTHONPATH themselves; with --python, `pip install ./python` does it for that interpreter).
if [ -z "$reuse_python" ]; then
  site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  printf '%s\n' "$ROOT/python" > "$site/probattn_tools.pth"
fi

# Everything cargo needs, read from the interpreter itself.
read -r torch_dir cxx11_abi < <("$python" -c \
  'import os, torch; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))')
[ -f "$torch_dir/lib/libtorch.so" ] || [ -f "$torch_dir/lib/libtorch.dylib" ] \
  || die "no libtorch in $torch_dir/lib"

# Gloo's headers, for c10d's CPU process group (probattn::distributed): the wheel carries gloo's
# code inside libtorch_cpu but not its headers. Debian's libgloo-dev supplies them (headers only
# are used; nothing links Debian's libgloo). PROBATTN_GLOO_INCLUDE names another folder.
gloo_headers() {
  for dir in "${PROBATTN_GLOO_INCLUDE:-}" /usr/include /usr/local/include; do
    [ -n "$dir" ] && [ -f "$dir/gloo/algorithm.h" ] && return 0
  done
  return 1
}
if ! gloo_headers; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "Installing gloo's headers (Debian's libgloo-dev) for distributed training..."
    apt-get install -y --no-install-recommends libgloo-dev >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends libgloo-dev >/dev/null 2>&1; } \
      || echo "download_libtorch.sh: warning: apt-get could not install libgloo-dev" >&2
  fi
  gloo_headers || echo "download_libtorch.sh: warning: no gloo headers (install libgloo-dev, or set PROBATTN_GLOO_INCLUDE): \
probattn builds without distributed training, and its distributed tests fail" >&2
fi

# CUDA's compiler-runtime and CCCL headers (crt/, nv/), which c10d's NCCL process group needs at
# build time and the wheel's CUDA runtime package leaves out: two small header-only wheels of the
# runtime's CUDA version, into the same nvidia/cu13/include folder. Not into a --python interpreter.
if [ -z "$reuse_python" ]; then
  cuda_include="$("$python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "include"))' 2>/dev/null || true)"
  if [ -d "$cuda_include" ] && { [ ! -f "$cuda_include/crt/host_config.h" ] || [ ! -d "$cuda_include/nv" ]; }; then
    cuda_minor="$("$python" -c 'import importlib.metadata as m; print(".".join(m.version("nvidia-cuda-runtime").split(".")[:2]))')"
    echo "Installing CUDA ${cuda_minor}'s crt and CCCL headers (for NCCL in distributed training)..."
    "$python" -m pip install --quiet "nvidia-cuda-crt==${cuda_minor}.*" "nvidia-cuda-cccl==${cuda_minor}.*" \
      || echo "download_libtorch.sh: warning: no CUDA crt/CCCL headers: probattn builds without NCCL" >&2
  fi
fi

mkdir -p "$ROOT/.cargo"
config="$ROOT/.cargo/config.toml"
tmp="$(mktemp "$ROOT/.cargo/config.toml.XXXXXX")"
cat > "$tmp" <<TOML
# Written by download_libtorch.sh; rerun it instead of editing. Not committed: paths are local.
[env]
LIBTORCH = "$torch_dir"
LIBTORCH_CXX11_ABI = "$cxx11_abi"
# The Python whose headers pyo3 builds the extension of python/probattn for (abi3).
PYO3_PYTHON = "$python"
PROBATTN_PYTHON = "$python"
TOML
if cmp -s "$tmp" "$config"; then rm -f "$tmp"; else mv "$tmp" "$config"; fi

echo "libtorch ${TORCH_VERSION}: $torch_dir"
echo "Python for the PyTorch reference: $python"
gloo_headers && echo "gloo headers for distributed training: found"
echo "cargo is set up through $config"
