"""`probattn.attention` as `torch.library` custom operators, so that `torch.compile` traces a call
without a graph break: the variants without sampling, on the eager path and the memory-efficient
one (softmax, dnas, sinkhorn-N, and hnas with its gate logits). The forward operator is the
library's attention; the backward operator recomputes it under autograd and returns the library's
gradients (one more forward pass than the uncompiled call, which keeps its own backward). Both have
fake implementations, so the compiler knows their shapes without running them."""

from typing import Optional

import torch

from . import _native, _registry


def _run(q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit):
    params = {} if hybrid_logit is None else {"hybrid_logit": hybrid_logit}
    out, _, _, _ = _native.attention(q, k, v, variant, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                     causal=causal, tile=tile, params=params)
    return out


@torch.library.custom_op("probattn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, tile: Optional[int],
              attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor], causal: bool,
              hybrid_logit: Optional[torch.Tensor]) -> torch.Tensor:
    """The attention output `(B, H, S_q, d_v)`; `tile` None is the eager path."""
    return _run(q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit).contiguous()


@attention.register_fake
def _(q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _differentiable(q, k, v, hybrid_logit):
    """The inputs that receive gradients: q, k, v, and the gate logits when given."""
    return (q, k, v) if hybrid_logit is None else (q, k, v, hybrid_logit)


def _autograd_dispatch():
    """A custom operator's implementation runs below autograd (its dispatch keys excluded), where
    libtorch records no graph: only the memory-efficient path's own autograd functions would. The
    recomputation takes them back for its duration, the rest of the thread's state unchanged."""
    K = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (K.AutogradFunctionality, K.AutogradOther, K.AutogradNestedTensor, K.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("probattn::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str,
                       tile: Optional[int], attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                       causal: bool, hybrid_logit: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients in q, k, v, and in hybrid_logit when it is given."""
    with torch.enable_grad(), _autograd_dispatch():
        inputs = [t.detach().requires_grad_() for t in _differentiable(q, k, v, hybrid_logit)]
        out = _run(*inputs[:3], variant, tile, attn_mask, key_padding_mask, causal, inputs[3] if len(inputs) == 4 else None)
        return [g.contiguous() for g in torch.autograd.grad(out, inputs, grad)]


@attention_backward.register_fake
def _(grad, q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit):
    return [torch.empty_like(t) for t in _differentiable(q, k, v, hybrid_logit)]


def _setup_context(ctx, inputs, output):
    q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_padding_mask, hybrid_logit)
    ctx.options = (variant, tile, causal)


def _backward(ctx, grad):
    q, k, v, attn_mask, key_padding_mask, hybrid_logit = ctx.saved_tensors
    variant, tile, causal = ctx.options
    grads = attention_backward(grad, q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit)
    return *grads[:3], None, None, None, None, None, grads[3] if hybrid_logit is not None else None


attention.register_autograd(_backward, setup_context=_setup_context)

# Under torch.autocast the operator is a lower-precision one, as scaled_dot_product_attention is:
# its floating q, k and v arrive in bfloat16, in eager and compiled code alike, so a compiled call
# returns what the uncompiled one does. HNAS's gate logits keep their dtype: the uncompiled call
# computes the gate from them in float32 (torch.library.register_autocast would cast them too).
_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
_library = torch.library.Library("probattn", "FRAGMENT")


def _autocast_kernel(device_type):
    def kernel(_keyset, q, k, v, *rest):
        def cast(t):
            eligible = t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64
            return t.to(torch.bfloat16) if eligible else t

        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
            return torch.ops.probattn.attention.default(cast(q), cast(k), cast(v), *rest)

    return kernel


_library.impl("attention", _autocast_kernel("cpu"), "AutocastCPU", with_keyset=True)
_library.impl("attention", _autocast_kernel("cuda"), "AutocastCUDA", with_keyset=True)


@torch.compiler.assume_constant_result
def traceable(variant):
    """Whether `variant` runs through the custom operators: a name of the registry that does not
    sample (softmax, dnas, sinkhorn-N, hnas)."""
    e = _registry.entry(variant)
    return e is not None and not e["stochastic"]
