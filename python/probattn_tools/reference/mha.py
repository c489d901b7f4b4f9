"""probattn's attention variants for PyTorch users: a drop-in for `torch.nn.MultiheadAttention`
with a `variant` of the library's registry (`probattn variants`; `sinkhorn-N` for any N), scriptable
with `torch.jit.script`, so a model trained in PyTorch with DNAS,
HNAS or BAM exports as TorchScript and runs in probattn (`probattn compare --native mha --variant
dnas` checks such an export against the native module).

    from probattn_tools.reference.mha import MultiheadAttention
    attn = MultiheadAttention(512, 8, variant="dnas", batch_first=True)
    out, weights = attn(x, x, x, key_padding_mask=pad)

The weights are computed by python/probattn_tools/reference/formulas.py's normalizers (written from the papers'
formulas, and the reference the Rust library is tested against); the module adds the
projections, masks and dropout around them. Parameters carry nn.MultiheadAttention's names
(`in_proj_weight (3E, E)`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias`; HNAS adds
`hybrid_logit (H)`, u = sigmoid(logit) initialised at `hybrid_init_u`), so state dicts move
between the two and into probattn by name. The call is nn.MultiheadAttention's:
`forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
average_attn_weights=True)`, masks boolean with True = excluded (float additive masks are
refused), inputs `(L, N, E)` or, `batch_first`, `(N, L, E)`. Fully masked rows get zero weights.
Not supported: `add_bias_kv`, `add_zero_attn`, `kdim`/`vdim` other than `embed_dim`, unbatched
inputs.

BAM (Fan et al. 2020; docs/formulas.md §2), as the Rust library has it: in eval
mode the weights are the base normalizer's, `pi` (the mean of the random weights); in training
mode they are sampled, `W = softmax_j(log S)`, Weibull (`bam-nokl`, `bam-wf`, `bam-wc`; shape
`bam_k`) or Lognormal (`bam-lf`, `bam-lc`; `bam_sigma`), and the KL term to the prior (fixed
Gamma(`prior_alpha`, `prior_beta`) / Lognormal(`prior_mu`, `prior_sigma`), or contextual from the
keys: `prior.f1.weight (H, prior_hidden, d)`, `prior.f1.bias`, `prior.f2.weight (H, prior_hidden)`,
`prior.f2.bias`, the Rust library's names) is left in `module.kl` for the loss (None in eval mode
and for `bam-nokl`). `forward(..., noise=eps)` fixes the draw (uniform on (0, 1) for Weibull,
standard normal for Lognormal, shaped like the weights `(N, H, L, S)`), which is how the tests
compare with python/probattn_tools/reference/formulas.py. The base is "softmax" (the papers') or "dnas" (`bam_base`).
The defaults are the Rust library's (`BamConfig`).
"""

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from probattn_tools.reference import variants
from probattn_tools.reference.formulas import dnas_weights, hnas_weights, masked_logsumexp, sinkhorn_weights, softmax_weights

__all__ = ["MultiheadAttention"]

# The BAM variants, and what each samples and reads, as the library's registry states them.
_REGISTRY = {e["example"]: e for e in variants.registry()}
BAM = tuple(name for name, e in _REGISTRY.items() if e["family"] == "bayesian")
# The deterministic variants this module writes out itself (its forward's branches; sinkhorn-N is
# parsed apart). Another entry of the registry is refused by name rather than computed as something
# else: a variant added to the library needs its branch here before it can be scripted or exported.
_WRITTEN = ("softmax", "dnas", "hnas")


class _Weights(nn.Module):
    """A `weight` and a `bias` of free shapes (the contextual prior's per-head layers)."""

    def __init__(self, weight: List[int], bias: List[int], fan_in: int, factory):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(weight, **factory) * math.sqrt(2.0 / fan_in))  # He, as the Rust library
        self.bias = nn.Parameter(torch.zeros(bias, **factory))


