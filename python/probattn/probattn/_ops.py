"""`probattn.attention` and `probattn.nn.MultiheadAttention` as `torch.library` custom operators,
so that `torch.compile` traces a call without a graph break: the variants without sampling, on the
eager path and the memory-efficient one (softmax, dnas, sinkhorn-N, and hnas with its gate logits),
and BAM where its draws can be replayed. Each forward operator is the library's computation; its
backward operator recomputes it under autograd and returns the library's gradients (one more
forward pass than the uncompiled call, which keeps its own backward). All have fake
implementations, so the compiler knows their shapes without running them."""

import functools
import json
from typing import Optional

import torch

from . import _native, _registry


def _run(q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit, bias, scale, enable_gqa):
    params = None if hybrid_logit is None else {"hybrid_logit": hybrid_logit}
    out, _, _, _ = _native.attention(_registry.spec(variant, (), None), q, k, v, key_padding_mask, attn_mask, bias,
                                     causal, scale, enable_gqa, tile, False, 0.0, None, None, False, False, params)
    return out


@torch.library.custom_op("probattn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, tile: Optional[int],
              attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor], causal: bool,
              hybrid_logit: Optional[torch.Tensor], bias: Optional[torch.Tensor], scale: Optional[float],
              enable_gqa: bool) -> torch.Tensor:
    """The attention output `(B, H, S_q, d_v)`; `tile` None is the eager path. `attn_mask` and
    `key_padding_mask` in the library's convention (True = excluded), `bias` added to the scores."""
    return _run(q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit, bias, scale,
                enable_gqa).contiguous()


@attention.register_fake
def _(q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit, bias, scale, enable_gqa):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _laid_out_as(t, g):
    """The gradient `g` in the memory layout of its input `t`, as the fake implementations state it
    (`empty_like`): a compiled graph holds an operator to the strides its fake form gives."""
    return torch.empty_like(t).copy_(g)


def _gradients(inputs, out, grad, kl=None, grad_kl=None):
    """What every backward operator returns: the gradients of the recomputed output (and of BAM's
    KL term, where there is one) in each input, laid out as the input; zeros for an input the call
    leaves unused (BAM's prior in evaluation)."""
    outputs, grads = ([out, kl], [grad, grad_kl]) if kl is not None else ([out], [grad])
    found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    return [_laid_out_as(t, g if g is not None else torch.zeros_like(t)) for t, g in zip(inputs, found)]


def _differentiable(q, k, v, hybrid_logit, bias):
    """The inputs that receive gradients: q, k, v, and the gate logits and the additive mask when
    given."""
    return tuple(t for t in (q, k, v, hybrid_logit, bias) if t is not None)


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
                       causal: bool, hybrid_logit: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       scale: Optional[float], enable_gqa: bool) -> list[torch.Tensor]:
    """The gradients in q, k, v, and in hybrid_logit and bias when they are given."""
    with torch.enable_grad(), _autograd_dispatch():
        inputs = [t.detach().requires_grad_() for t in _differentiable(q, k, v, hybrid_logit, bias)]
        given = iter(inputs[3:])
        logit = next(given) if hybrid_logit is not None else None
        added = next(given) if bias is not None else None
        out = _run(*inputs[:3], variant, tile, attn_mask, key_padding_mask, causal, logit, added, scale, enable_gqa)
        return _gradients(inputs, out, grad)


@attention_backward.register_fake
def _(grad, q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit, bias, scale, enable_gqa):
    return [torch.empty_like(t) for t in _differentiable(q, k, v, hybrid_logit, bias)]


def _setup_context(ctx, inputs, output):
    q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit, bias, scale, enable_gqa = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_padding_mask, hybrid_logit, bias)
    ctx.options = (variant, tile, causal, scale, enable_gqa)


def _backward(ctx, grad):
    q, k, v, attn_mask, key_padding_mask, hybrid_logit, bias = ctx.saved_tensors
    variant, tile, causal, scale, enable_gqa = ctx.options
    grads = attention_backward(grad, q, k, v, variant, tile, attn_mask, key_padding_mask, causal, hybrid_logit, bias,
                               scale, enable_gqa)
    rest = iter(grads[3:])
    d_logit = next(rest) if hybrid_logit is not None else None
    d_bias = next(rest) if bias is not None else None
    return *grads[:3], None, None, None, None, None, d_logit, d_bias, None, None


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


