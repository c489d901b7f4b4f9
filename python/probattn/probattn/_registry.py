"""The variant registry as the extension states it (`probattn variants`), read once at import:
the package resolves variant names here and lists none itself."""

import json

from . import _native

ENTRIES = json.loads(_native.registry_json())


def entry(variant):
    """The registry entry of a variant name: its name, an alias, or a numbered form of a `-N`
    entry (sinkhorn-3 of sinkhorn-N); None for a name the registry does not know."""
    for e in ENTRIES:
        if variant == e["name"] or variant in e["aliases"]:
            return e
        if e["name"].endswith("-N"):
            prefix = e["name"][:-1]
            if variant.startswith(prefix) and variant[len(prefix):].isdigit():
                return e
    return None
