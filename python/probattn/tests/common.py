"""What the package's test files share: inputs, mask layouts and variants, in float64, for the
comparisons with the independent PyTorch references (python/probattn_tools/reference)."""

import torch
from torch.autograd import gradcheck

import probattn
from probattn_tools.reference import formulas as R
from probattn_tools.reference import variants as registry

D = torch.float64
DETERMINISTIC = [e["example"] for e in registry.registry() if not e["stochastic"]]
BAM = registry.examples(family="bayesian")
BAM_CFG = {"k": 10.0, "sigma": 0.5, "prior_alpha": 1.5, "prior_beta": 2.0, "prior_mu": -0.3, "prior_sigma": 1.2, "prior_hidden": 4}


def qkv(b=2, h=3, sq=5, sk=6, d=4, dv=3, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, h, sq, d, generator=g, dtype=D), torch.randn(b, h, sk, d, generator=g, dtype=D),
          torch.randn(b, h, sk, dv, generator=g, dtype=D)]
    return [t.requires_grad_(grad) for t in ts]


def layouts(b, h, sq, sk):
    """Mask layouts: none, key padding, a 2-D attn_mask, a 4-D one with padding, causal."""
    kp = torch.zeros(b, sk, dtype=torch.bool)
    kp[0, -2:] = True
    am = torch.zeros(sq, sk, dtype=torch.bool)
    am[1, 0] = am[3, 2] = True
    am4 = torch.rand(b, h, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.2
    am4[..., 0] = False
    return [("none", {}), ("key_padding", {"key_padding_mask": kp}), ("attn_mask", {"attn_mask": am}),
            ("attn_mask_4d", {"attn_mask": am4, "key_padding_mask": kp}), ("causal", {"is_causal": True})]


def sdpa(masks):
    """A layout's masks as probattn.attention takes them, in PyTorch's SDPA convention:
    `is_causal`, or one boolean `attn_mask` whose True marks an entry that takes part."""
    if masks.get("is_causal"):
        return {"is_causal": True}
    kp, am = masks.get("key_padding_mask"), masks.get("attn_mask")
    if kp is None and am is None:
        return {}
    excluded = torch.zeros((), dtype=torch.bool)
    if kp is not None:
        excluded = excluded | kp[:, None, None, :]
    if am is not None:
        excluded = excluded | am
    return {"attn_mask": ~excluded}


def allowed(b, h, sq, sk, masks):
    return R.allowed_mask(b, h, sq, sk, key_padding_mask=masks.get("key_padding_mask"), attn_mask=masks.get("attn_mask"),
                          causal=masks.get("is_causal", False))


def causal_safe(variant):
    return next(e for e in registry.registry() if variant in (e["name"], e["example"]))["causal_safe"]


def prior_params(h, d, hidden, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"f1.weight": torch.randn(h, hidden, d, generator=g, dtype=D), "f1.bias": torch.randn(h, hidden, generator=g, dtype=D),
            "f2.weight": torch.randn(h, hidden, generator=g, dtype=D), "f2.bias": torch.randn(h, generator=g, dtype=D)}


def bam_noise(variant, shape, seed=5):
    g = torch.Generator().manual_seed(seed)
    if registry.noise(variant) == "weibull":
        return torch.rand(shape, generator=g, dtype=D).clamp(1e-6, 1 - 1e-6)
    return torch.randn(shape, generator=g, dtype=D)


def gradcheck_every_variant(test, device, layouts_used=3):
    """torch.autograd.gradcheck in float64 through every variant, eager and memory-efficient, on
    `device`, under the first `layouts_used` mask layouts."""
    b, h, sq, sk = 1, 2, 4, 5
    on = lambda t: t.to(device)  # noqa: E731
    for variant in registry.examples():
        for layout, masks in layouts(b, h, sq, sk)[:layouts_used]:
            masks = {n: on(m) if torch.is_tensor(m) else m for n, m in masks.items()}
            for memory_efficient in (False, True):
                with test.subTest(f"{variant} {layout} {memory_efficient} {device}"):
                    inputs = [on(t.detach()).requires_grad_() for t in qkv(b, h, sq, sk, 3, 2, seed=7)]
                    if variant == "hnas":
                        inputs.append(torch.tensor([0.2, -0.4], dtype=D, device=device, requires_grad=True))
                    bam = None
                    if variant.startswith("bam"):
                        bam = dict(BAM_CFG, noise=on(bam_noise(variant, (b, h, sq, sk))))
                        if variant in ("bam-wc", "bam-lc"):
                            bam["prior"] = {n: on(t) for n, t in prior_params(h, 3, 4).items()}

                    def f(*xs):
                        kw = {"hybrid_logit": xs[3]} if variant == "hnas" else {}
                        out, info = probattn.attention_with_info(xs[0], xs[1], xs[2], variant=variant,
                                                                 memory_efficient=memory_efficient,
                                                                 tile=2 if memory_efficient else None,
                                                                 training=bam is not None, bam=bam, **sdpa(masks), **kw)
                        return (out, info.kl) if info.kl is not None else out

                    test.assertTrue(gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-8))
