"""probattn's PyTorch side: everything the Rust library and CLI are checked against or fed by.

Each subpackage is one role; every script runs as a module (`python -m probattn_tools.<role>.<name>
--help`), with the package importable because ./download_libtorch.sh installs it (editable) into the
project's virtualenv, or with `PYTHONPATH=python`:

- `reference`: the independent PyTorch implementations written from the formulas (`formulas`), the
  pure-PyTorch multi-head module (`mha`), the variant registry as the binary prints it
  (`variants`, `variants.json`), the parity cases (`parity`), and reference BLEU and VQA scoring.
- `data`: download, verify and convert the datasets (Planetoid, Multi30k, Sort-of-CLEVR / easy-VQA,
  the VQA detectors).
- `baselines`: the PyTorch models and timings each reproduction and benchmark compares against.
- `tables`: scripts that read run folders and print the README tables (and the GAT sweep).
- `export`: TorchScript and `.pt2` exports for `probattn compare` and the interop tests.
- `diagnostics`: one-off probes behind the VQA READMEs' analyses.
- `kernels`: the Triton kernels of the deterministic plans and their check against the formulas.
"""
