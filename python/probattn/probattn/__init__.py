"""probattn for PyTorch: doubly-normalized (DNAS, HNAS, Sinkhorn), Bayesian (BAM) and
memory-efficient attention from the Rust library, on `torch.Tensor`s, with autograd.

    import torch, probattn
    q, k, v = (torch.randn(2, 8, 128, 64, requires_grad=True) for _ in range(3))
    out = probattn.attention(q, k, v, variant="dnas")                 # (2, 8, 128, 64)
    out, info = probattn.attention(q, k, v, variant="dnas", memory_efficient=True, return_info=True)
    out.sum().backward()

Every computation is the Rust library's (`probattn::attend`, its normalizers, BAM and the
memory-efficient tiles); this package converts arguments and holds parameters. See
docs/python.md.
"""

import contextlib
import json
import operator
from typing import NamedTuple, Optional

import torch

# The torch this package is built against: the extension shares libtorch with the torch already
# imported, so any other version is refused here, before the extension is loaded, by name.
REQUIRED_TORCH = "2.11.0"

if torch.__version__.split("+")[0] != REQUIRED_TORCH:
    raise ImportError(
        f"probattn was built against torch {REQUIRED_TORCH}, but this interpreter has torch {torch.__version__}: "
        f"install torch=={REQUIRED_TORCH}, or build probattn against your torch (docs/python.md, 'Which torch')"
    )

from . import _native, _ops, _registry  # noqa: E402  (after the version check, on purpose)

__all__ = ["attention", "attention_with_info", "scaled_dot_product_attention", "functional", "attention_backend",
           "attention_routes", "AttentionInfo", "variants", "DEFAULT_TILE", "REQUIRED_TORCH"]

DEFAULT_TILE = 256
"""Queries per tile on the memory-efficient path, as `probattn --memory-efficient` uses."""

_BAM_SETTINGS = ("k", "sigma", "prior_alpha", "prior_beta", "prior_mu", "prior_sigma", "prior_hidden")


class AttentionInfo(NamedTuple):
    """What `attention_with_info` returns beside the output.

    received_mass: `(..., H, S)`, the weight each key receives, sum_i pi_ij (not differentiable).
    kl: BAM's KL term (a scalar tensor, differentiable) when the variant has one and samples
        (`training=True`), else None.
    weights: `(..., H, L, S)` on the eager path, None on the memory-efficient one (it never
        forms them).
    """

    received_mass: torch.Tensor
    kl: Optional[torch.Tensor]
    weights: Optional[torch.Tensor]


@contextlib.contextmanager
def attention_backend(backend: str):
    """Runs every probattn attention call inside the block on `backend`, as
    `torch.nn.attention.sdpa_kernel` does for SDPA: "auto" (the library's choice), "eager" (the
    weights formed), "tiles" (the variant's plan tile by tile, `DEFAULT_TILE` queries a tile unless
    the call sets one) or "fused" (one kernel that never forms the weights: softmax's own, else the
    variant's plan through the fused CPU kernel on the CPU and the embedded Triton kernels on CUDA,
    docs/kernels.md). A call the backend cannot
    serve (weights asked for from tiles or fused, a mask the fused kernel does not take) raises
    ValueError saying why; nothing falls back silently. The setting is the process's, restored on
    leaving the block.

        with probattn.attention_backend("tiles"):
            out = probattn.attention(q, k, v, variant="dnas")
    """
    previous = _native.set_attention_backend(backend)
    try:
        yield
    finally:
        _native.set_attention_backend(previous)


def attention_routes(reset: bool = False):
    """How many attention calls each route served ("eager", "kernel", "tiles", "fused-cpu", "fused-cuda") since
    the last reset, as a dict; `reset=True` starts the counts again after reading them."""
    return _native.attention_routes(reset)


def variants():
    """The variant registry, as `probattn variants --json` prints it: a list of dicts (name,
    aliases, example, family, summary, source, causal_safe, stochastic, kl, memory_efficient,
    benchmarked, settings)."""
    return json.loads(_native.registry_json())


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _integer(name, value, low, high, needs):
    """`value` as an integer in [low, high): a TypeError naming `name` for a value that is not an
    integer (a bool included), a ValueError saying what it `needs` for one outside the range."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = operator.index(value)
    if not low <= value < high:
        raise ValueError(f"{name} must be {needs}, got {value}")
    return value


def _tile(tile):
    """`tile` as the memory-efficient path takes it: the default for None, else a positive integer
    (queries a tile; past the query length it is one tile)."""
    return DEFAULT_TILE if tile is None else _integer("tile", tile, 1, 2**63, "at least 1 (queries a tile)")


def _seed(seed):
    """`seed` as the library takes it: None, or an integer in [0, 2**64), the 64-bit key of BAM's
    counter-based draws."""
    needs = "an integer in [0, 2**64), the key of BAM's draws"
    return None if seed is None else _integer("seed", seed, 0, 2**64, needs)


def _mask(name, m):
    """A boolean mask in nn.MultiheadAttention's convention (True = excluded), checked: what
    `probattn.nn.MultiheadAttention` takes as PyTorch's module takes it."""
    if m is None:
        return None
    _tensor(name, m)
    if m.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean tensor with True = excluded, got dtype {m.dtype}")
    return m


