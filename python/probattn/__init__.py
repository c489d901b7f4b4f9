"""The source folder of the probattn Python package, not the package: it is reached here through
`python/` on sys.path (the set-up's `probattn_tools.pth`), before the package is installed.
Importing it says how to install the package instead of returning an empty namespace."""

raise ImportError(
    "probattn is not installed: this is its source folder (python/probattn). Build and install the package with "
    "`scripts/build_wheel.sh --install` (a maturin wheel) or `pip install ./python/probattn`; see docs/python.md"
)
