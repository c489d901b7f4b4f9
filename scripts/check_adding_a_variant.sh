#!/usr/bin/env bash
# Adds a built-in variant through exactly the places docs/adding-a-variant.md names, in a scratch
# worktree of HEAD, and runs it everywhere a variant runs: `warm-sinkhorn-N`, Sinkhorn-N at
# temperature 2 (its scores halved), defined by its plan alone.
#
#   1. the normalizer: src/attention/normalize/warm_sinkhorn.rs (name and plan), and its `mod`;
#   2. its registry entry in normalize/registry.rs, and the regenerated variants.json;
#   3. its formula in python/probattn_tools/reference/formulas.py, written from the definition;
#   4. its page: docs/formulas.md and the README's list of variants.
#
# Then, with nothing else edited: `probattn variants` reports what the plan implies; the parity
# test compares the eager path with the formula (float64, 1e-10); `probattn attend` runs it on
# the eager path and the memory-efficient one and the two agree; a Transformer trains with it
# (`translate --quick`, a few updates); the Python package computes it through
# `probattn.functional.scaled_dot_product_attention`, eager and memory-efficient, against the
# formula; the library's registry tests and the package's own tests pass.
#
#   scripts/check_adding_a_variant.sh [LOG]    # needs the set-up (./download_libtorch.sh) and
#                                              # Multi30k under $PROBATTN_DATA (or data/)
#
# Exits 1 at the first step that fails. The worktree shares this checkout's target folder, so only
# the workspace's own crates are built again (about ten minutes on 2 cores).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log="${1:-/dev/null}"
python=$(sed -n 's/^PROBATTN_PYTHON = "\(.*\)"$/\1/p' "$root/.cargo/config.toml" 2>/dev/null || true)
[ -x "${python:-}" ] || { echo "error: no PROBATTN_PYTHON in .cargo/config.toml: run ./download_libtorch.sh first" >&2; exit 1; }
data="${PROBATTN_DATA:-$root/data}"
[ -d "$data/multi30k" ] || { echo "error: no Multi30k in $data (set PROBATTN_DATA, or run the data download script)" >&2; exit 1; }
export PROBATTN_DATA="$data"
scratch=$(mktemp -d)
tree="$scratch/tree"
git -C "$root" worktree add --detach "$tree" HEAD >/dev/null
trap 'git -C "$root" worktree remove --force "$tree"; rm -rf "$scratch"' EXIT
mkdir -p "$tree/.cargo" && cp "$root/.cargo/config.toml" "$tree/.cargo/"
export CARGO_TARGET_DIR="$root/target"
cd "$tree"
step() { echo "== $*" | tee -a "$log"; }
run() { "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }

step "1-4. the documented places"
"$python" - <<'EOF'
from pathlib import Path


def edit(path, anchor, new, before=False):
    """Puts `new` after (or before) `anchor`, which must occur exactly once."""
    text = Path(path).read_text()
    if text.count(anchor) != 1:
        raise SystemExit(f"{path}: the anchor {anchor!r} occurs {text.count(anchor)} times, not once: "
                         "docs/adding-a-variant.md no longer matches the code")
    Path(path).write_text(text.replace(anchor, new + anchor if before else anchor + new))


Path("src/attention/normalize/warm_sinkhorn.rs").write_text('''\
//! Sinkhorn-N at temperature 2: the scores halved, then N column/row sweeps.

use super::Normalizer;
use crate::plan::Tiled;
use crate::{Error, Result};

#[derive(Debug, Clone, Copy)]
pub struct WarmSinkhorn {
    iterations: u32,
}

impl WarmSinkhorn {
    pub fn new(iterations: u32) -> Result<Self> {
        if iterations == 0 {
            return Err(Error::Config("warm-sinkhorn needs at least one iteration".into()));
        }
        Ok(Self { iterations })
    }
}

impl Normalizer for WarmSinkhorn {
    fn name(&self) -> String {
        format!("warm-sinkhorn-{}", self.iterations)
    }

    fn tiled(&self) -> Option<Tiled<'_>> {
        Some(Tiled { score_scale: 0.5, ..Tiled::sweeps(self.name(), self.iterations) })
    }
}
''')
edit("src/attention/normalize/mod.rs", "mod support;\n", "mod warm_sinkhorn;\n")
edit("src/attention/normalize/mod.rs", "pub use support::{EdgeList, Support};\n", "pub use warm_sinkhorn::WarmSinkhorn;\n")
edit("src/attention/normalize/registry.rs", "/// Every built-in variant, in the order of the papers' tables.\n", '''\
static WARM_SINKHORN: VariantSpec = VariantSpec {
    name: "warm-sinkhorn-N",
    aliases: &[],
    example: "warm-sinkhorn-2",
    summary: "Sinkhorn-N at temperature 2 (the scores halved)",
    source: "Sinkhorn 1964; Ding et al. 2020",
    benchmarked: false,
    settings: &[],
    parse: |s| {
        let n = s.strip_prefix("warm-sinkhorn-")?.parse().ok().filter(|n| *n >= 1)?;
        Some(Variant::Registered { spec: &WARM_SINKHORN, n })
    },
    build: |_, _, _, _, n| Ok(Box::new(super::WarmSinkhorn::new(n)?)),
};
''', before=True)
edit("src/attention/normalize/registry.rs", "];\n\n/// The registry entry that parses `name`.", ", &WARM_SINKHORN", before=True)
edit("python/probattn_tools/reference/formulas.py", '''    if variant.startswith("sinkhorn-"):
        return sinkhorn_weights(z, allowed, int(variant.split("-", 1)[1]))
''', '''    if variant.startswith("warm-sinkhorn-"):  # Sinkhorn-N at temperature 2
        return sinkhorn_weights(z / 2, allowed, int(variant.rsplit("-", 1)[1]))
''', before=True)
edit("python/probattn_tools/reference/formulas.py", '''    if variant.startswith("sinkhorn-"):
        log_p = z
''', '''    if variant.startswith("warm-sinkhorn-"):
        return log_weights("sinkhorn-" + variant.rsplit("-", 1)[1], z / 2, allowed)
''', before=True)
edit("docs/formulas.md", "- **Sinkhorn-N**: N such sweeps;",
     "- **warm-sinkhorn-N**: Sinkhorn-N of the scores halved, `z / 2` (temperature 2).\n", before=True)
edit("README.md", "| `sinkhorn-N` |", "| `warm-sinkhorn-N` | Sinkhorn-N at temperature 2 | this check |\n", before=True)
EOF
run git status --short

step "build"
run cargo build -q -p probattn-experiments --bin probattn
run cargo build -q -p probattn-py
probattn="$CARGO_TARGET_DIR/debug/probattn"
"$probattn" variants --json > python/probattn_tools/reference/variants.json
"$probattn" variants | grep -A3 "warm-sinkhorn" | tee -a "$log"
"$probattn" variants --json | "$python" -c '
import json, sys
entry = next(v for v in json.load(sys.stdin) if v["name"] == "warm-sinkhorn-N")
assert entry["family"] == "doubly-normalized" and not entry["causal_safe"] and not entry["stochastic"], entry
print("registry entry: family", entry["family"], "| causal-safe", entry["causal_safe"], "| route:", entry["memory_efficient"])
' 2>&1 | tee -a "$log"

step "the eager path against the formula (tests/parity.rs), and the registry's own tests"
run cargo test -q -p probattn --test parity
run cargo test -q -p probattn --lib registry

step "probattn attend: eager and memory-efficient on the parity cases"
cases="$scratch/cases"
mkdir -p "$cases"
(cd python && run "$python" -m probattn_tools.reference.parity cases --out "$cases" --seed 5 --count 2)
for c in "$cases"/case-00[01].safetensors; do
  run "$probattn" attend --variant warm-sinkhorn-2 --input "$c" --output "$scratch/eager.safetensors"
  run "$probattn" attend --variant warm-sinkhorn-2 --input "$c" --output "$scratch/tiled.safetensors" --memory-efficient --tile 3
  "$python" - "$scratch/eager.safetensors" "$scratch/tiled.safetensors" <<'EOF' 2>&1 | tee -a "$log"
import sys
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
for name in ("output", "received_mass"):
    d = (a[name].double() - b[name].double()).abs().max().item()
    tol = 1e-10 if a[name].dtype.is_floating_point and a[name].element_size() == 8 else 1e-5
    print(f"  {name}: eager and memory-efficient differ by {d:.1e} ({a[name].dtype})")
    assert d <= tol, name
EOF
done

step "a Transformer trains with it (encoder and cross-attention)"
run "$probattn" translate --quick --attention warm-sinkhorn-2 --max-updates 8 --out "$scratch/translate"
"$python" -c '
import json, sys
r = json.load(open(sys.argv[1]))
assert r["attention"] == "warm-sinkhorn-2", r["attention"]
run = r["runs"][0]
assert run["updates"] == 8, run["updates"]
print("  translate: attention warm-sinkhorn-2, %d updates, %.0f tokens/s, test BLEU %.2f (a smoke run)"
      % (run["updates"], run["tokens_per_second"], run["test_bleu"]))
' "$(find "$scratch/translate" -name results.json | head -1)" 2>&1 | tee -a "$log"

step "from Python: the functional API, eager and memory-efficient, against the formula"
pkg="$scratch/python/probattn"
mkdir -p "$pkg"
cp python/probattn/probattn/*.py "$pkg/"
cp "$CARGO_TARGET_DIR/debug/lib_native.so" "$pkg/_native.abi3.so"
PYTHONPATH="$scratch/python:$tree/python" run "$python" - <<'EOF'
import math

import torch

import probattn
from probattn_tools.reference import formulas

assert "warm-sinkhorn-N" in [v["name"] for v in probattn.variants()], "the package does not list it"
g = torch.Generator().manual_seed(3)
q, k, v = (torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
cot = torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64)
z = q.detach() @ k.detach().transpose(-2, -1) / math.sqrt(8)
allowed = torch.ones(2, 3, 7, 7, dtype=torch.bool)
qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
ref = formulas.normalize("warm-sinkhorn-2", qr @ kr.transpose(-2, -1) / math.sqrt(8), allowed) @ vr
ref_grads = torch.autograd.grad(ref, (qr, kr, vr), cot)
for me in (False, True):
    out = probattn.functional.scaled_dot_product_attention(q, k, v, variant="warm-sinkhorn-2", memory_efficient=me)
    grads = torch.autograd.grad(out, (q, k, v), cot)
    worst = max((a - b).abs().max().item() for a, b in zip((out, *grads), (ref, *ref_grads)))
    print(f"  python, {'memory-efficient' if me else 'eager'}: output and gradients within {worst:.1e} of the formula")
    assert worst <= 1e-10
EOF
PYTHONPATH="$scratch/python:$tree/python" run "$python" -m unittest discover -s python/probattn/tests -q

step "done: warm-sinkhorn-N added through the four documented places, run on every path"
