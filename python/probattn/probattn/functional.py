"""`torch.nn.functional.scaled_dot_product_attention`, with probattn's variants.

    import torch.nn.functional as F
    from probattn.functional import scaled_dot_product_attention as sdpa

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=None)
    out = sdpa(q, k, v, attn_mask=mask, is_causal=False, scale=None)                   # the same numbers
    out = sdpa(q, k, v, attn_mask=mask, variant="dnas")                                # doubly normalized

The arguments mean what they mean to PyTorch's function: `query (..., H_q, L, E)`, `key (..., H_k,
S, E)`, `value (..., H_k, S, E_v)` with any leading batch dimensions (broadcast against each
other); a boolean `attn_mask` whose True marks an entry that *takes part*, or a float one added to
the scores (`-inf` excludes an entry), broadcast to `(..., H_q, L, S)`; `is_causal` with the lower
triangle aligned to the top left when L != S; `scale` defaulting to `1/sqrt(E)`; `enable_gqa` for
fewer key/value heads than query heads (read by index, never repeated); `dropout_p` applied to the
weights whenever it is above 0. A query with no key left gets a zero output, as PyTorch's gives.
For the other variants the same arguments mean the same thing: the mask is added to the scores
before any normalization (docs/formulas.md).

Where PyTorch's function is undefined, this one says so: `attn_mask` with `is_causal` (documented
by PyTorch as an error; its CPU kernels in torch 2.11 silently combine them) is a ValueError.
"""

import math

import torch

from . import AttentionInfo, _attention, _native, _registry

__all__ = ["scaled_dot_product_attention", "attention_with_info"]

# The specs of the variants called without settings, by name: a dict lookup per call.
_SPECS = {}


def _broadcast(*shapes):
    """The broadcast of `shapes` (tuples) by PyTorch's rule, or None where they do not broadcast:
    `torch.broadcast_shapes`' answer at a tenth of its cost, which a call pays on every step."""
    out = []
    for i in range(1, max(map(len, shapes)) + 1):
        size = 1
        for shape in shapes:
            if len(shape) >= i and shape[-i] != 1:
                if size != 1 and size != shape[-i]:
                    return None
                size = shape[-i]
        out.append(size)
    return tuple(reversed(out))