class ContextualPrior(nn.Module):
    """psi_j = softmax_j(F2(ReLU(F1(k_j)))) per head, over the keys some query may attend."""

    def __init__(self, heads: int, key_dim: int, hidden: int, factory):
        super().__init__()
        self.f1 = _Weights([heads, hidden, key_dim], [heads, hidden], key_dim, factory)
        self.f2 = _Weights([heads, hidden], [heads], hidden, factory)

    def forward(self, keys: Tensor, allowed: Tensor) -> Tensor:
        """keys (B, H, S_k, d) -> log psi (B, H, 1, S_k)."""
        hidden = torch.relu(torch.einsum("bhsd,hmd->bhsm", keys, self.f1.weight) + self.f1.bias[None, :, None, :])
        logits = (torch.einsum("bhsm,hm->bhs", hidden, self.f2.weight) + self.f2.bias[None, :, None])[:, :, None, :]
        return logits - masked_logsumexp(logits, allowed.any(-2, keepdim=True), -1)


class MultiheadAttention(nn.Module):
    __constants__ = ["embed_dim", "num_heads", "head_dim", "batch_first", "variant", "sinkhorn_iterations", "dropout", "bam_k",
                     "bam_sigma", "prior_alpha", "prior_beta", "prior_mu", "prior_sigma", "bam_base", "lgamma_1p_inv", "weibull", "bayesian"]
    kl: Optional[Tensor]

    def __init__(self, embed_dim: int, num_heads: int, variant: str = "softmax", dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, hybrid_init_u: float = 0.5, bam_k: float = 1000.0, bam_sigma: float = 1.0,
                 prior_alpha: float = 1.0, prior_beta: float = 1.0, prior_mu: float = 0.0, prior_sigma: float = 1.0,
                 prior_hidden: int = 10, bam_base: str = "softmax", device=None, dtype=None):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"num_heads {num_heads} does not divide embed_dim {embed_dim}")
        self.sinkhorn_iterations = 0
        if variant.startswith("sinkhorn-"):
            self.sinkhorn_iterations = int(variant.split("-", 1)[1])
            if self.sinkhorn_iterations < 1:
                raise ValueError(f"{variant}: Sinkhorn needs at least one iteration")
            variant = "sinkhorn"
        elif variant not in _REGISTRY:
            raise ValueError(f"unknown variant {variant!r} ({', '.join(e['name'] for e in variants.registry())})")
        elif variant not in _WRITTEN and variant not in BAM:
            raise ValueError(f"{variant}: not written in this pure-PyTorch module (it has {', '.join(_WRITTEN)}, sinkhorn-N and "
                             f"{', '.join(BAM)}); add its branch to python/probattn_tools/reference/mha.py")
        if variant in BAM:
            for name, value in (("bam_k", bam_k), ("bam_sigma", bam_sigma), ("prior_alpha", prior_alpha), ("prior_beta", prior_beta),
                                ("prior_sigma", prior_sigma)):
                if not (value > 0.0 and math.isfinite(value)):
                    raise ValueError(f"{name} must be positive and finite, got {value}")
            if bam_base not in ("softmax", "dnas"):
                raise ValueError(f"bam_base {bam_base!r}: this module takes softmax or dnas (the Rust library takes any deterministic variant)")
            if prior_hidden < 1:
                raise ValueError(f"prior_hidden must be at least 1, got {prior_hidden}")
        if not 0.0 < hybrid_init_u < 1.0:
            raise ValueError("hybrid_init_u must lie in (0, 1)")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.variant, self.dropout, self.batch_first = variant, dropout, batch_first
        self.bam_k, self.bam_sigma, self.bam_base = float(bam_k), float(bam_sigma), bam_base
        self.prior_alpha, self.prior_beta, self.prior_mu, self.prior_sigma = float(prior_alpha), float(prior_beta), float(prior_mu), float(prior_sigma)
        self.lgamma_1p_inv = math.lgamma(1.0 + 1.0 / bam_k)
        self.kl = None
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if variant == "hnas":
            logit = math.log(hybrid_init_u / (1.0 - hybrid_init_u))
            self.hybrid_logit = nn.Parameter(torch.full((num_heads,), logit, **factory))
        else:
            self.register_parameter("hybrid_logit", None)
        contextual = any(n.startswith("prior.") for n in _REGISTRY[variant]["parameters"]) if variant in _REGISTRY else False
        self.prior = ContextualPrior(num_heads, self.head_dim, prior_hidden, factory) if contextual else None
        self.weibull = variant in _REGISTRY and _REGISTRY[variant]["noise"] == "weibull"
        self.bayesian = variant in BAM
        # nn.MultiheadAttention's initialisation.
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None,
                average_attn_weights: bool = True, noise: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
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
        self.kl = None
        if self.bayesian:
            w = self._bam(z, allowed, k, noise)
        elif self.variant == "softmax":
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

    def _bam(self, z: Tensor, allowed: Tensor, keys: Tensor, noise: Optional[Tensor]) -> Tensor:
        """BAM's weights; in training mode sampled, with the KL term left in self.kl."""
        if not self.training:  # the mean of the random weights: the base normalizer's
            return softmax_weights(z, allowed) if self.bam_base == "softmax" else dnas_weights(z, allowed)
        if self.bam_base == "softmax":
            log_pi = z - masked_logsumexp(z, allowed, -1)
        else:
            log_xi = z - masked_logsumexp(z, allowed, -2)
            log_pi = log_xi - masked_logsumexp(log_xi, allowed, -1)
        weibull = self.weibull
        if noise is None:
            noise = torch.rand_like(z).clamp_min(1.1754943508222875e-38) if weibull else torch.randn_like(z)
        elif noise.shape != z.shape:
            raise ValueError("noise must be shaped like the weights (N, H, L, S)")
        if weibull:
            # S = lambda (-log(1 - eps))^(1/k), lambda = pi / Gamma(1 + 1/k)
            log_s = log_pi - self.lgamma_1p_inv + torch.log(-torch.log1p(-noise)) / self.bam_k
        else:
            # S = exp(mu + sigma eps), mu = log pi - sigma^2 / 2
            log_s = log_pi - self.bam_sigma ** 2 / 2 + self.bam_sigma * noise
        weights = softmax_weights(log_s, allowed)
        if self.variant == "bam-nokl":
            return weights
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        lp = torch.where(allowed, log_pi, zero)
        key_ok = allowed.any(-2, keepdim=True)
        log_psi = torch.zeros_like(lp)
        prior = self.prior
        if prior is not None:
            log_psi = torch.where(key_ok, prior(keys, allowed), zero)
        if weibull:
            if self.variant == "bam-wf":
                alpha = torch.full_like(lp, self.prior_alpha)
            else:
                alpha = torch.where(key_ok, self.prior_beta * torch.exp(log_psi), torch.ones((), dtype=z.dtype, device=z.device))
            beta = self.prior_beta
            # KL(Weibull(k, lambda) || Gamma(alpha, beta)), lambda Gamma(1 + 1/k) = pi
            log_lambda = lp - self.lgamma_1p_inv
            euler = 0.5772156649015329  # Euler-Mascheroni (TorchScript reads no module-level floats)
            kl = (euler * alpha / self.bam_k - alpha * log_lambda + math.log(self.bam_k) + beta * torch.exp(lp)
                  - euler - 1 - alpha * math.log(beta) + torch.lgamma(alpha))
        else:
            mu_p = torch.full_like(lp, self.prior_mu) if self.variant == "bam-lf" else log_psi
            mu_q = lp - self.bam_sigma ** 2 / 2
            s_p = self.prior_sigma
            kl = math.log(s_p / self.bam_sigma) + (self.bam_sigma ** 2 + (mu_q - mu_p) ** 2) / (2 * s_p ** 2) - 0.5
        kl = torch.where(allowed, kl.expand_as(z), zero)
        per_head = kl.sum((0, 2, 3)) / allowed.sum((0, 2, 3)).clamp(min=1).to(z.dtype)
        self.kl = per_head.mean()
        return weights
