#!/usr/bin/env bash
# Installs a probattn wheel (scripts/build_wheel.sh) into a fresh virtualenv that holds nothing but
# torch 2.11.0 and its own requirements, and runs the package's test suite there from outside the
# checkout, as a user who installed the wheel would.
#
#   scripts/test_wheel.sh WHEEL [--keep]
#
# torch is the set-up's (./download_libtorch.sh), reached without a second download: the fresh
# environment's site-packages gets a .pth naming a folder of links to torch's distributions and
# those they require, and nothing else (no transformers: those tests skip). The tests' references
# (python/probattn_tools, pure PyTorch) are copied beside the tests; python/ itself is not put on
# the path, so the package imported is the installed one. --keep leaves the folder for inspection.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: scripts/test_wheel.sh WHEEL [--keep]" >&2; exit 2; }
wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
[ -f "$wheel" ] || { echo "error: no wheel at $1 (scripts/build_wheel.sh builds one)" >&2; exit 1; }
keep=0
[ "${2:-}" = "--keep" ] && keep=1
python=$(sed -n 's/^PROBATTN_PYTHON *= *"\(.*\)"/\1/p' "$root/.cargo/config.toml")
[ -x "$python" ] || { echo "error: no set-up interpreter in .cargo/config.toml: run ./download_libtorch.sh" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/probattn-wheel.XXXXXX")
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT
echo "fresh environment: $work/venv" >&2
"$python" -m venv "$work/venv"
fresh="$work/venv/bin/python"
# torch and its requirements, as links into the set-up's site-packages.
"$python" - "$work/torch-only" <<'PY'
import importlib.metadata as md, os, re, sys
from packaging.requirements import Requirement

out = sys.argv[1]
os.makedirs(out)
# (name, extra) pairs: a requirement with extras (cuda-toolkit[cublas, ...]) brings what those
# extras require too.
seen, todo = set(), [("torch", "")]
while todo:
    name, extra = todo.pop()
    name = re.sub(r"[-_.]+", "-", name).lower()
    if (name, extra) in seen:
        continue
    seen.add((name, extra))
    dist = md.distribution(name)
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            todo += [(req.name, "")] + [(req.name, e) for e in req.extras]
    base = dist.locate_file("")
    for top in sorted({str(f).split("/")[0] for f in dist.files or []}):
        src, dst = os.path.join(base, top), os.path.join(out, top)
        if top not in ("..", "bin") and os.path.exists(src) and not os.path.exists(dst):
            os.symlink(src, dst)
names = sorted({n for n, _ in seen})
print(f"torch-only: {len(names)} distributions: {', '.join(names)}", file=sys.stderr)
PY
site=$("$fresh" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$work/torch-only" > "$site/torch-only.pth"
"$fresh" -m pip install --quiet --no-index "$wheel"   # torch==2.11.0 is met by the links; nothing is fetched
mkdir -p "$work/tests"
cp "$root"/python/probattn/tests/*.py "$work/tests/"   # the test files and what they share (common.py)
cp -r "$root/python/probattn_tools" "$work/tests/"
cd "$work/tests"
"$fresh" -c "import probattn, torch; print('probattn from', probattn.__file__, 'torch', torch.__version__)" >&2
"$fresh" -m unittest discover -s . -p "test_*.py"
