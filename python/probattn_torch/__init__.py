"""probattn's attention variants for PyTorch users: a drop-in for `torch.nn.MultiheadAttention`
with `variant="softmax" | "dnas" | "hnas" | "sinkhorn-N"`, scriptable with `torch.jit.script`, so a
model trained in PyTorch with DNAS or HNAS exports as TorchScript and runs in probattn
(`probattn compare --native mha --variant dnas` checks such an export against the native module).

    import sys; sys.path.insert(0, "python")
    from probattn_torch import MultiheadAttention
    attn = MultiheadAttention(512, 8, variant="dnas", batch_first=True)
    out, weights = attn(x, x, x, key_padding_mask=pad)

The weights are computed by python/reference.py's normalizers (written from the papers'
formulas, and the reference the Rust library is tested against); the module adds the
projections, masks and dropout around them. Parameters carry nn.MultiheadAttention's names
(`in_proj_weight (3E, E)`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias`; HNAS adds
`hybrid_logit (H)`, u = sigmoid(logit) initialised at `hybrid_init_u`), so state dicts move
between the two and into probattn by name. The call is nn.MultiheadAttention's:
`forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
average_attn_weights=True)`, masks boolean with True = excluded (float additive masks are
refused), inputs `(L, N, E)` or, `batch_first`, `(N, L, E)`. Fully masked rows get zero weights.
Not supported: `add_bias_kv`, `add_zero_attn`, `kdim`/`vdim` other than `embed_dim`, unbatched
inputs, and the BAM variants (stochastic; the Rust library has them, this module not yet).
"""

import math
import os
import sys
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import dnas_weights, hnas_weights, sinkhorn_weights, softmax_weights  # noqa: E402

__all__ = ["MultiheadAttention"]


class MultiheadAttention(nn.Module):
    __constants__ = ["embed_dim", "num_heads", "head_dim", "batch_first", "variant", "sinkhorn_iterations", "dropout"]

    def __init__(self, embed_dim: int, num_heads: int, variant: str = "softmax", dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, hybrid_init_u: float = 0.5, device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"num_heads {num_heads} does not divide embed_dim {embed_dim}")
        self.sinkhorn_iterations = 0
        if variant.startswith("sinkhorn-"):
            self.sinkhorn_iterations = int(variant.split("-", 1)[1])
            if self.sinkhorn_iterations < 1:
                raise ValueError(f"{variant}: Sinkhorn needs at least one iteration")
            variant = "sinkhorn"
        elif variant.startswith("bam"):
            raise NotImplementedError(f"{variant}: the BAM variants are in the Rust library (probattn) only, not yet here")
        elif variant not in ("softmax", "dnas", "hnas"):
            raise ValueError(f"unknown variant {variant!r} (softmax, dnas, hnas, sinkhorn-N)")
        if not 0.0 < hybrid_init_u < 1.0:
            raise ValueError("hybrid_init_u must lie in (0, 1)")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.variant, self.dropout, self.batch_first = variant, dropout, batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if variant == "hnas":
            logit = math.log(hybrid_init_u / (1.0 - hybrid_init_u))
            self.hybrid_logit = nn.Parameter(torch.full((num_heads,), logit, **factory))
        else:
            self.register_parameter("hybrid_logit", None)
        # nn.MultiheadAttention's initialisation.
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None,
                average_attn_weights: bool = True) -> Tuple[Tensor, Optional[Tensor]]:
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError("probattn_torch.MultiheadAttention takes batched 3-D query, key and value")
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, s_q, e = query.shape
        s_k = key.shape[1]
        h, d = self.num_heads, self.head_dim
        w_q, w_k, w_v = self.in_proj_weight.split(e, dim=0)
        b_q: Optional[Tensor] = None
        b_k: Optional[Tensor] = None
        b_v: Optional[Tensor] = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.split(e, dim=0)
        q = nn.functional.linear(query, w_q, b_q).reshape(batch, s_q, h, d).transpose(1, 2)
        k = nn.functional.linear(key, w_k, b_k).reshape(batch, s_k, h, d).transpose(1, 2)
        v = nn.functional.linear(value, w_v, b_v).reshape(batch, s_k, h, d).transpose(1, 2)

        allowed = torch.ones(batch, h, s_q, s_k, dtype=torch.bool, device=query.device)
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool:
                raise ValueError("key_padding_mask must be boolean (True = excluded)")
            allowed = allowed & ~key_padding_mask[:, None, None, :]
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise ValueError("attn_mask must be boolean (True = excluded); additive float masks are not supported")
            if attn_mask.dim() == 2:
                allowed = allowed & ~attn_mask[None, None, :, :]
            else:
                allowed = allowed & ~attn_mask.reshape(batch, h, s_q, s_k)

        z = q @ k.transpose(-2, -1) / math.sqrt(d)
        if self.variant == "softmax":
            w = softmax_weights(z, allowed)
        elif self.variant == "dnas":
            w = dnas_weights(z, allowed)
        elif self.variant == "hnas":
            logit = self.hybrid_logit
            assert logit is not None
            w = hnas_weights(z, allowed, logit)
        else:
            w = sinkhorn_weights(z, allowed, self.sinkhorn_iterations)
        mixed = nn.functional.dropout(w, self.dropout, self.training) @ v
        out = self.out_proj(mixed.transpose(1, 2).reshape(batch, s_q, e))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, (w.mean(1) if average_attn_weights else w)
