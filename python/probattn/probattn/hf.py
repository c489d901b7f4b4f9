"""probattn's variants as Hugging Face transformers attention implementations.

    import probattn.hf
    probattn.hf.register()
    model = AutoModelForMaskedLM.from_config(config, attn_implementation="probattn-dnas")

`register()` adds, for every variant of `probattn.variants()` (sinkhorn-N for N in `sinkhorn`),
an implementation named `probattn-<variant>` and its memory-efficient form
`probattn-<variant>-me`, to transformers' `AttentionInterface`, with `sdpa`'s mask builder in
`AttentionMaskInterface`. Variants with learnable parameters of their own (hnas's gates, bam-wc's
and bam-lc's prior network) read them from the attention modules: `prepare(model, variant)` puts
them there, before the optimizer is built.

A causal model (Llama, GPT) may only use causal-safe variants: DNAS, HNAS and Sinkhorn normalize
each key over the queries, which under a causal mask lets a query's weights depend on later
queries. Such a call raises `ValueError` instead of training a model that sees the future.
BAM samples in training mode and leaves its KL on the attention module as `probattn_kl` (None for
bam-nokl and in eval mode); add it to the loss yourself.
"""

import math

import torch

from . import _native, _registry, attention, variants

__all__ = ["register", "names", "prepare"]


def _parameters(variant):
    """The learnable tensors `variant` reads (the registry's `parameters`: HNAS's `hybrid_logit`,
    the contextual prior's `prior.*`), which `prepare` puts on the attention modules."""
    return _registry.entry(variant)["parameters"]


def _forward(variant, memory_efficient):
    entry = _registry.entry(variant)
    causal_safe, stochastic, parameters = entry["causal_safe"], entry["stochastic"], entry["parameters"]

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
            raise ValueError(f"probattn-{variant}: position biases and softcapping are not supported")
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        module_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        if module_causal and not causal_safe and query.shape[2] > 1:
            raise ValueError(
                f"probattn-{variant} on a causal model: {variant} normalizes each key over the queries, so under a causal "
                f"mask a query's weights would depend on later queries (use softmax or a bam variant over softmax)")
        causal = bool(module_causal) and attention_mask is None and query.shape[2] > 1
        if causal and key.shape[2] > query.shape[2]:
            key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
        excluded = None
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                excluded = ~attention_mask
            else:
                lowest = torch.finfo(attention_mask.dtype).min
                if not torch.all((attention_mask == 0) | (attention_mask <= lowest / 2)):
                    raise ValueError(f"probattn-{variant}: additive masks other than 0 / -inf are not supported")
                excluded = attention_mask <= lowest / 2
        if memory_efficient and module.training and dropout > 0:
            raise ValueError(f"probattn-{variant}-me: the memory-efficient path has no attention dropout; set the model's "
                             f"attention dropout to 0 (BERT: attention_probs_dropout_prob, Llama: attention_dropout)")
        d = query.shape[-1]
        if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-12):
            query = query * (scaling * math.sqrt(d))  # probattn's scores are q k^T / sqrt(d)
        extra = {}
        if parameters:
            held = getattr(module, "probattn", None)
            if held is None:
                raise ValueError(f"probattn-{variant} reads learnable parameters: call probattn.hf.prepare(model, "
                                 f"'{variant}') before building the optimizer")
            if "hybrid_logit" in parameters:
                extra["hybrid_logit"] = held["hybrid_logit"]
            if any(n.startswith("prior.") for n in parameters):
                extra["bam"] = {"prior": {n.removeprefix("prior_").replace("_", ".", 1): p for n, p in held.items() if n.startswith("prior_")}}
        out = attention(query, key, value, variant=variant, attn_mask=excluded, is_causal=causal, **extra,
                        memory_efficient=memory_efficient, training=module.training,
                        dropout_p=dropout if module.training else 0.0, return_info=stochastic)
        if stochastic:
            # Only BAM asks for the info (its KL): without it the eager path need not form weights.
            out, info = out
            module.probattn_kl = info.kl
        return out.transpose(1, 2).contiguous(), None

    return forward


def names(sinkhorn=(3,)):
    """The implementation names `register(sinkhorn)` adds, with the variant each runs."""
    out = {}
    for entry in variants():
        chosen = [f"{entry['name'][:-1]}{n}" for n in sinkhorn] if entry["name"].endswith("-N") else [entry["name"]]
        for variant in chosen:
            out[f"probattn-{variant}"] = (variant, False)
            out[f"probattn-{variant}-me"] = (variant, True)
    return out


def prepare(model, variant, hybrid_init_u=0.5):
    """Gives every attention module of a transformers `model` the parameters `variant` reads (hnas:
    `hybrid_logit (H,)`; bam-wc, bam-lc: the contextual prior's network), as a `ParameterDict`
    named `probattn` on the module, initialised as the Rust library initialises them (libtorch's
    generator, which `torch.manual_seed` sets). Call it before building the optimizer. Returns the
    names of the modules prepared."""
    if _registry.entry(variant) is None:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(e['name'] for e in variants())})")
    if not _parameters(variant):
        with_parameters = [e["name"] for e in variants() if e["parameters"]]
        raise ValueError(f"{variant} has no parameters of its own (those that do: {', '.join(with_parameters)})")
    heads = model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // heads
    prepared = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention") or not any(isinstance(c, torch.nn.Linear) for c in module.children()):
            continue
        initial = _native.initial_parameters(heads * head_dim, heads, variant, settings={"hybrid_init_u": float(hybrid_init_u)})
        params = {n.replace(".", "_"): torch.nn.Parameter(t) for n, t in initial
                  if not n.startswith(("in_proj", "out_proj", "q_proj", "k_proj", "v_proj"))}
        device = next(module.parameters()).device
        module.probattn = torch.nn.ParameterDict({n: torch.nn.Parameter(p.to(device)) for n, p in params.items()})
        prepared.append(name)
    if not prepared:
        raise ValueError("found no attention module (a module whose class name ends in 'Attention' and holds the projections)")
    return prepared


def register(sinkhorn=(3,)):
    """Registers every name of `names(sinkhorn)` with transformers; returns the names."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    registered = names(sinkhorn)
    for name, (variant, memory_efficient) in registered.items():
        AttentionInterface.register(name, _forward(variant, memory_efficient))
        AttentionMaskInterface.register(name, sdpa_mask)
    return sorted(registered)
