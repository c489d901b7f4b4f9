"""The attention variants, as the library's registry lists them: `probattn variants --json`, saved
as python/probattn_tools/reference/variants.json (a test keeps the file equal to the binary's output), so that no script
keeps its own list of names.

    from probattn_tools.reference import variants
    variants.examples()                      # ['softmax', 'dnas', 'hnas', 'sinkhorn-3', 'bam-nokl', ...]
    variants.examples(family="bayesian")     # the BAM variants
"""

import json
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants.json")


def registry():
    """Every variant's entry: name, aliases, example, family, summary, source, causal_safe,
    stochastic, kl, memory_efficient, benchmarked, settings."""
    with open(_PATH) as f:
        return json.load(f)


def examples(family=None):
    """Each variant's example instance (`sinkhorn-3` for `sinkhorn-N`), in the registry's order,
    optionally of one family (row-wise, doubly-normalized, hybrid, bayesian)."""
    return [v["example"] for v in registry() if family is None or v["family"] == family]
