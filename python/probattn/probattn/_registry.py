"""The variant registry as the extension states it (`probattn variants`), read once at import:
the package resolves variant names here and lists none itself. A call resolves its variant once:
`spec` keeps the extension's resolved form of each variant and settings it has seen."""

import functools
import json

import torch

from . import _native

ENTRIES = json.loads(_native.registry_json())


def entry(variant):
    """The registry entry of a variant name: its name, an alias, or a numbered form of a `-N`
    entry (sinkhorn-3 of sinkhorn-N); None for a name the registry does not know (or not a name)."""
    return _entry(variant) if isinstance(variant, str) else None


@functools.lru_cache(maxsize=None)
def _entry(variant):
    for e in ENTRIES:
        if variant == e["name"] or variant in e["aliases"]:
            return e
        if e["name"].endswith("-N"):
            prefix = e["name"][:-1]
            if variant.startswith(prefix) and variant[len(prefix):].isdigit():
                return e
    return None


@functools.lru_cache(maxsize=256)
def spec(variant, settings=(), base=None):
    """The extension's `Spec` of `variant` with `settings` (sorted `(name, value)` pairs) and BAM's
    `base`: the name parsed, the settings read and the parameter names listed once, for every call
    that passes them. An unknown name or setting raises ValueError (and is not remembered).

    The extension lists a variant's parameter names by building it once per variant and base,
    which draws a contextual prior's initial values from libtorch's generator: that build runs on
    a copy of the generator's state, so that a seeded call draws the same noise whether or not it
    is the first to name its variant."""
    if not isinstance(variant, str):
        raise TypeError(f"variant must be a name (str), got {type(variant).__name__}")
    return _resolved(variant, settings, base)


@torch.compiler.disable  # run as it is, under torch.compile too: a graph holds no generator state
def _resolved(variant, settings, base):
    with torch.random.fork_rng(devices=[]):
        return _native.Spec(variant, dict(settings), base)