# The module's operator and BAM's are not cast by autocast: their configuration names the autocast
# dtype the call was traced in, and they run the library in that state, as the uncompiled call runs.
_AUTOCAST_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def autocast_name(device_type):
    """The name of the autocast dtype on `device_type`: None where autocast is off, "other" for a
    dtype the operators that take it do not (the call then runs uncompiled)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return _AUTOCAST_NAMES.get(torch.get_autocast_dtype(device_type), "other")


def _traced_autocast(c, t):
    """The autocast state a call was traced in (`c["autocast"]`: a dtype's name, or None for none),
    set again wherever its operator runs: the backward operator recomputes the forward pass as it
    ran, whatever the state when the backward pass runs (usually after the region has closed)."""
    return torch.autocast(t.device.type, dtype=getattr(torch, c["autocast"] or "bfloat16"),
                          enabled=c["autocast"] is not None)


def _autocast_dtype(c, t):
    """The dtype attention computes in for input `t`: the traced autocast dtype, but for float64,
    which autocast leaves alone."""
    return t.dtype if c["autocast"] is None or t.dtype == torch.float64 else getattr(torch, c["autocast"])


def _statistics_dtype(dtype):
    """The dtype of the statistics (received mass, KL) for attention computed in `dtype`."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# `probattn.nn.MultiheadAttention` as a custom operator, for the same variants and the same
# reason: the library's multi-head module (projections, masks, the normalizer, either path) is one
# operator whose inputs are the module's inputs and parameters. `key` None is `query` and `value`
# None is `key` (self-attention, and cross-attention's memory as keys and values), so the module
# sees a shared input as the uncompiled call does and each gradient is counted once. `config` is
# the module's configuration as JSON, with the names of `params` in order and the autocast dtype the
# call was traced under (None outside autocast): the operator is not cast by autocast, but runs the
# module in that state, as the uncompiled call does. BAM takes it where its draws replay (in
# evaluation, with a given `noise`, or from a `seed` on the memory-efficient path), and its KL term
# is the operator's second output.
@functools.lru_cache(maxsize=None)
def _parsed(config):
    """An operator's configuration, parsed once (the operator runs at every step of a compiled model)."""
    return json.loads(config)


def _run_module(query, key, value, params, config, key_padding_mask, attn_mask, training, noise, seed):
    c = _parsed(config)
    key = query if key is None else key
    value = key if value is None else value
    with _traced_autocast(c, query):
        out, _, kl = _native.multi_head_attention(
            query, key, value, c["embed_dim"], c["num_heads"], c["variant"], dict(zip(c["names"], params)),
            kdim=c["kdim"], vdim=c["vdim"], bias=c["bias"], tile=c["tile"], key_padding_mask=key_padding_mask,
            attn_mask=attn_mask, causal=c["causal"], training=training, noise=noise, seed=seed, settings=c["settings"],
            bam_base=c["bam_base"], key_is_query=key is query, value_is_key=value is key)
    return out, kl


def _module_layout(query, config, training):
    """The (shape, dtype) of the module's output and of its KL term (empty where there is none)."""
    c = _parsed(config)
    dtype = _autocast_dtype(c, query)  # under autocast the output projection returns the autocast dtype
    kl = () if training and _registry.entry(c["variant"])["kl"] else (0,)
    return (query.shape[:-1] + (c["embed_dim"],), dtype), (kl, _statistics_dtype(dtype))


@torch.library.custom_op("probattn::multi_head_attention", mutates_args=())
def multi_head_attention(query: torch.Tensor, key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                         params: list[torch.Tensor], config: str, key_padding_mask: Optional[torch.Tensor],
                         attn_mask: Optional[torch.Tensor], training: bool, noise: Optional[torch.Tensor],
                         seed: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's output `(N, L, E)`, batch first, and BAM's KL term (`()`, or empty where there
    is none)."""
    out, kl = _run_module(query, key, value, params, config, key_padding_mask, attn_mask, training, noise, seed)
    _, (_, stats) = _module_layout(query, config, training)
    return out.contiguous(), kl if kl is not None else query.new_empty(0, dtype=stats)


@multi_head_attention.register_fake
def _(query, key, value, params, config, key_padding_mask, attn_mask, training, noise, seed):
    return tuple(query.new_empty(shape, dtype=dtype) for shape, dtype in _module_layout(query, config, training))


@torch.library.custom_op("probattn::multi_head_attention_backward", mutates_args=())
def multi_head_attention_backward(grad: torch.Tensor, grad_kl: torch.Tensor, query: torch.Tensor,
                                  key: Optional[torch.Tensor], value: Optional[torch.Tensor], params: list[torch.Tensor],
                                  config: str, key_padding_mask: Optional[torch.Tensor],
                                  attn_mask: Optional[torch.Tensor], training: bool, noise: Optional[torch.Tensor],
                                  seed: Optional[int]) -> list[torch.Tensor]:
    """The gradients, of the output and the KL term (from the same draws), in query, in key and
    value where they are given, and in every parameter."""
    with torch.enable_grad(), _autograd_dispatch():
        q, k, v = (t.detach().requires_grad_() if t is not None else None for t in (query, key, value))
        ps = [p.detach().requires_grad_() for p in params]
        out, kl = _run_module(q, k, v, ps, config, key_padding_mask, attn_mask, training, noise, seed)
        return _gradients([t for t in (q, k, v) if t is not None] + ps, out, grad, kl, grad_kl)


@multi_head_attention_backward.register_fake
def _(grad, grad_kl, query, key, value, params, config, key_padding_mask, attn_mask, training, noise, seed):
    return [torch.empty_like(t) for t in [t for t in (query, key, value) if t is not None] + list(params)]


def _setup_module_context(ctx, inputs, output):
    query, key, value, params, config, key_padding_mask, attn_mask, training, noise, seed = inputs
    ctx.save_for_backward(query, key, value, key_padding_mask, attn_mask, noise, *params)
    ctx.options = (config, training, seed)


def _module_backward(ctx, grad, grad_kl):
    query, key, value, key_padding_mask, attn_mask, noise, *params = ctx.saved_tensors
    config, training, seed = ctx.options
    grads = iter(multi_head_attention_backward(grad, grad_kl, query, key, value, params, config, key_padding_mask,
                                               attn_mask, training, noise, seed))
    gq = next(grads)
    gk = next(grads) if key is not None else None
    gv = next(grads) if value is not None else None
    return gq, gk, gv, list(grads), None, None, None, None, None, None


multi_head_attention.register_autograd(_module_backward, setup_context=_setup_module_context)


# Attention with its statistics, as a custom operator: the received mass (the memory-efficient
# path's; empty on the eager path) and the KL term (empty where there is none) beside the output.
# It takes `return_info` calls on the memory-efficient path, and BAM where its draws can be
# replayed by the recomputing backward: in evaluation (no draws: BAM's mean), with a given draw
# (`noise`), and on the memory-efficient path with a `seed` (its tiles draw from the seed); a
# compiled BAM training step has its loss's KL. `config` is JSON: the variant, its settings and
# base, training, the names of `params` (the contextual prior's, HNAS's gate logits) and the
# autocast dtype the call was traced in, which the operator sets again.
def draws_replay(training, noise, seed):
    """Whether a recomputing backward can replay a call's BAM draws: there are none in evaluation
    (BAM's mean), or they are given (`noise`), or they come from a seed (which only the
    memory-efficient path takes)."""
    return not training or noise is not None or seed is not None


@torch.compiler.assume_constant_result
def replayable_bam(variant):
    """Whether `variant` is a BAM variant (a stochastic registry entry)."""
    e = _registry.entry(variant)
    return e is not None and e["stochastic"]


@torch.compiler.assume_constant_result
def info_config(variant, settings, base, training, names, autocast, scale=None, enable_gqa=False):
    """The configuration `attention_with_info` takes; `settings` as (name, value) pairs."""
    e = _registry.entry(variant)
    return json.dumps({"variant": variant, "settings": dict(settings), "base": base, "training": training,
                       "names": list(names), "autocast": autocast, "kl": training and e["kl"], "scale": scale,
                       "enable_gqa": enable_gqa})


def _run_with_info(q, k, v, config, tile, attn_mask, key_padding_mask, causal, params, noise, seed):
    c = _parsed(config)
    with _traced_autocast(c, q):
        spec = _registry.spec(c["variant"], tuple(sorted(c["settings"].items())), c["base"])
        out, _, mass, kl = _native.attention(
            spec, q, k, v, key_padding_mask, attn_mask, None, causal, c.get("scale"), c.get("enable_gqa", False), tile,
            c["training"], 0.0, seed, noise, False, True, dict(zip(c["names"], params)))
    return out, mass, kl


def _info_layout(q, v, config, tile):
    """The (shape, dtype) of the output, the received mass and the KL term, as the fake
    implementation states them: the mass is empty on the eager path, the KL where there is none."""
    c = _parsed(config)
    dtype = _autocast_dtype(c, q)
    stats = _statistics_dtype(dtype)
    mass = (q.shape[0], q.shape[1], v.shape[-2]) if tile is not None else (0,)
    return (q.shape[:-1] + (v.shape[-1],), dtype), (mass, stats), (() if c["kl"] else (0,), stats)


@torch.library.custom_op("probattn::attention_with_info", mutates_args=())
def attention_with_info(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: str, tile: Optional[int],
                        attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor], causal: bool,
                        params: list[torch.Tensor], noise: Optional[torch.Tensor],
                        seed: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output `(B, H, S_q, d_v)`, received mass `(B, H, S_k)` or empty, KL `()` or empty)."""
    out, mass, kl = _run_with_info(q, k, v, config, tile, attn_mask, key_padding_mask, causal, params, noise, seed)
    _, (_, stats), _ = _info_layout(q, v, config, tile)
    mass = mass if mass is not None else q.new_empty(0, dtype=stats)  # two tensors: outputs may not alias
    kl = kl if kl is not None else q.new_empty(0, dtype=stats)
    return out.contiguous(), mass, kl


@attention_with_info.register_fake
def _(q, k, v, config, tile, attn_mask, key_padding_mask, causal, params, noise, seed):
    return tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in _info_layout(q, v, config, tile))


@torch.library.custom_op("probattn::attention_with_info_backward", mutates_args=())
def attention_with_info_backward(grad: torch.Tensor, grad_kl: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                 v: torch.Tensor, config: str, tile: Optional[int], attn_mask: Optional[torch.Tensor],
                                 key_padding_mask: Optional[torch.Tensor], causal: bool, params: list[torch.Tensor],
                                 noise: Optional[torch.Tensor], seed: Optional[int]) -> list[torch.Tensor]:
    """The gradients in q, k, v and every parameter, of the output and the KL term, from the same
    draws."""
    with torch.enable_grad(), _autograd_dispatch():
        inputs = [t.detach().requires_grad_() for t in (q, k, v, *params)]
        out, _, kl = _run_with_info(*inputs[:3], config, tile, attn_mask, key_padding_mask, causal, inputs[3:], noise,
                                    seed)
        return _gradients(inputs, out, grad, kl, grad_kl)


@attention_with_info_backward.register_fake
def _(grad, grad_kl, q, k, v, config, tile, attn_mask, key_padding_mask, causal, params, noise, seed):
    return [torch.empty_like(t) for t in (q, k, v, *params)]


def _setup_info_context(ctx, inputs, output):
    q, k, v, config, tile, attn_mask, key_padding_mask, causal, params, noise, seed = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_padding_mask, noise, *params)
    ctx.options = (config, tile, causal, seed)
    ctx.mark_non_differentiable(output[1])


def _info_backward(ctx, grad, _grad_mass, grad_kl):
    q, k, v, attn_mask, key_padding_mask, noise, *params = ctx.saved_tensors
    config, tile, causal, seed = ctx.options
    grads = attention_with_info_backward(grad, grad_kl, q, k, v, config, tile, attn_mask, key_padding_mask, causal,
                                         params, noise, seed)
    return *grads[:3], None, None, None, None, None, grads[3:], None, None


attention_with_info.register_autograd(_info_backward, setup_context=_setup_info_context)
