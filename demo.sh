#!/usr/bin/env bash
# Checks the install (probattn doctor), then runs the four deterministic normalizers (softmax,
# dnas, hnas, sinkhorn-3) on one padded batch and checks each result against the independent
# PyTorch reference (`python -m probattn_tools.reference.parity compare`). Outputs go to runs/attend-demo/.
# Run ./download_libtorch.sh first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
config=.cargo/config.toml
[ -f "$config" ] || { echo "demo.sh: no $config: run ./download_libtorch.sh first" >&2; exit 1; }
python="$(sed -n 's/^PROBATTN_PYTHON = "\(.*\)"$/\1/p' "$config")"

cargo build --release --bin probattn
bin=target/release/probattn
"$bin" doctor

out=runs/attend-demo
mkdir -p "$out"
PYTHONPATH=python "$python" -m probattn_tools.reference.parity demo-input --output "$out/input.safetensors"
for variant in softmax dnas hnas sinkhorn-3; do
  echo
  "$bin" attend --variant "$variant" --input "$out/input.safetensors" --output "$out/$variant.safetensors"
  PYTHONPATH=python "$python" -m probattn_tools.reference.parity compare --variant "$variant" --input "$out/input.safetensors" --output "$out/$variant.safetensors"
done
