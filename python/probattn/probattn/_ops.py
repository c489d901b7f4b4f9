"""The memory-efficient path as `torch.library` custom operators, so that `torch.compile` traces a
`probattn.attention(..., memory_efficient=True)` call without a graph break (variants without
parameters or sampling: softmax, dnas, sinkhorn-N). The forward operator is the library's tiled
attention; the backward operator recomputes it under autograd and returns the library's
gradients (one more forward pass than the eager path, which keeps its own backward). Both have
fake implementations, so the compiler knows their shapes without running them."""

from typing import Optional

import torch

from . import _native


@torch.library.custom_op("probattn::memory_efficient_attention", mutates_args=())
def memory_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, tile: int,
                               attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                               causal: bool) -> torch.Tensor:
    out, _, _, _ = _native.attention(q, k, v, variant, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                     causal=causal, tile=tile)
    return out.contiguous()


@memory_efficient_attention.register_fake
def _(q, k, v, variant, tile, attn_mask, key_padding_mask, causal):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@torch.library.custom_op("probattn::memory_efficient_attention_backward", mutates_args=())
def memory_efficient_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str,
                                        tile: int, attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                                        causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, _, _, _ = _native.attention(q, k, v, variant, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                         causal=causal, tile=tile)
        return tuple(g.contiguous() for g in torch.autograd.grad(out, (q, k, v), grad))


@memory_efficient_attention_backward.register_fake
def _(grad, q, k, v, variant, tile, attn_mask, key_padding_mask, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, variant, tile, attn_mask, key_padding_mask, causal = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_padding_mask)
    ctx.options = (variant, tile, causal)


def _backward(ctx, grad):
    q, k, v, attn_mask, key_padding_mask = ctx.saved_tensors
    variant, tile, causal = ctx.options
    gq, gk, gv = memory_efficient_attention_backward(grad, q, k, v, variant, tile, attn_mask, key_padding_mask, causal)
    return gq, gk, gv, None, None, None, None, None


memory_efficient_attention.register_autograd(_backward, setup_context=_setup_context)

# Under torch.autocast the operator is a lower-precision one, as scaled_dot_product_attention is:
# its floating inputs arrive in bfloat16 (the one lower precision the memory-efficient path runs
# in), in eager and compiled code alike, so a compiled call returns what the eager call does.
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("probattn::memory_efficient_attention", _device, torch.bfloat16)


def traceable(variant):
    """Whether `variant` runs through the custom operators: no parameters, no sampling."""
    return variant in ("softmax", "unas", "dnas") or variant.startswith("sinkhorn-")
