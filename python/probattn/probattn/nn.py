"""`probattn.nn.MultiheadAttention`: `torch.nn.MultiheadAttention`'s call and parameter names,
with any probattn variant, computed by the Rust library's multi-head module (projections, masks,
dropout, the normalizer and the memory-efficient path)."""

import json

import torch

from . import _BAM_SETTINGS, _mask, _native, _ops, _seed, _tile

__all__ = ["MultiheadAttention"]


class _Holder(torch.nn.Module):
    """An empty module holding parameters under a dotted name (`prior.f1.weight`)."""


class MultiheadAttention(torch.nn.Module):
    """A drop-in for `torch.nn.MultiheadAttention` with `variant=` any name of
    `probattn.variants()`.

    Parameters carry nn.MultiheadAttention's names (`in_proj_weight (3E, E)`, `in_proj_bias`,
    `out_proj.weight`, `out_proj.bias`; `q_proj_weight`, `k_proj_weight`, `v_proj_weight` when
    kdim or vdim differ from E), so state dicts move between this module, nn.MultiheadAttention
    and probattn's Rust models. HNAS adds `hybrid_logit (H,)`; bam-wc and bam-lc add the
    contextual prior `prior.f1.weight (H, hidden, d)`, `prior.f1.bias`, `prior.f2.weight`,
    `prior.f2.bias`. They are initialised as the Rust module initialises them (as PyTorch does
    for the projections), from libtorch's generator, which `torch.manual_seed` sets.

    After a forward pass in training mode, `self.kl` holds BAM's KL term (a scalar to add to the
    loss with its weight), else None.

    memory_efficient: the tiled path (`tile` queries at a time), which keeps nothing
    `(S_q, S_k)` for the backward pass; it forms no weights, so call it with
    `need_weights=False`, and attention dropout must be 0.
    hybrid_init_u: HNAS's initial mixing weight u. bam: BAM's settings as a dict (k, sigma,
    prior_alpha, prior_beta, prior_mu, prior_sigma, prior_hidden, base).
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None,
                 vdim=None, batch_first=False, device=None, dtype=None, *, variant="softmax", memory_efficient=False,
                 tile=None, hybrid_init_u=0.5, bam=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:  # as nn.MultiheadAttention says it
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads} instead")
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported by probattn.nn.MultiheadAttention")
        if tile is not None and not memory_efficient:
            raise ValueError("tile applies to the memory-efficient path: pass memory_efficient=True with it")
        bam = dict(bam or {})
        unknown = sorted(set(bam) - set(_BAM_SETTINGS) - {"base"})
        if unknown:
            raise ValueError(f"unknown bam settings {unknown} (known: {sorted(set(_BAM_SETTINGS) | {'base'})})")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.dropout, self.batch_first, self.variant = dropout, batch_first, variant
        self.head_dim = embed_dim // num_heads
        self.tile = _tile(tile) if memory_efficient else None
        self._settings = {name: float(bam[name]) for name in _BAM_SETTINGS if name in bam}
        self._settings["hybrid_init_u"] = float(hybrid_init_u)
        self._base = bam.get("base")
        self._bias = bias
        self.kl = None
        initial = _native.initial_parameters(embed_dim, num_heads, variant, kdim=kdim, vdim=vdim, bias=bias,
                                             settings=self._settings, bam_base=self._base)
        factory = {"device": device, "dtype": dtype}
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if self._qkv_same_embed_dim:
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
        if not bias:
            self.register_parameter("in_proj_bias", None)
        with torch.no_grad():
            for name, value in initial:
                *path, leaf = name.split(".")
                owner = self
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, _Holder())
                    owner = getattr(owner, part)
                value = value.to(device=device, dtype=dtype if dtype is not None else torch.get_default_dtype())
                if isinstance(getattr(owner, leaf, None), torch.nn.Parameter):
                    getattr(owner, leaf).copy_(value)
                else:
                    owner.register_parameter(leaf, torch.nn.Parameter(value))
        # The configuration the compiled form's custom operator takes (probattn/_ops.py), without and
        # with the causal mask, outside autocast and under each autocast dtype it takes, naming the
        # parameters in the order forward passes them.
        config = {"embed_dim": embed_dim, "num_heads": num_heads, "variant": variant, "bias": bias, "tile": self.tile,
                  "settings": self._settings, "bam_base": self._base, "names": [name for name, _ in self.named_parameters()],
                  **({"kdim": None, "vdim": None} if self._qkv_same_embed_dim else {"kdim": self.kdim, "vdim": self.vdim})}
        self._op_config = {(causal, autocast): json.dumps({**config, "causal": causal, "autocast": autocast})
                           for causal in (False, True) for autocast in (None, "bfloat16", "float16")}

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, noise=None, seed=None):
        """nn.MultiheadAttention's forward: `(L, N, E)` inputs (`(N, L, E)` with batch_first, or
        unbatched `(L, E)`), returns `(output, weights)`; weights are averaged over heads
        (`(N, L, S)`) unless `average_attn_weights=False` (`(N, H, L, S)`), None without
        need_weights. `noise`: a fixed BAM draw `(N, H, L, S)`. `seed`: the key of the
        memory-efficient path's BAM draws in training (None: libtorch's generator); under
        `torch.compile` a seeded or given draw compiles without a graph break."""
        if self.tile is not None and need_weights:
            raise ValueError("the memory-efficient path forms no weights: call it with need_weights=False")
        seed = _seed(seed)
        if seed is not None and self.tile is None:
            raise ValueError("seed keys the memory-efficient path's BAM draws; the eager module draws from libtorch's "
                             "generator (torch.manual_seed) or takes noise=: construct it with memory_efficient=True")
        unbatched = query.dim() == 2
        # An input passed as several arguments stays one tensor (one view of it) from here on: the
        # library casts a shared input once under autocast, and the compiled form passes it once.
        key_is_query, value_is_key = key is query, value is key
        if unbatched or not self.batch_first:
            # Views, not copies: the Rust module projects a transposed input in its own layout.
            layout = (lambda t: t.unsqueeze(0)) if unbatched else (lambda t: t.transpose(0, 1))
            query = layout(query)
            key = query if key_is_query else layout(key)
            value = key if value_is_key else layout(value)
            if unbatched and key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        attn_mask = _mask("attn_mask", attn_mask)
        if attn_mask is not None and attn_mask.dim() == 3:
            # nn.MultiheadAttention's (N * H, L, S) per-head masks, as (N, H, L, S).
            attn_mask = attn_mask.view(query.shape[0], self.num_heads, *attn_mask.shape[1:])
        key_padding_mask = _mask("key_padding_mask", key_padding_mask)
        # BAM too, where its draws replay.
        takes = _ops.traceable(self.variant) or (_ops.replayable_bam(self.variant)
                                                 and _ops.draws_replay(self.training, noise, seed))
        compiled = (torch.compiler.is_compiling() and not need_weights and takes
                    and not (self.training and self.dropout > 0))
        autocast = _ops.autocast_name(query.device.type) if compiled else None
        if compiled and autocast != "other":
            # Under torch.compile: the custom operator, which the compiler traces without a graph break.
            output, kl = _ops.multi_head_attention(
                query, None if key_is_query else key, None if value_is_key else value, list(self.parameters()),
                self._op_config[(bool(is_causal), autocast)], key_padding_mask, attn_mask, self.training, noise, seed)
            weights, kl = None, kl if kl.dim() == 0 else None
        else:
            params = {name: p for name, p in self.named_parameters()}
            output, weights, kl = _native.multi_head_attention(
                query, key, value, self.embed_dim, self.num_heads, self.variant, params,
                kdim=None if self._qkv_same_embed_dim else self.kdim, vdim=None if self._qkv_same_embed_dim else self.vdim,
                bias=self._bias, dropout=float(self.dropout), tile=self.tile, key_padding_mask=key_padding_mask,
                attn_mask=attn_mask, causal=bool(is_causal), training=self.training, need_weights=bool(need_weights),
                noise=noise, seed=seed, settings=self._settings, bam_base=self._base, key_is_query=key_is_query,
                value_is_key=value_is_key,
            )
        self.kl = kl
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        if unbatched:
            output = output.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            output = output.transpose(0, 1)
        return output, weights
