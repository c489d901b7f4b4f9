"""Repulsive multi-head attention (An et al. 2020) for any PyTorch model: the heads of its attention
modules are particles moved by SVGD or SPOS. `attach` registers the Rust library's step
(`probattn::repulsive::RepulsiveHook`) as a pre-step hook of a `torch.optim` optimizer, so each
`optimizer.step()` first replaces the heads' gradients with the direction, in place.

    hook = probattn.repulsive.attach(optimizer, model, kind="svgd", alpha=0.01, stepsize=0.1)
    ...
    hook.remove()
"""

import json
import re

import torch

from . import _native
from .nn import MultiheadAttention as ProbattnMultiheadAttention

__all__ = ["attach", "attention_modules", "Handle"]

KINDS = ("encoder-self", "decoder-self", "cross", "other")


def _kind_and_layer(name, order):
    """The module's kind and layer from its name, as nn.Transformer and most encoder-decoders
    name them: `decoder...multihead_attn` / `encoder_attn` / `cross...` is cross-attention,
    `decoder...` the decoder's self-attention, `encoder...` the encoder's; anything else is
    `other`. The layer is the number after `layers.` / `layer.` / `h.` / `blocks.`, else the
    module's place among the attention modules found."""
    lowered = name.lower()
    if "decoder" in lowered and any(s in lowered for s in ("multihead_attn", "encoder_attn", "cross")):
        kind = "cross"
    elif "cross" in lowered:
        kind = "cross"
    elif "decoder" in lowered:
        kind = "decoder-self"
    elif "encoder" in lowered:
        kind = "encoder-self"
    else:
        kind = "other"
    m = re.search(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)", name)
    return kind, int(m.group(1)) if m else order


def attention_modules(model):
    """The multi-head attention modules of `model` (torch.nn.MultiheadAttention and
    probattn.nn.MultiheadAttention) as `(name, kind, layer)`, in `named_modules` order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.MultiheadAttention, ProbattnMultiheadAttention)):
            kind, layer = _kind_and_layer(name, len(found))
            found.append((name, module, kind, layer))
    return found


def _entries(found):
    entries = []
    for name, module, kind, layer in found:
        if module.in_proj_weight is not None:
            entries.append((name, module.in_proj_weight, module.num_heads, kind, layer, None))
        else:
            for p in ("q", "k", "v"):
                entries.append((f"{name}.{p}_proj_weight", getattr(module, f"{p}_proj_weight"), module.num_heads, kind, layer, p))
    return entries


class Handle:
    """What `attach` returns: `remove()` detaches the hook; `modules` lists `(name, kind, layer)`
    of the attention modules found; `sets` the particle sets the last step moved."""

    def __init__(self, handle, modules):
        self._handle, self.modules, self.sets = handle, modules, []

    def remove(self):
        self._handle.remove()


def attach(optimizer, model, kind="svgd", alpha=0.01, stepsize=0.1, beta=1.0, bandwidth=None, selection=None):
    """Registers the SVGD (`kind="svgd"`) or SPOS (`"spos"`) head update as a pre-step hook of
    `optimizer`, over the Q, K and V projections of every attention module of `model` that
    `selection` accepts: a dict (or its JSON) with optional `kinds` (encoder-self, decoder-self,
    cross, other), `layers` (ints) and `projections` (q, k, v), the command line's `--selection`.
    Defaults are the paper's translation values (alpha 0.01, step size 0.1; beta 1 for SPOS);
    `bandwidth` None is the median heuristic. SPOS draws its noise from libtorch's generator
    (`torch.manual_seed` sets it). Call it after building the optimizer; gradients must exist
    when the optimizer steps."""
    if kind not in ("svgd", "spos"):
        raise ValueError(f"kind must be 'svgd' or 'spos', got {kind!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    found = attention_modules(model)
    if not found:
        raise ValueError("the model has no torch.nn.MultiheadAttention or probattn.nn.MultiheadAttention module")
    if isinstance(selection, dict):
        selection = json.dumps(selection)
    entries = _entries(found)
    options = dict(method=kind, alpha=float(alpha), stepsize=float(stepsize), beta=float(beta),
                   bandwidth=None if bandwidth is None else float(bandwidth), selection=selection)
    _native.repulsive_step([], **options)  # the settings and the selection, checked now
    handle = Handle(None, [(n, k, l) for n, _, k, l in found])

    def pre_step(opt, args, kwargs):
        handle.sets = _native.repulsive_step(entries, **options)

    handle._handle = optimizer.register_step_pre_hook(pre_step)
    return handle
