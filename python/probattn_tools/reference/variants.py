"""The attention variants, as the library's registry lists them: `probattn variants --json`, saved
as python/probattn_tools/reference/variants.json (a test keeps the file equal to the binary's output), so that no script
keeps its own list of names.

    from probattn_tools.reference import variants
    variants.examples()                      # ['softmax', 'dnas', 'hnas', 'sinkhorn-3', 'bam-nokl', ...]
    variants.examples(family="bayesian")     # the BAM variants
"""

import functools
import json
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants.json")


def registry():
    """Every variant's entry: name, aliases, example, family, summary, source, causal_safe,
    stochastic, kl, noise, parameters, memory_efficient, benchmarked, settings. Read once."""
    return json.loads(_text())


@functools.lru_cache(maxsize=1)
def _text():
    with open(_PATH) as f:
        return f.read()


def examples(family=None):
    """Each variant's example instance (`sinkhorn-3` for `sinkhorn-N`), in the registry's order,
    optionally of one family (row-wise, doubly-normalized, hybrid, bayesian)."""
    return [v["example"] for v in registry() if family is None or v["family"] == family]


def benchmarked():
    """The example instances of `probattn bench`'s default set."""
    return [e["example"] for e in registry() if e["benchmarked"]]


def entry(name):
    """The entry of a variant name (`sinkhorn-5` is `sinkhorn-N`'s); None if the registry does not know it."""
    for e in registry():
        if name == e["name"] or name in e["aliases"]:
            return e
        if e["name"].endswith("-N") and name.startswith(e["name"][:-1]) and name[len(e["name"]) - 1:].isdigit():
            return e
    return None


@functools.lru_cache(maxsize=None)
def noise(name):
    """The noise a stochastic variant samples: "weibull" (a uniform draw) or "lognormal" (a
    normal one); None for a deterministic variant."""
    e = entry(name)
    return e["noise"] if e else None


def names():
    """The names as the command line spells them, for help texts: `softmax, dnas, ...`."""
    return ", ".join(e["name"] for e in registry())
