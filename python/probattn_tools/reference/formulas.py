"""Plain PyTorch reference of probattn's attention variants, written from the formulas.

Sources: Ding et al. 2020, "Attention that does not Explain Away" (see docs/formulas.md
§1) and Vaswani et al. 2017 for multi-head attention. This file is written from those
formulas, not from the Rust code: masking here uses -inf and `torch.where` (with the usual
double-where so no NaN reaches a gradient), where the Rust uses a finite fill value.

Mask convention (PyTorch's nn.MultiheadAttention): True = excluded.
Shapes: q (B, H, S_q, d), k (B, H, S_k, d), v (B, H, S_k, d_v); weights (B, H, S_q, S_k).
"""

import math

import torch

# The normalizers below (masked_logsumexp .. hnas_weights) carry type annotations where an
# argument is not a tensor, so that torch.jit.script can compile them: python/probattn_tools/reference/mha.py
# builds its scriptable modules on these very functions.


def allowed_mask(batch, heads, s_q, s_k, key_padding_mask=None, query_padding_mask=None,
                 attn_mask=None, causal=False, device=None):
    """Boolean (B, H, S_q, S_k), True where query i may attend key j."""
    allowed = torch.ones(batch, heads, s_q, s_k, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.bool()[:, None, None, :]
    if query_padding_mask is not None:
        allowed = allowed & ~query_padding_mask.bool()[:, None, :, None]
    if attn_mask is not None:
        allowed = allowed & ~attn_mask.bool()
    if causal:
        # Key j is visible to query i when j <= i (top-left aligned, as SDPA's is_causal).
        i = torch.arange(s_q, device=device)[:, None]
        j = torch.arange(s_k, device=device)[None, :]
        allowed = allowed & (j <= i)
    return allowed


def masked_logsumexp(z, allowed, dim: int):
    """log sum_{allowed} exp(z) along dim (keepdim). Where nothing is allowed it returns 0, a
    harmless finite value: every entry it would normalize is excluded anyway."""
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    any_allowed = allowed.any(dim, keepdim=True)
    shift = torch.where(allowed, z, torch.tensor(float("-inf"), dtype=z.dtype)).amax(dim, keepdim=True)
    shift = torch.where(any_allowed, shift, zero).detach()
    z_safe = torch.where(allowed, z - shift, zero)
    total = torch.where(allowed, torch.exp(z_safe), zero).sum(dim, keepdim=True)
    total = torch.where(any_allowed, total, torch.ones_like(total))
    return torch.log(total) + shift


def exp_allowed(log_w, allowed):
    """exp on allowed entries, exactly 0 elsewhere (no gradient through excluded entries)."""
    zero = torch.zeros((), dtype=log_w.dtype, device=log_w.device)
    return torch.where(allowed, torch.exp(torch.where(allowed, log_w, zero)), zero)


def softmax_weights(z, allowed):
    """UNAS: pi_ij = exp(z_ij) / sum_j' exp(z_ij'), over allowed keys."""
    return exp_allowed(z - masked_logsumexp(z, allowed, -1), allowed)


def dnas_weights(z, allowed):
    """DNAS: xi_ij = exp(z_ij) / sum_i' exp(z_i'j) (each key over the queries), then
    pi_ij = xi_ij / sum_j' xi_ij' (each query over the keys), both over allowed entries."""
    log_xi = z - masked_logsumexp(z, allowed, -2)
    return softmax_weights(log_xi, allowed)


def sinkhorn_weights(z, allowed, iterations: int):
    """Sinkhorn-n: n times (each key over the queries, then each query over the keys)."""
    log_p = z
    for _ in range(iterations):
        log_p = log_p - masked_logsumexp(log_p, allowed, -2)
        log_p = log_p - masked_logsumexp(log_p, allowed, -1)
    return exp_allowed(log_p, allowed)


def hnas_weights(z, allowed, hybrid_logit):
    """HNAS: u * DNAS + (1 - u) * UNAS, u = sigmoid(logit) per head."""
    u = torch.sigmoid(hybrid_logit).to(z.dtype)[None, :, None, None]
    return u * dnas_weights(z, allowed) + (1 - u) * softmax_weights(z, allowed)


def normalize(variant, z, allowed, hybrid_logit=None):
    """Weights of the named variant: softmax, dnas, hnas, sinkhorn-N."""
    if variant in ("softmax", "unas"):
        return softmax_weights(z, allowed)
    if variant == "dnas":
        return dnas_weights(z, allowed)
    if variant == "hnas":
        if hybrid_logit is None:
            raise ValueError("hnas needs hybrid_logit")
        return hnas_weights(z, allowed, hybrid_logit)
    if variant.startswith("sinkhorn-"):
        return sinkhorn_weights(z, allowed, int(variant.split("-", 1)[1]))
    raise ValueError(f"unknown variant {variant!r}")


def attention(variant, q, k, v, allowed, hybrid_logit=None):
    """Scores q k^T / sqrt(d), normalized, mixing v. Returns (output, weights)."""
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    w = normalize(variant, z, allowed, hybrid_logit)
    return w @ v, w


def received_mass(weights):
    """sum_i pi_ij: (B, H, S_q, S_k) -> (B, H, S_k)."""
    return weights.sum(-2)


def multi_head_attention(params, query, key, value, num_heads, variant="softmax",
                         key_padding_mask=None, query_padding_mask=None, attn_mask=None,
                         causal=False):
    """Batch-first multi-head attention from the formulas, reading nn.MultiheadAttention's
    state-dict names. Returns (context (B, S_q, E), weights (B, H, S_q, S_k))."""
    batch, s_q, embed = query.shape
    s_k = key.shape[1]
    head_dim = embed // num_heads
    if "in_proj_weight" in params:
        w_q, w_k, w_v = params["in_proj_weight"].split(embed, dim=0)
    else:
        w_q, w_k, w_v = params["q_proj_weight"], params["k_proj_weight"], params["v_proj_weight"]
    if "in_proj_bias" in params:
        b_q, b_k, b_v = params["in_proj_bias"].split(embed, dim=0)
    else:
        b_q = b_k = b_v = None

    def project(x, w, b, length):
        y = x @ w.T
        if b is not None:
            y = y + b
        return y.reshape(batch, length, num_heads, head_dim).transpose(1, 2)

    q = project(query, w_q, b_q, s_q)
    k = project(key, w_k, b_k, s_k)
    v = project(value, w_v, b_v, s_k)
    allowed = allowed_mask(batch, num_heads, s_q, s_k, key_padding_mask, query_padding_mask,
                           attn_mask, causal, device=query.device)
    out, w = attention(variant, q, k, v, allowed, params.get("hybrid_logit"))
    merged = out.transpose(1, 2).reshape(batch, s_q, embed)
    context = merged @ params["out_proj.weight"].T
    if "out_proj.bias" in params:
        context = context + params["out_proj.bias"]
    return context, w


def additive_scores(params, query, key):
    """Bahdanau: z_ij = v . tanh(W_q q_i + W_k k_j + b). query (B, S_q, d_q), key (B, S_k, d_k)
    -> (B, 1, S_q, S_k)."""
    hq = query @ params["w_q.weight"].T
    hk = key @ params["w_k.weight"].T + params["w_k.bias"]
    hidden = torch.tanh(hq[:, :, None, :] + hk[:, None, :, :])
    return (hidden @ params["v.weight"].T)[..., 0][:, None]


def self_attentive_scores(params, h):
    """Lin et al. 2017: W_s2 tanh(W_s1 H^T), h (B, S, u) -> (B, 1, r, S)."""
    return (params["w_s2.weight"] @ torch.tanh(params["w_s1.weight"] @ h.transpose(1, 2)))[:, None]


# ---------------------------------------------------------------------------------------------
# Bayesian attention modules (Fan et al. 2020; docs/formulas.md §2).

EULER_GAMMA = 0.5772156649015329
BAM_VARIANTS = ("bam-nokl", "bam-lf", "bam-lc", "bam-wf", "bam-wc")


def log_weights(variant, z, allowed, hybrid_logit=None):
    """log(pi) of a deterministic variant, in the log domain so it stays finite where pi
    underflows. Values on excluded entries are meaningless."""
    if variant in ("softmax", "unas"):
        return z - masked_logsumexp(z, allowed, -1)
    if variant == "dnas":
        log_xi = z - masked_logsumexp(z, allowed, -2)
        return log_xi - masked_logsumexp(log_xi, allowed, -1)
    if variant == "hnas":
        logit = hybrid_logit.to(z.dtype)[None, :, None, None]
        log_d = log_weights("dnas", z, allowed)
        log_u = log_weights("softmax", z, allowed)
        return torch.logaddexp(torch.nn.functional.logsigmoid(logit) + log_d,
                               torch.nn.functional.logsigmoid(-logit) + log_u)
    if variant.startswith("sinkhorn-"):
        log_p = z
        for _ in range(int(variant.split("-", 1)[1])):
            log_p = log_p - masked_logsumexp(log_p, allowed, -2)
            log_p = log_p - masked_logsumexp(log_p, allowed, -1)
        return log_p
    raise ValueError(f"no log-weights for {variant!r}")


def contextual_log_psi(prior, keys, allowed):
    """log psi_j = log softmax_j(F2(ReLU(F1(k_j)))) per head, over keys some query may attend.
    keys (B, H, S_k, d) -> (B, H, 1, S_k)."""
    hidden = torch.relu(torch.einsum("bhsd,hmd->bhsm", keys, prior["prior.f1.weight"])
                        + prior["prior.f1.bias"][None, :, None, :])
    logits = torch.einsum("bhsm,hm->bhs", hidden, prior["prior.f2.weight"]) + prior["prior.f2.bias"][None, :, None]
    logits = logits[:, :, None, :]
    key_ok = allowed.any(-2, keepdim=True)
    return logits - masked_logsumexp(logits, key_ok, -1)


def bam_weights(variant, z, allowed, keys, noise, sample, cfg, prior=None, hybrid_logit=None):
    """BAM weights and KL. cfg: k, sigma, prior_alpha, prior_beta, prior_mu, prior_sigma, base.
    Without sampling: the base weights and no KL. Returns (weights, kl or None)."""
    base = cfg["base"]
    if not sample:
        return normalize(base, z, allowed, hybrid_logit), None
    weibull = variant in ("bam-nokl", "bam-wf", "bam-wc")
    k, sigma = cfg["k"], cfg["sigma"]
    log_pi = log_weights(base, z, allowed, hybrid_logit)
    if weibull:
        # S = lambda (-log(1 - eps))^(1/k), lambda = pi / Gamma(1 + 1/k)
        log_s = log_pi - math.lgamma(1 + 1 / k) + torch.log(-torch.log1p(-noise)) / k
    else:
        # S = exp(mu + sigma eps), mu = log pi - sigma^2 / 2
        log_s = log_pi - sigma ** 2 / 2 + sigma * noise
    weights = softmax_weights(log_s, allowed)
    if variant == "bam-nokl":
        return weights, None
    zero = torch.zeros((), dtype=z.dtype)
    lp = torch.where(allowed, log_pi, zero)
    key_ok = allowed.any(-2, keepdim=True)
    if variant == "bam-wf":
        alpha = torch.tensor(cfg["prior_alpha"], dtype=z.dtype)
    elif variant == "bam-wc":
        alpha = cfg["prior_beta"] * torch.exp(contextual_log_psi(prior, keys, allowed))
        alpha = torch.where(key_ok, alpha, torch.ones((), dtype=z.dtype))
    if weibull:
        beta = cfg["prior_beta"]
        # KL(Weibull(k, lambda) || Gamma(alpha, beta)), lambda Gamma(1 + 1/k) = pi
        log_lambda = lp - math.lgamma(1 + 1 / k)
        kl = (EULER_GAMMA * alpha / k - alpha * log_lambda + math.log(k) + beta * torch.exp(lp)
              - EULER_GAMMA - 1 - alpha * math.log(beta) + torch.lgamma(alpha))
    else:
        if variant == "bam-lf":
            mu_p = torch.tensor(cfg["prior_mu"], dtype=z.dtype)
        else:
            mu_p = torch.where(key_ok, contextual_log_psi(prior, keys, allowed), zero)
        mu_q = lp - sigma ** 2 / 2
        s_p = cfg["prior_sigma"]
        kl = math.log(s_p / sigma) + (sigma ** 2 + (mu_q - mu_p) ** 2) / (2 * s_p ** 2) - 0.5
    kl = torch.where(allowed, kl.expand_as(z), zero)
    per_head = kl.sum((0, 2, 3)) / allowed.sum((0, 2, 3)).clamp(min=1).to(z.dtype)
    return weights, per_head.mean()


# ---------------------------------------------------------------------------------------------
# Repulsive attention (An et al. 2020; docs/formulas.md §3).

def svgd_direction(theta, grad, alpha, stepsize, method="svgd", beta=1.0, xi=None, bandwidth=None):
    """The replaced gradient of one particle set: theta, grad (n, D) -> (n, D).
    g~_i = stepsize * (1/n) sum_j [K_ij g_j - alpha K_ij (theta_i - theta_j) 2/h]  (SVGD)
    SPOS adds beta g_i - sqrt(2 beta / stepsize) xi_i median|g| before the stepsize factor.
    K_ij = exp(-|theta_i - theta_j|^2 / h), h = median(squared distances) / log(n + 1) (the lower
    median of the n x n matrix, zero diagonal included) unless a fixed bandwidth is given."""
    n = theta.shape[0]
    diff = theta[:, None, :] - theta[None, :, :]  # (n, n, D): theta_i - theta_j
    d2 = (diff ** 2).sum(-1)
    h = torch.median(d2.reshape(-1)) / math.log(n + 1) if bandwidth is None else torch.tensor(bandwidth, dtype=theta.dtype)
    h = torch.clamp(h, min=1e-30)
    kernel = torch.exp(-d2 / h)
    phi = (kernel @ grad - alpha * (kernel[:, :, None] * diff).sum(1) * 2 / h) / n
    if method == "spos":
        phi = phi + beta * grad - math.sqrt(2 * beta / stepsize) * xi * torch.median(grad.abs())
    return stepsize * phi