def _as_heads_first(name, t):
    """`t` as `(lead, heads, length, dim)`: the leading dimensions, the heads (1 for a 2-D tensor)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected (..., L, E), at least 2 dimensions")
    if t.dim() == 2:
        return (), 1, t
    return tuple(t.shape[:-3]), t.shape[-3], t


def _unexpanded(t):
    """`t` with every dimension it repeats through a zero stride (an `expand`ed view) narrowed to
    size 1: the same values under broadcasting, so that inverting a mask forms one copy of what
    repeats, and a padding mask alike for every query (transformers' for a padded batch) reaches
    the library as one, which runs it as key padding."""
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


def _mask(attn_mask, query, target):
    """The library's masks from SDPA's `attn_mask`: (excluded, bias), each broadcastable to the
    4-D `(B, H, L, S)` call or None; `target` is the full SDPA shape `(..., H, L, S)`."""
    if attn_mask is None:
        return None, None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be boolean (True = takes part) or floating-point (added to the scores), "
                        f"got dtype {attn_mask.dtype}")
    if _broadcast(tuple(attn_mask.shape), target) != target:
        raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}, which does not broadcast to the scores' "
                         f"{tuple(target)}")
    if attn_mask.dim() > 3 and len(target) != 4:  # batch dimensions other than one: flattened as the inputs'
        attn_mask = attn_mask.expand(target).reshape((-1,) + tuple(target[-3:]))
    if attn_mask.dtype == torch.bool:
        return ~_unexpanded(attn_mask), None
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, the query on {query.device}")
    return None, attn_mask


def _plain(query, key, value, enable_gqa):
    """Whether the inputs are already the library's call: 4-D `(B, H, L, E)` tensors with one batch
    size, matching sizes and equal heads (or, under `enable_gqa`, key/value heads dividing the
    query's). The common case skips the general path's reshaping; any other falls to it, which
    also names what is wrong. (Sizes are read once each: this runs at every call.)"""
    try:
        qs, ks, vs = query.shape, key.shape, value.shape
    except AttributeError:
        return False
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return False
    return (qs[0] == ks[0] == vs[0] and ks[1] == vs[1] and ks[2] == vs[2] and qs[3] == ks[3]
            and (qs[1] == ks[1] or (enable_gqa and ks[1] > 0 and qs[1] % ks[1] == 0))
            and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor))


def _flattened(query, key, value, enable_gqa):
    """The inputs as the library's 4-D call `(B, H, L, E)`, the leading dimensions broadcast and
    flattened into B: `(q, k, v, lead, heads, kv_heads)`."""
    (lq, hq, q), (lk, hk, k), (lv, hv, v) = (_as_heads_first(n, t) for n, t in
                                             (("query", query), ("key", key), ("value", value)))
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must have the same embedding size E")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same length S")
    lead = _broadcast(lq, lk, lv)
    if lead is None:
        raise ValueError(f"the batch dimensions of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not broadcast")
    if enable_gqa:
        if hk != hv:
            raise ValueError(f"key and value must have the same number of heads, got {hk} and {hv}")
        if hq % hk != 0:
            raise ValueError(f"enable_gqa: the key/value heads ({hk}) must divide the query heads ({hq})")
        heads, kv_heads = hq, hk
    else:
        heads = _broadcast((hq,), (hk,), (hv,))
        if heads is None:
            raise ValueError(f"query has {hq} heads, key {hk} and value {hv}: they must be equal (or 1), or pass "
                             f"enable_gqa=True for grouped-query attention")
        heads = kv_heads = heads[0]
    L, S, E, Ev = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = math.prod(lead)

    def four(t, h, length, width):  # (B, h, length, width): a view unless batch dimensions broadcast
        return t.expand(lead + (h, length, width)).reshape(batch, h, length, width)

    return four(q, heads, L, E), four(k, kv_heads, S, E), four(v, kv_heads, S, Ev), lead, heads, kv_heads


def _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant, training, memory_efficient,
          tile, seed, hybrid_logit, bam, info, joined=False):
    """The general call; `joined`: `attn_mask` and `is_causal` together mean both, the causal
    pattern and the mask (for `probattn.hf`, which knows when a model's mask is a causal one joined
    with key padding; the public functions refuse the pair, as PyTorch documents)."""
    if _plain(query, key, value, enable_gqa):
        q4, k4, v4 = query, key, value
        shape = query.shape
        lead, heads, kv_heads, L = (shape[0],), shape[1], key.shape[1], shape[2]
        flattened = False
    else:
        q4, k4, v4, lead, heads, kv_heads = _flattened(query, key, value, enable_gqa)
        L = q4.shape[2]
        flattened = True
    if attn_mask is None:
        excluded = bias = None
    else:
        if is_causal and not joined:
            raise ValueError("attn_mask and is_causal are both set: PyTorch documents this as an error (pass the causal "
                             "mask inside attn_mask instead)")
        excluded, bias = _mask(attn_mask, query, lead + (heads, L, k4.shape[2]))
    if dropout_p != 0.0 and (not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if scale is not None:
        if not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        scale = float(scale)
    output, extra = _attention(q4, k4, v4, variant, excluded, bias, bool(is_causal), scale,
                               heads != kv_heads and bool(enable_gqa), memory_efficient, tile, bool(training),
                               float(dropout_p), seed, hybrid_logit, bam, info)
    if not flattened and not info:
        return output
    # PyTorch's layout: the broadcast batch dimensions and the heads, none for 2-D inputs.
    head_shape = lead + (heads,) if query.dim() > 2 else ()
    S, Ev = k4.shape[2], v4.shape[3]
    if output.dim() != len(head_shape) + 2:
        output = output.reshape(head_shape + (L, Ev))
    if not info:
        return output
    mass = extra.received_mass.reshape(head_shape + (S,)) if extra.received_mass is not None else None
    weights = extra.weights.reshape(head_shape + (L, S)) if extra.weights is not None else None
    return output, AttentionInfo(received_mass=mass, kl=extra.kl, weights=weights)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, variant="softmax", training=False, memory_efficient=False,
                                 tile=None, seed=None, hybrid_logit=None, bam=None):
    """PyTorch's `scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
    scale, enable_gqa)` (the module doc says what each means), with `variant="softmax"` its exact
    stand-in, and any variant of `probattn.variants()` by name.

    The keyword-only arguments are probattn's:
    variant: the attention variant (softmax, dnas, hnas, sinkhorn-N, bam-*).
    training: BAM samples its weights (otherwise it returns its mean, the base's weights).
    memory_efficient: the tiled path, which keeps nothing (L, S) for the backward pass (`tile`
        queries at a time, default `probattn.DEFAULT_TILE`); it has no dropout.
    seed: the key of the memory-efficient path's BAM draws.
    hybrid_logit: HNAS's `(H_q,)` gate logits, u = sigmoid(logit) (required for hnas).
    bam: BAM's settings, a dict (see `probattn.attention_with_info`'s documentation in
        docs/python.md: k, sigma, prior_*, base, prior, noise).

    Returns the output `(..., H_q, L, E_v)`.
    """
    if not (memory_efficient or bam is not None or hybrid_logit is not None or tile is not None or seed is not None
            or torch.compiler.is_compiling()):
        # The common call, whole in the extension; None where it is not that call.
        spec = _SPECS.get(variant) if type(variant) is str else None
        if spec is None and type(variant) is str and len(_SPECS) < 256:
            spec = _SPECS[variant] = _registry.spec(variant, (), None)
        if spec is not None:
            output = _native.sdpa(spec, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training)
            if output is not None:
                return output
    return _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant, training,
                 memory_efficient, tile, seed, hybrid_logit, bam, info=False)


def attention_with_info(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, *, variant="softmax", training=False, memory_efficient=False, tile=None,
                        seed=None, hybrid_logit=None, bam=None):
    """`scaled_dot_product_attention` with what the variant knows beside the output: returns
    `(output, AttentionInfo)`, whose `received_mass (..., H_q, S)` is the weight each key receives
    (not differentiable), `kl` BAM's KL term (a differentiable scalar) when it samples, else None,
    and `weights (..., H_q, L, S)` the attention weights on the eager path (None on the
    memory-efficient one, which never forms them)."""
    return _call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, variant, training,
                 memory_efficient, tile, seed, hybrid_logit, bam, info=True)
