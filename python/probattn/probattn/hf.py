"""probattn as a Hugging Face transformers attention implementation, the transformers way: one
implementation, "probattn", whose variant and settings are the model config's.

    import probattn.hf
    probattn.hf.register()
    config.probattn = {"variant": "dnas"}                      # or set it on model.config later
    model = AutoModelForMaskedLM.from_config(config, attn_implementation="probattn")

`config.probattn` is a dict (absent: softmax, eager):
    variant: a name of `probattn.variants()` (softmax, dnas, hnas, sinkhorn-N, bam-*).
    memory_efficient: the tiled path, which keeps nothing (L, S) for the backward pass (no
        attention dropout there: set the model's to 0).
    tile: queries per tile on that path (default `probattn.DEFAULT_TILE`).
    bam: BAM's settings (k, sigma, prior_alpha, prior_beta, prior_mu, prior_sigma, prior_hidden,
        base), as `probattn.attention` takes them.
Every attention call reads the config of its module, so a change of `model.config.probattn`
applies from the next step. `register()` also adds `probattn-<variant>` and
`probattn-<variant>-me` (memory-efficient), aliases that fix the variant whatever the config says.

The call is SDPA's (`probattn.functional.scaled_dot_product_attention`): grouped-query models
(Llama, Mistral, Qwen) pass their keys and values as they are (`enable_gqa`), the model's scaling
is the score scale, masks go in as transformers builds them for SDPA (boolean, or additive), and
an additive position bias (T5-style) is added to the mask. Softcapping is refused. The mask
builder registered with the names hands the library a padded encoder's mask as key padding and a
padded decoder's causal mask as the causal pattern and key padding (`_sdpa_mask`).

Variants with learnable parameters of their own (hnas's gates, bam-wc's and bam-lc's prior
network) read them from the attention modules: `prepare(model)` puts them there, before the
optimizer is built. A causal model (Llama, GPT) may only use causal-safe variants: DNAS, HNAS and
Sinkhorn normalize each key over the queries, which under a causal mask lets a query's weights
depend on later queries; such a call raises `ValueError`. BAM samples in training mode and leaves
its KL on the attention module as `probattn_kl` (None for bam-nokl and in eval mode); add it to the
loss yourself.
"""

import torch

from . import _native, _registry, attention_with_info, functional, scaled_dot_product_attention, variants

__all__ = ["register", "names", "prepare", "settings_of"]

_KEYS = ("variant", "memory_efficient", "tile", "bam")


def settings_of(config, default_variant="softmax"):
    """The probattn settings of a transformers config (`config.probattn`), checked: a dict with
    `variant` (default `default_variant`), `memory_efficient`, `tile`, `bam`."""
    given = getattr(config, "probattn", None) or {}
    if not isinstance(given, dict):
        raise TypeError(f"config.probattn must be a dict (variant, memory_efficient, tile, bam), got {type(given).__name__}")
    unknown = sorted(set(given) - set(_KEYS))
    if unknown:
        raise ValueError(f"config.probattn: unknown settings {unknown} (known: {list(_KEYS)})")
    variant = given.get("variant", default_variant)
    if _registry.entry(variant) is None:
        raise ValueError(f"config.probattn: unknown variant {variant!r} (known: {', '.join(e['name'] for e in variants())})")
    return dict(given, variant=variant)


def _mask_with_bias(attention_mask, position_bias, is_causal, query, key):
    """SDPA's float mask from a position bias, the model's mask (boolean or additive) and the
    causal pattern, as transformers' SDPA path combines them."""
    bias = position_bias.to(query.dtype) if position_bias.is_floating_point() else position_bias.float()
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attention_mask, float("-inf"))
        else:
            bias = bias + attention_mask
    if is_causal:
        L, S = query.shape[-2], key.shape[-2]
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        bias = bias.masked_fill(~causal, float("-inf"))
    return bias