def _bam_arguments(bam):
    """(settings, base, params, noise) from the `bam=` dict: the settings as sorted `(name, value)`
    pairs (`_registry.spec`'s key), the prior's parameters by name (None for none)."""
    if not isinstance(bam, dict):
        raise TypeError(f"bam must be a dict of settings, got {type(bam).__name__}")
    known = set(_BAM_SETTINGS) | {"base", "prior", "noise"}
    unknown = sorted(set(bam) - known)
    if unknown:
        raise ValueError(f"unknown bam settings {unknown} (known: {sorted(known)})")
    settings = tuple((name, float(bam[name])) for name in _BAM_SETTINGS if name in bam)
    params = None
    prior = bam.get("prior")
    if prior is not None:
        items = prior.named_parameters() if isinstance(prior, torch.nn.Module) else prior.items()
        params = {"prior." + name: _tensor(f"bam['prior']['{name}']", t) for name, t in items}
    noise = bam.get("noise")
    if noise is not None:
        _tensor("bam['noise']", noise)
    return tuple(sorted(settings)), bam.get("base"), params, noise


def _attention(query, key, value, variant, attn_mask, bias, is_causal, scale, enable_gqa, memory_efficient, tile,
               training, dropout_p, seed, hybrid_logit, bam, return_info):
    """The library's attention on heads-first 4-D tensors, its masks in its own convention
    (`attn_mask`: boolean, True = excluded; `bias`: added to the scores), for
    `probattn.functional`, which converts PyTorch's arguments into these (the flags as bools,
    `scale` and `dropout_p` as floats) and passes them in this order (a call pays no keyword
    matching). Returns `(output, AttentionInfo or None)`. The extension checks the tensors
    (floating, one dtype, 4-D) and names what is wrong."""
    if type(variant) is not str:
        raise TypeError(f"variant must be a name (str), got {type(variant).__name__}")
    settings, base, params, noise = ((), None, None, None) if bam is None else _bam_arguments(bam)
    if hybrid_logit is not None:
        params = dict(params or {}, hybrid_logit=_tensor("hybrid_logit", hybrid_logit))
    if memory_efficient:
        tile = _tile(tile)
    elif tile is not None:
        raise ValueError("tile applies to the memory-efficient path: pass memory_efficient=True with it")
    seed = _seed(seed)
    if seed is not None and tile is None:
        raise ValueError("seed keys the memory-efficient path's BAM draws; the eager path draws from libtorch's "
                         "generator (torch.manual_seed) or takes bam={'noise': ...}: pass memory_efficient=True with it")
    if dropout_p == 0 and torch.compiler.is_compiling():
        # Under torch.compile: a custom operator, which the compiler traces without a graph break.
        if not return_info and _ops.traceable(variant) and bam is None:
            out = _ops.attention(query, key, value, variant, tile, attn_mask, None, is_causal, hybrid_logit,
                                 bias, scale, enable_gqa)
            return out, None
        # BAM where its draws can be replayed (none in evaluation, a given one, or the memory-efficient
        # path's seeded ones), and return_info on the memory-efficient path, which forms no weights:
        # the operator that returns the received mass and the KL term too.
        takes = ((_ops.replayable_bam(variant) and _ops.draws_replay(training, noise, seed))
                 or (_ops.traceable(variant) and bam is None))
        if takes and bias is None and (tile is not None or not return_info):
            autocast = _ops.autocast_name(query.device.type)
            if autocast != "other":
                params = params or {}
                config = _ops.info_config(variant, settings, base, training, tuple(params), autocast, scale, enable_gqa)
                output, mass, kl = _ops.attention_with_info(query, key, value, config, tile, attn_mask, None,
                                                            is_causal, list(params.values()), noise, seed)
                info = AttentionInfo(received_mass=mass, kl=kl if kl.dim() == 0 else None, weights=None)
                return output, info if return_info else None
    output, weights, mass, kl = _native.attention(
        _registry.spec(variant, settings, base), query, key, value, None, attn_mask, bias, is_causal, scale,
        enable_gqa, tile, training, dropout_p, seed, noise, return_info and not memory_efficient, return_info, params)
    if not return_info:
        return output, None
    if mass is None and weights is not None:
        mass = weights.detach().sum(-2)
    return output, AttentionInfo(received_mass=mass, kl=kl, weights=weights)


from . import functional  # noqa: E402  (after _attention, which it calls)
from .functional import attention_with_info, scaled_dot_product_attention  # noqa: E402

attention = scaled_dot_product_attention
"""`probattn.attention` is `probattn.functional.scaled_dot_product_attention`: PyTorch's arguments
and semantics, with `variant=`."""

from . import nn  # noqa: E402,F401  (probattn.nn.MultiheadAttention)
from . import repulsive  # noqa: E402,F401  (probattn.repulsive.attach)