def _forward(fixed=None):
    """The attention function transformers calls; `fixed`: an alias's (variant, memory_efficient),
    else the module config's settings."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                position_bias=None, **kwargs):
        if kwargs.get("softcap") is not None:
            raise ValueError("probattn: softcapping is not supported")
        settings = settings_of(getattr(module, "config", None))
        if fixed is not None:
            settings = dict(settings, variant=fixed[0], memory_efficient=fixed[1])
        variant, memory_efficient = settings["variant"], bool(settings.get("memory_efficient", False))
        entry = _registry.entry(variant)
        name = f"probattn ({variant}{', memory-efficient' if memory_efficient else ''})"
        module_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        if module_causal and not entry["causal_safe"] and query.shape[2] > 1:
            raise ValueError(
                f"{name} on a causal model: {variant} normalizes each key over the queries, so under a causal "
                f"mask a query's weights would depend on later queries (use softmax or a bam variant over softmax)")
        causal = bool(module_causal) and attention_mask is None and query.shape[2] > 1
        # A causal mask joined with key padding (`_sdpa_mask` marks one): the causal pattern and the
        # key row, which the library runs as both where the whole mask would be a pattern.
        keys = getattr(attention_mask, "_probattn_causal_keys", None)
        if keys is not None and (position_bias is not None
                                 or tuple(attention_mask.shape[-2:]) != (query.shape[2], key.shape[2])):
            keys = None
        if position_bias is not None:
            attention_mask = _mask_with_bias(attention_mask, position_bias, causal, query, key)
            causal = False
        if memory_efficient and module.training and dropout > 0:
            raise ValueError(f"{name}: the memory-efficient path has no attention dropout; set the model's "
                             f"attention dropout to 0 (BERT: attention_probs_dropout_prob, Llama: attention_dropout)")
        extra = {}
        if settings.get("bam"):
            extra["bam"] = dict(settings["bam"])
        parameters = entry["parameters"]
        if parameters:
            held = getattr(module, "probattn", None)
            if held is None:
                raise ValueError(f"{name} reads learnable parameters: call probattn.hf.prepare(model, '{variant}') "
                                 f"before building the optimizer")
            if "hybrid_logit" in parameters:
                extra["hybrid_logit"] = held["hybrid_logit"]
            if any(n.startswith("prior.") for n in parameters):
                prior = {n.removeprefix("prior_").replace("_", ".", 1): p for n, p in held.items() if n.startswith("prior_")}
                extra["bam"] = dict(extra.get("bam", {}), prior=prior)
        if memory_efficient:
            extra["memory_efficient"] = True
            if settings.get("tile") is not None:
                extra["tile"] = settings["tile"]
        groups = getattr(module, "num_key_value_groups", 1)
        dropout = dropout if module.training else 0.0
        if keys is not None:
            out = functional._call(query, key, value, keys, dropout, True, scaling, groups > 1, variant, module.training,
                                   extra.get("memory_efficient", False), extra.get("tile"), None,
                                   extra.get("hybrid_logit"), extra.get("bam"), entry["stochastic"], joined=True)
        else:
            call = attention_with_info if entry["stochastic"] else scaled_dot_product_attention
            out = call(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
                       enable_gqa=groups > 1, variant=variant, training=module.training, **extra)
        if entry["stochastic"]:
            # Only BAM asks for the info (its KL): without it the eager path need not form weights.
            out, info = out
            module.probattn_kl = info.kl
        return out.transpose(1, 2).contiguous(), None

    return forward


def names(sinkhorn=(3,)):
    """The implementation names `register(sinkhorn)` adds: "probattn" (None: the config decides),
    and the aliases with the (variant, memory_efficient) each fixes."""
    out = {"probattn": None}
    for entry in variants():
        chosen = [f"{entry['name'][:-1]}{n}" for n in sinkhorn] if entry["name"].endswith("-N") else [entry["name"]]
        for variant in chosen:
            out[f"probattn-{variant}"] = (variant, False)
            out[f"probattn-{variant}-me"] = (variant, True)
    return out


def prepare(model, variant=None, hybrid_init_u=0.5):
    """Gives every attention module of a transformers `model` the parameters `variant` reads (hnas:
    `hybrid_logit (H,)`; bam-wc, bam-lc: the contextual prior's network), as a `ParameterDict`
    named `probattn` on the module, initialised as the Rust library initialises them (libtorch's
    generator, which `torch.manual_seed` sets). `variant` None: the model config's
    (`config.probattn["variant"]`). Call it before building the optimizer. Returns the names of the
    modules prepared."""
    if variant is None:
        variant = settings_of(model.config)["variant"]
    if _registry.entry(variant) is None:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(e['name'] for e in variants())})")
    if not _registry.entry(variant)["parameters"]:
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


def _sdpa_mask(*args, **kwargs):
    """SDPA's mask builder, with what the library can run faster than a whole (S_q, S_k) pattern:
    - an encoder's padding mask comes back as its first query's row broadcast over the queries (an
      `expand`ed view of the same values), which the library runs as key padding. A caller that
      asks for the mask materialized (`allow_is_bidirectional_skip=False`, to write into it or
      join it with another) gets it as SDPA's builder makes it;
    - a decoder's causal mask joined with padding (Llama's, a padded batch's) comes back as SDPA's
      builder makes it, marked with its last query's row (`_probattn_causal_keys`, the padding):
      the attention then runs it as the causal pattern and key padding.
    transformers builds one mask per forward pass for every layer."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.dtype != torch.bool:
        return mask
    padding = kwargs.get("attention_mask")
    plain = not args and kwargs.get("local_size") is None and (padding is None or padding.dim() == 2)
    # Causal from the top left: the query and key positions start together (offsets as ints; a
    # tensor offset would need a synchronizing read). Then query i may see key j when j <= i and
    # j is not padding, and the last query's row is the padding (past it, nothing is allowed in
    # any row), so that row and the causal pattern make the whole mask.
    offsets = kwargs.get("q_offset"), kwargs.get("kv_offset")
    causal = (plain and kwargs.get("mask_function") is causal_mask_function and all(type(o) is int for o in offsets)
              and offsets[0] == offsets[1] and not torch.compiler.is_compiling())
    if causal:
        mask._probattn_causal_keys = mask[:, :, -1:, :].clone()
        return mask
    # The bidirectional pattern and a 2-D padding mask, nothing else: every query's row is the
    # padding's (mask = (q >= 0) & padding[b, kv]).
    alike = (plain and kwargs.get("mask_function") is bidirectional_mask_function
             and kwargs.get("allow_is_bidirectional_skip") is True)
    return mask[:, :, :1, :].expand(mask.shape) if alike else mask


def register(sinkhorn=(3,)):
    """Registers "probattn" and every alias of `names(sinkhorn)` with transformers, with SDPA's
    mask builder (`_sdpa_mask`); returns the names."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    registered = names(sinkhorn)
    for name, fixed in registered.items():
        AttentionInterface.register(name, _forward(fixed))
        AttentionMaskInterface.register(name, _sdpa_mask)
    return sorted(registered)
