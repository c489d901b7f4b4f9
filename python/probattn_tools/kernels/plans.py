"""Triton kernels of the deterministic plans (softmax, DNAS, and any plan of theirs with another
score scale): attention without the (S_q, S_k) matrix, one (query block × key block) tile on chip
at a time with online log-sum-exps, so that only O(S) statistics reach global memory.

A plan's weights are `p_ij = exp(z_ij − c_j − r_i)` over the allowed entries, with
`z_ij = s · q_i·k_j`, `s = score_scale / sqrt(d)` (docs/formulas.md; PAPER-NOTES §5):
- `sweeps = 0` (softmax): `c = 0`, `r_i = LSE_j z_ij`;
- `sweeps = 1` (DNAS): `c_j = LSE_i z_ij` over the queries (the column pass), then
  `r_i = LSE_j (z_ij − c_j)` (the row pass);
- hybrid (HNAS): `u·p_DNAS + (1 − u)·p_softmax` per head, `u = sigmoid(logit)`, both row passes'
  accumulators kept in one pass over the tiles (`hybrid_attention`);
- `sweeps = N ≥ 2` (Sinkhorn-N): a column and a row potential per sweep (below, `_sink_reduce`).

The kernels:
- `_column_pass`: per key, `c_j` over the queries; in a forward with a backward to follow, also
  the queries' column mean `Q̄_j = Σ_i exp(z_ij − c_j) q_i` (the column weights as the values);
- `_row_pass`: the output `O = p v` and `r_i`, with `c` subtracted (none for softmax);
- `_key_pass` (backward): per key block over the queries, `dV = pᵀ dO`, `g_j = Σ_i dS¹_ij` and
  `dK`, with DNAS's column correction `−s·g_j·Q̄_j`; and the received mass `Σ_i p_ij` when asked.
  Over softmax's base (no sweeps) it also adds each tile's share of dQ, `s·dS¹ k`, by atomic adds;
- `_query_pass` (backward): `dQ`, with the correction `dz_ij = dS¹_ij − exp(z_ij − c_j) g_j`;
  over softmax's base only where libtorch's deterministic algorithms are asked for (the atomic
  adds' order, and so dQ's last bits, varies from run to run).

Here `dS¹ = p ∘ (dO vᵀ − D)`, `D_i = Σ_d dO_id O_id`: FlashAttention-2's recomputed backward;
the column correction is the gradient through `c_j` (one extra term in each backward pass).

Masks (`Masks`): key padding `(B, S_k)` and query padding `(B, S_q)` (True = excluded), a boolean
pattern broadcastable to `(B, H, S_q, S_k)` (True = takes part, as SDPA's `attn_mask`; read
through stride-0 views, never expanded in memory, its wholly excluded tiles skipped), an additive
float mask added to the scores before any normalization (as SDPA's float `attn_mask`; -inf
excludes a pair), and causal (top-left, `j ≤ i`, as SDPA's `is_causal`; refused for plans with
sweeps: a column sweep reads every query).
Grouped key/value heads (GQA) by index: query head `h` reads key/value head `h // (H / H_kv)`, and
the key pass sums the group's gradients in one program, without atomics or copies. Inputs in
bfloat16 or float16 take float32 products and statistics; float32 takes float32; float64 takes
float64 (the interpreter's and the tests' precision). A row with no allowed key gets a zero output
and zero gradients; a key no allowed query sees receives nothing.

BAM's sampling over these plans (`bam_attention`, `Sampling`) draws its noise inside the kernels
and reduces its KL term there (docs/kernels.md).

The kernels live beside this file: `tiles` (what every kernel shares), `passes` (the column, row,
key and query passes), `sinkhorn` (Sinkhorn-N's passes) and `bam` (BAM's draws and KL term); this
module launches them and wraps them in autograd functions.

`TRITON_INTERPRET=1` runs these kernels on the CPU (the tests do: python/tests/test_kernels.py).
"""

import contextlib
import copy
import inspect
import math
import time

import torch
import triton
import triton.language as tl

from probattn_tools.kernels.bam import (LinearKl, Sampling, _prior_values, _seed_words, counter_noise,  # noqa: F401
                                        linear_kl)
from probattn_tools.kernels.interpreter import patch_once_per_launch
from probattn_tools.kernels.passes import _column_pass, _key_pass, _query_pass, _row_pass
from probattn_tools.kernels.settings import TRANSPOSE_KEYS, atomic_dq, kernel_key
from probattn_tools.kernels.sinkhorn import _sink_key_grads, _sink_query_grads, _sink_reduce

# Under Triton's interpreter (the tests' CPU runs) only: the language patched once per helper and
# launch, not on every call (`kernels.interpreter`).
patch_once_per_launch()

# ---------------------------------------------------------------------------------------------
# The launches, and autograd functions over them.

# The per-key statistics (B, H, S_k) are laid out with each (batch, head) row padded to whole
# blocks of KEY_BLOCK keys, so that the passes that loop over key blocks read them a block at a
# time without a bound (`tiles._key_block`): a column statistic's padding is +inf, the others'
# 0. A launch's key blocks must divide it (`_Call.prepared`).
KEY_BLOCK = 256


def padded_keys(s_k):
    """S_k rounded up to whole blocks of KEY_BLOCK keys: the per-key statistics' row length."""
    return -(-s_k // KEY_BLOCK) * KEY_BLOCK


_ACC = {torch.float64: tl.float64, torch.float32: tl.float32, torch.bfloat16: tl.float32, torch.float16: tl.float32}
# The statistics' dtype (potentials, row statistics, g, D, the received mass).
_STATS = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
torch.float16: torch.float32}


class Config:
    """Block shapes and launch settings (the tuning knobs; the tests use small blocks): one setting
    for every kernel, and `kernels`, {settings.kernel_key: (block_m, block_n, num_warps,
    num_stages)}, for kernels with their own, as a tuning table's entry holds them. A
    specialization that reads the block map of a boolean mask takes the common setting, so that
    one map serves the call (`kernels.settings`). `transpose_keys`: whether the key pass forms its
    tiles (keys × queries) or (queries × keys) (`_key_pass`'s TRANSPOSE; the build compiles
    `settings.TRANSPOSE_KEYS`)."""

    def __init__(self, block_m=64, block_n=64, num_warps=4, num_stages=2, kernels=None,
                 transpose_keys=TRANSPOSE_KEYS):
        self.block_m, self.block_n, self.num_warps, self.num_stages = block_m, block_n, num_warps, num_stages
        self.kernels = {k: tuple(v) for k, v in (kernels or {}).items()}
        self.transpose_keys = bool(transpose_keys)

    def of(self, name, constexprs):
        """(block_m, block_n, num_warps, num_stages) of a launch of kernel `name` with `constexprs`."""
        own = None if constexprs.get("HAS_MASK") else self.kernels.get(kernel_key(name, constexprs))
        return own or (self.block_m, self.block_n, self.num_warps, self.num_stages)

    def widest_query_block(self):
        """The largest block_m any kernel launches with."""
        return max([self.block_m] + [s[0] for s in self.kernels.values()])


def _block_dim(n):
    """A head dimension's block: the next power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype):
    # float32 products in TF32 only where libtorch allows it, as its own kernels do.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32" if dtype == torch.float32 else "ieee"


def _check(q, k, v, sweeps, causal):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be (B, H, S, d), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _ACC or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one of {sorted(str(t) for t in _ACC)}, "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, _, d), (bk, hk, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if (bk, dk) != (b, d) or (bv, hv, sv) != (bk, hk, sk):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if hk < 1 or h % hk:
        raise ValueError(f"the query heads ({h}) must be a multiple of the key/value heads ({hk})")
    if not isinstance(sweeps, int) or sweeps < 0:
        raise ValueError(f"sweeps must be a whole number of column/row sweeps, 0 or more, got {sweeps!r}")
    if causal and sweeps:
        raise ValueError("a causal mask with a column sweep would let later queries change earlier ones' weights")


class Masks:
    """Where attention is allowed: `key_padding_mask (B, S_k)` and `query_padding_mask (B, S_q)`
    (boolean, True = excluded, as nn.MultiheadAttention's), `allowed_mask` (boolean, True = takes
    part, as SDPA's attn_mask; broadcastable to (B, H, S_q, S_k), read through stride-0 views),
    `additive` (a float mask added to the scores before any normalization, as SDPA's float
    attn_mask: ALiBi, relative biases; -inf excludes a pair; no gradient flows into it) and
    `causal` (top-left, j ≤ i)."""

    def __init__(self, key_padding_mask=None, query_padding_mask=None, allowed_mask=None, causal=False, additive=None):
        self.key_padding_mask, self.query_padding_mask = key_padding_mask, query_padding_mask
        self.allowed_mask, self.causal, self.additive = allowed_mask, causal, additive


def _padding(mask, batch, length, name, device):
    if mask is None:
        return torch.zeros(1, dtype=torch.uint8, device=device), 0, False
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (batch, length):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a boolean tensor of shape ({batch}, {length}), got {got}")
    mask = mask.to(device=device, dtype=torch.uint8).contiguous()
    return mask, mask.stride(0), True


def _pattern(mask, shape, block_m, block_n, device):
    """The pattern as uint8 broadcast to `shape` (B, H, S_q, S_k) through stride-0 views, and its
    block map: (B, H, ⌈S_q / block_m⌉, ⌈S_k / block_n⌉), nonzero where a tile holds an allowed
    entry (formed on the pattern's own dimensions, then broadcast the same way)."""
    none = torch.zeros(1, dtype=torch.uint8, device=device)
    if mask is None:
        return none, (0, 0, 0, 0), none, (0, 0, 0, 0), False
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() > 4:
        got = f"{mask.dtype} of rank {mask.dim()}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"allowed_mask must be a boolean tensor broadcastable to {tuple(shape)}, got {got}")
    own = mask.to(device=device, dtype=torch.uint8)
    own = own.reshape((1,) * (4 - own.dim()) + tuple(own.shape))
    try:
        wide = own.expand(*shape)
    except RuntimeError:
        raise ValueError(f"allowed_mask of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None
    s_q, s_k = shape[2], shape[3]
    n_m, n_n = triton.cdiv(s_q, block_m), triton.cdiv(s_k, block_n)
    tiles = own.expand(*own.shape[:2], s_q, s_k)
    tiles = torch.nn.functional.pad(tiles, (0, n_n * block_n - s_k, 0, n_m * block_m - s_q))
    blocks = tiles.reshape(*own.shape[:2], n_m, block_m, n_n, block_n).amax(dim=(3, 5))
    blocks = blocks.expand(shape[0], shape[1], n_m, n_n)
    return wide, wide.stride(), blocks, blocks.stride(), True


def _additive(mask, shape, dtype, device):
    """The additive mask in the statistics' dtype, broadcast to `shape` through stride-0 views."""
    if mask is None:
        return torch.zeros(1, dtype=dtype, device=device), (0, 0, 0, 0), False
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.dim() > 4:
        got = f"{mask.dtype} of rank {mask.dim()}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"additive must be a floating-point tensor broadcastable to {tuple(shape)}, got {got}")
    if mask.requires_grad:
        raise ValueError("additive: the kernels compute no gradient for the additive mask; pass it detached")
    if bool((torch.isnan(mask) | (mask == float("inf"))).any()):  # one synchronisation, not two
        raise ValueError("additive holds NaN or +inf; only finite values and -inf (excluded) are taken")
    own = mask.to(device=device, dtype=dtype)
    own = own.reshape((1,) * (4 - own.dim()) + tuple(own.shape))
    try:
        wide = own.expand(*shape)
    except RuntimeError:
        raise ValueError(f"additive of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None
    return wide, wide.stride(), True


def _aligned(x, width):
    """x contiguous, 16-byte aligned and `width` wide in its last dimension, zero columns added:
    the kernels are compiled knowing that the inputs' head dimensions and strides are multiples of
    16 and their pointers aligned (`aot.ALIGNED`), which lets them load whole 16-byte pieces."""
    if x.shape[-1] != width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _width(n):
    """A head dimension as the kernels take it: the next multiple of 16."""
    return -(-n // 16) * 16


def _narrow(x, n):
    """The first n columns of a padded result (itself where there is no padding)."""
    return x if x.shape[-1] == n else x[..., :n].contiguous()


def _strides(shape):
    """The strides of a contiguous tensor of `shape`, whatever a size-1 dimension's stride in a
    given tensor (the kernels take them as multiples of 16)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


class _Call:
    """One attention call: its inputs contiguous, aligned and padded to head dimensions that are
    multiples of 16 (zero columns, which change no score and no output column; results are cut
    back to `d` and `d_v`), its masks as kernel arguments, and the arguments every kernel shares,
    passed by name (each kernel takes the ones it declares)."""

    def __init__(self, q, k, v, sweeps, score_scale, masks, config, sampling=None, prior=None, mix_logit=None):
        _check(q, k, v, sweeps, masks.causal)
        self.d_given, self.dv_given = q.shape[-1], v.shape[-1]
        self.q, self.k, self.v = (_aligned(q, _width(self.d_given)), _aligned(k, _width(self.d_given)),
                                  _aligned(v, _width(self.dv_given)))
        self.config = config or Config()
        (b, h, s_q, d), (_, h_kv, s_k, _), dv = self.q.shape, self.k.shape, self.v.shape[-1]
        self.shape = (b, h, h_kv, s_q, s_k, d, dv)
        self.stats = _STATS[q.dtype]
        dev = q.device
        qpad, sqp, has_qpad = _padding(masks.query_padding_mask, b, s_q, "query_padding_mask", dev)
        kpad, skp, has_kpad = _padding(masks.key_padding_mask, b, s_k, "key_padding_mask", dev)
        pattern, (smb, smh, smm, smn), blocks, (sbb, sbh, sbm, sbn), has_mask = _pattern(
            masks.allowed_mask, (b, h, s_q, s_k), self.config.block_m, self.config.block_n, dev)
        bias, (sab, sah, sam, san), has_bias = _additive(masks.additive, (b, h, s_q, s_k), self.stats, dev)
        qs, ks, vs = _strides(self.q.shape), _strides(self.k.shape), _strides(self.v.shape)
        self.sampling = sampling
        if sampling is not None and s_k * self.config.widest_query_block() > 2 ** 32:
            raise ValueError(f"BAM's draws take at most 2^32 / block_m keys (a tile's positions then have at most two "
                             f"high words), got {s_k} keys with block_m {self.config.widest_query_block()}")
        self.kl = sampling is not None and sampling.kl is not None
        if self.kl and prior is None:
            raise ValueError("a KL term needs the prior's per-key values (prior=)")
        dummy = torch.zeros(1, dtype=self.stats, device=dev)
        a, (spb, sph, spn) = _prior_values(prior, (b, h, s_q, s_k), self.stats, dev) if self.kl else (dummy, (0, 0, 0))
        draws = sampling.source((b, h, s_q, s_k), self.stats, dev) if sampling else _seed_words(0, dev)
        self.mix = mix_logit is not None
        # Whether a backward may follow (the caller sets it from its inputs' need of gradients):
        # DNAS's column pass then leaves the queries' column mean for the key pass (`qbar`).
        self.grads, self.qbar = False, None
        self.args = dict(
            Q=self.q, K=self.k, V=self.v, QPAD=qpad, KPAD=kpad, MASK=pattern, BLOCKS=blocks, BIAS=bias,
            DRAWS=draws, PRIOR=a, RB=dummy, KS=dummy, TROW=dummy, DKL=dummy, DA=dummy, MIX=False, ROWS=False,
            RD=dummy, RS=dummy, LOGU=dummy, RHO_D=dummy, RHO_S=dummy, GU=dummy, SHARES=dummy, SHARE=False, ADD=False,
            ATOMIC_DQ=False, DQ=dummy,
            QBAR=torch.zeros(1, dtype=self.q.dtype, device=dev), CONTEXT=False, stride_qbarb=h * s_k * d, stride_qbarh=s_k * d, stride_qbars=d,
            stride_pb=spb, stride_ph=sph, stride_pn=spn,
            NOISE=sampling.code() if sampling else 0, KL=Sampling.NOISES[sampling.kl] if self.kl else 0,
            DRAW64=self.stats == torch.float64,
            stride_qb=qs[0], stride_qh=qs[1], stride_qs=qs[2], stride_kb=ks[0], stride_kh=ks[1], stride_ks=ks[2],
            stride_vb=vs[0], stride_vh=vs[1], stride_vs=vs[2],
            # outputs, gradients and statistics are contiguous, shaped as what they belong to
            stride_ob=h * s_q * dv, stride_oh=s_q * dv, stride_os=dv, stride_dob=h * s_q * dv, stride_doh=s_q * dv,
            stride_dos=dv, stride_dqb=qs[0], stride_dqh=qs[1], stride_dqs=qs[2], stride_dkb=ks[0], stride_dkh=ks[1],
            stride_dks=ks[2], stride_dvb=vs[0], stride_dvh=vs[1], stride_dvs=vs[2],
            stride_cb=h * padded_keys(s_k), stride_ch=padded_keys(s_k), stride_rb=h * s_q, stride_rh=s_q,
            stride_t=b * h * padded_keys(s_k), stride_tr=b * h * s_q,
            stride_qpad=sqp, stride_kpad=skp, stride_mb=smb, stride_mh=smh, stride_mm=smm, stride_mn=smn,
            stride_bb=sbb, stride_bh=sbh, stride_bm=sbm, stride_bn=sbn, stride_ab=sab, stride_ah=sah, stride_am=sam,
            stride_an=san, HAS_BIAS=has_bias,
            H=h, H_KV=h_kv, GROUP=h // h_kv, S_Q=s_q, S_K=s_k, D=d, DV=dv,
            SCALE=torch.tensor([score_scale / math.sqrt(self.d_given), sampling.scale if sampling else 0.0], dtype=self.stats,
                               device=dev),
            SWEEPS=min(sweeps, 1), HAS_QPAD=has_qpad, HAS_KPAD=has_kpad, HAS_MASK=has_mask, CAUSAL=masks.causal,
            ACC=_ACC[q.dtype], DOT=_dot_precision(q.dtype), BLOCK_M=self.config.block_m, BLOCK_N=self.config.block_n,
            BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv), TRANSPOSE=self.config.transpose_keys)

        # The KL part's terms that are sums over the logits, from sums over the sequence (`linear_kl`).
        self.linear = None
        if linear_kl(self.args["KL"], self.args["SWEEPS"], self.mix, has_mask, has_bias, masks.causal):
            self.linear = LinearKl(self.q, self.k, a, qpad if has_qpad else None, kpad if has_kpad else None,
                                   masks.causal, score_scale / math.sqrt(self.d_given), self.stats, self.args["KL"])

        if self.mix:  # log u and log(1 − u) per head
            logit = mix_logit.detach().to(device=dev, dtype=self.stats)
            self.args["LOGU"] = torch.stack([torch.nn.functional.logsigmoid(logit),
                                             torch.nn.functional.logsigmoid(-logit)], -1).contiguous()

    def stat(self, keys, *lead, pad=0.0):
        """Zeros for a per-key (B, H, S_k) or per-query (B, H, S_q) statistic, after `lead`
        dimensions; a per-key one padded to whole key blocks (`padded_keys`) with `pad`."""
        b, h, _, s_q, s_k, _, _ = self.shape
        out = torch.zeros(*lead, b, h, padded_keys(s_k) if keys else s_q, dtype=self.stats, device=self.q.device)
        if keys:
            out[..., s_k:] = pad
        return out

    def grid(self, keys, heads):
        """A launch's grid, (blocks of keys or of queries, B × query or key/value heads): resolved in
        `launch`, with the blocks of the kernel's setting."""
        return keys, heads

    def prepared(self, kernel, grid, **extra):
        """A launch's arguments (the call's with `extra`, and the blocks of the kernel's setting),
        its grid resolved (`grid`), its (num_warps, num_stages) and its `specialization`."""
        args = {**self.args, **extra}
        missing = [n for n in kernel.arg_names if n not in args]
        assert not missing, f"{kernel.arg_names}: no value for {missing}"
        name, constexprs = specialization(kernel, args)
        block_m, block_n, num_warps, num_stages = self.config.of(name, dict(constexprs))
        if KEY_BLOCK % block_n:
            raise ValueError(f"{name}: key blocks of {block_n} do not divide the per-key statistics' blocks of "
                             f"{KEY_BLOCK} keys (plans.KEY_BLOCK)")
        args.update(BLOCK_M=block_m, BLOCK_N=block_n)
        b, h, h_kv, s_q, s_k, _, _ = self.shape
        keys, heads = grid
        grid = (triton.cdiv(s_k, block_n) if keys else triton.cdiv(s_q, block_m), b * (h if heads == "query" else h_kv))
        return args, grid, (num_warps, num_stages), (name, constexprs)

    def launch(self, kernel, grid, **extra):
        args, grid, (num_warps, num_stages), (name, constexprs) = self.prepared(kernel, grid, **extra)
        if LAUNCHED is not None:
            LAUNCHED.add((name, constexprs))
        if LAUNCHES is not None:
            LAUNCHES.append(_launch_record(kernel, grid, args))
        timed = TIMES is not None
        if timed:
            start = _clock(self.q.device)
        kernel[grid](**{n: args[n] for n in kernel.arg_names}, num_warps=num_warps, num_stages=num_stages)
        if timed:
            TIMES.append((kernel_key(name, dict(constexprs)), start, _clock(self.q.device)))


# The specializations launched while a caller collects them (`launched()`), else None.
LAUNCHED = None
# (kernel_key, start, end) of each launch while a caller times them (`timed()`), else None.
TIMES = None
# Each launch in order, in full, while a caller records them (`launches()`), else None.
LAUNCHES = None
# Constexprs that follow from the dtype, the head dimensions and the configuration, which an
# ahead-of-time build sets from its own arguments: not part of a specialization's key.
_DERIVED = {"ACC", "DOT", "DRAW64", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "TRANSPOSE"}


def specialization(kernel, args):
    """A launch's key, as `kernels.aot` names what it compiles: the kernel's name and its
    constexpr values but those that follow from the dtype, head dimensions and blocks."""
    fn = kernel.fn  # the Python function, compiled (JITFunction) or interpreted alike
    names = [n for n, p in inspect.signature(fn).parameters.items() if p.annotation is tl.constexpr]
    return fn.__name__, tuple(sorted((n, args[n]) for n in names if n not in _DERIVED))


def _clock(device):
    """A point in time on `device`'s stream: a recorded CUDA event, or on the CPU (the
    interpreter runs a kernel in the calling thread) perf_counter's seconds."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


@contextlib.contextmanager
def timed():
    """Times each launch inside the block (`with plans.timed() as times:`): on leaving it, `times`
    maps each `settings.kernel_key` launched to its total milliseconds (CUDA events around each
    launch on a GPU, the interpreter's wall time on the CPU)."""
    global TIMES
    previous, TIMES = TIMES, []
    totals = {}
    try:
        yield totals
        if any(not isinstance(start, float) for _, start, _ in TIMES):
            torch.cuda.synchronize()
        for key, start, end in TIMES:
            ms = (end - start) * 1e3 if isinstance(start, float) else start.elapsed_time(end)
            totals[key] = totals.get(key, 0.0) + ms
    finally:
        TIMES = previous


@contextlib.contextmanager
def launched():
    """Collects the specializations launched inside the block (`with plans.launched() as seen:`):
    a set of `specialization` keys."""
    global LAUNCHED
    previous, LAUNCHED = LAUNCHED, set()
    try:
        yield LAUNCHED
    finally:
        LAUNCHED = previous


def _launch_record(kernel, grid, args):
    """One launch as the fused CUDA route's dry run describes its own (probattn-sys/csrc/fused_cuda.cpp):
    the kernel, its specialization, the grid, every integer argument and every tensor's shape and
    dtype, by parameter name."""
    fn = kernel.fn
    params = [(n, p.annotation is tl.constexpr) for n, p in inspect.signature(fn).parameters.items()]
    ints = {n: int(args[n]) for n, const in params if not const and not isinstance(args[n], torch.Tensor)}
    tensors = {n: [list(args[n].shape), str(args[n].dtype).replace("torch.", "")] for n, const in params
               if not const and isinstance(args[n], torch.Tensor)}
    return {"kernel": fn.__name__, "key": {n: int(v) for n, v in specialization(kernel, args)[1]}, "grid": list(grid),
            "ints": ints,
            "tensors": tensors}


@contextlib.contextmanager
def launches():
    """Records every launch inside the block in order (`with plans.launches() as seen:`), as
    `_launch_record` describes it."""
    global LAUNCHES
    previous, LAUNCHES = LAUNCHES, []
    try:
        yield LAUNCHES
    finally:
        LAUNCHES = previous


def _forward(call, sweeps, hybrid=False):
    """Statistics and outputs of a call: (out, c, r) for 0 or 1 sweeps, with (out_softmax,
    r_softmax) after them when hybrid; (out, CS, RS) potentials per sweep for N ≥ 2. With a KL
    term, the row pass's (RB, KS, TROW) are left in `call.kl_rows`."""
    _, _, _, s_q, _, _, dv = call.shape
    b, h = call.shape[0], call.shape[1]
    out = torch.empty(b, h, s_q, dv, dtype=call.q.dtype, device=call.q.device)
    kl_rows = (call.stat(False), call.stat(False), call.stat(False)) if call.kl else ()
    call.kl_rows = kl_rows
    kl_args = dict(zip(("RB", "KS", "TROW"), kl_rows))
    if sweeps <= 1:
        c, r = call.stat(True, pad=math.inf), call.stat(False)
        if sweeps:
            if call.grads:
                b, h, _, _, s_k, d, _ = call.shape
                call.qbar = torch.empty(b, h, s_k, d, dtype=call.q.dtype, device=call.q.device)
            call.launch(_column_pass, call.grid(True, "query"), C=c, QBAR=call.qbar if call.grads else call.args["QBAR"],
                        CONTEXT=call.grads)
        if call.mix:  # BAM over HNAS: DNAS's and softmax's row statistics first, then the mixture's row pass
            rd, rs = call.stat(False), call.stat(False)
            # Softmax's "potential" is 0, but +inf where c_j is (a key no query sees, a padded one
            # among them, and past S_k), which carries key padding into the reduction as c does.
            for cpot, rows in ((c, rd), (torch.where(torch.isposinf(c), c, 0.0), rs)):
                call.launch(_sink_reduce, call.grid(False, "query"), RPOT=r, CPOT=cpot, COEF=cpot, OUT=rows,
                            COLUMNS=False, LSE=True, HAS_RPOT=False)
            call.mix_rows = (rd, rs)
            kl_args.update(RD=rd, RS=rs, MIX=True)
        out2, r2 = (torch.empty_like(out), call.stat(False)) if hybrid else (out, r)
        call.launch(_row_pass, call.grid(False, "query"), C=c, O=out, R=r, O2=out2, R2=r2, HYBRID=hybrid, **kl_args)
        if call.linear is not None:
            for held, formed in zip(kl_rows[1:], call.linear.rows(kl_rows[0])):
                held.copy_(formed)
        return (out, c, r, out2, r2) if hybrid else (out, c, r)
    cs, rs = call.stat(True, sweeps, pad=math.inf), call.stat(False, sweeps)
    for t in range(sweeps):
        call.launch(_sink_reduce, call.grid(True, "query"), RPOT=rs[t - 1] if t else rs[0], CPOT=cs[t], COEF=cs[t],
                    OUT=cs[t], COLUMNS=True, LSE=True, HAS_RPOT=t > 0)
        if t < sweeps - 1:
            call.launch(_sink_reduce, call.grid(False, "query"), RPOT=rs[t], CPOT=cs[t], COEF=rs[t], OUT=rs[t],
                        COLUMNS=False, LSE=True, HAS_RPOT=False)
    # The last row pass is DNAS's with the last column potential as its statistic.
    call.launch(_row_pass, call.grid(False, "query"), C=cs[-1], O=out, R=rs[-1], O2=out, R2=rs[-1], HYBRID=False,
                SWEEPS=1, **kl_args)
    return out, cs, rs


def _received_mass(call, c, r):
    """Σ_i p_ij per query head, (B, H, S_k), from a forward's last column and row statistics."""
    mass, dummy = call.stat(True), call.q
    mix = dict(RD=call.mix_rows[0], RS=call.mix_rows[1], MIX=True) if call.mix else {}
    call.launch(_key_pass, call.grid(True, "kv"), C=c, R=r, DO=dummy, DELTA=r, DK=call.k, DV_OUT=call.v, G=mass,
                MASS=mass, GRADS=False, KL=0, **mix)
    return mass[..., :call.shape[4]].contiguous()


def _row_dots(do, out, dtype):
    """D_i = Σ_d dO_id O_id (B, H, S) in `dtype`, the products formed exactly in one buffer of that
    dtype (not copies of dO and O in it beside their product)."""
    return torch.zeros(out.shape, dtype=dtype, device=out.device).addcmul_(do, out).sum(-1)


def _backward(call, sweeps, out, stats, grad_out, kl=None, mix=None, branch=None):
    """(dq, dk, dv) by recomputation, for the statistics `_forward` returned. `kl`: (RB, KS, dkl,
    da) of a KL term, dkl (B, H) the gradient in its part T; the prior's gradient is written to
    da (B, H, S_k). None: no KL term's gradient. `mix` (BAM over HNAS): (RD, RS, gu), the
    forward's row statistics and a (B, H, S_q) tensor for the gate's gradient per row. `branch`
    (one of HNAS's): (shares (H,), its D_i, (dq, dk, dv), add): the passes take each head's share
    of dO (`share·dO`, never formed) and write their gradients to those tensors, or add them to
    theirs with `add`."""
    do = _aligned(grad_out, call.shape[6])  # as wide as the padded output
    kl_args = dict(KL=0) if kl is None else dict(zip(("RB", "KS", "DKL", "DA"), kl))
    if branch is None:
        delta = _row_dots(do, out, call.stats)
        dq, dk, dv = torch.empty_like(call.q), torch.empty_like(call.k), torch.empty_like(call.v)
    else:
        shares, delta, (dq, dk, dv), add = branch
        kl_args.update(SHARES=shares, SHARE=True, ADD=add)
    if sweeps <= 1:
        c, r = stats
        g = call.stat(True)
        if mix is not None:
            rho_d, rho_s = call.stat(False), call.stat(False)
            kl_args.update(RD=mix[0], RS=mix[1], RHO_D=rho_d, RHO_S=rho_s, MIX=True)
            call.launch(_query_pass, call.grid(False, "query"), C=c, R=r, DO=do, DELTA=delta, G=g, DQ=dq, GU=mix[2],
                        ROWS=True, **kl_args)
        if call.args["SWEEPS"] and call.qbar is None:
            raise RuntimeError("DNAS's backward needs the queries' column mean of its forward: the forward ran "
                               "without a backward in view (call.grads)")
        qbar = call.qbar if call.args["SWEEPS"] else call.args["QBAR"]
        dq_term = None
        if call.linear is not None and kl is not None:  # the KL part's linear terms (`LinearKl`)
            qbar, da, dq_term = call.linear.grads(kl[0], kl[2])
            kl[3][..., :call.shape[4]] = da
        key = dict(C=c, R=r, DO=do, DELTA=delta, DK=dk, DV_OUT=dv, G=g, MASS=g, QBAR=qbar, GRADS=True, **kl_args)
        atomic = atomic_dq(str(call.q.dtype).replace("torch.", ""), max(call.shape[5:]))
        if (call.args["SWEEPS"] or mix is not None or branch is not None or not atomic
                or torch.are_deterministic_algorithms_enabled()):
            call.launch(_key_pass, call.grid(True, "kv"), **key)
            call.launch(_query_pass, call.grid(False, "query"), C=c, R=r, DO=do, DELTA=delta, G=g, DQ=dq, **kl_args)
        else:  # softmax's base (settings.atomic_dq): dQ added tile by tile from the key pass, in float32
            acc = torch.zeros(call.q.shape, dtype=call.stats, device=call.q.device)
            if dq_term is not None:
                acc += dq_term
            call.launch(_key_pass, call.grid(True, "kv"), **dict(key, DQ=acc, ATOMIC_DQ=True))
            dq.copy_(acc)
        return _given(call, dq, dk, dv)
    cs, rs = stats
    gc, gr, g = torch.zeros_like(cs), torch.zeros_like(rs), call.stat(True)
    common = dict(CS=cs, RS=rs, GC=gc, GR=gr, DO=do, DELTA=delta, DQ=dq, DK=dk, DV_OUT=dv, G=g, N=sweeps, **kl_args)
    call.launch(_sink_key_grads, call.grid(True, "query"), STAGE=0, **common)
    gc[-1] = -g
    for t in range(sweeps - 2, -1, -1):
        call.launch(_sink_reduce, call.grid(False, "query"), RPOT=rs[t], CPOT=cs[t + 1], COEF=gc[t + 1], OUT=gr[t],
                    COLUMNS=False, LSE=False, HAS_RPOT=True)
        call.launch(_sink_reduce, call.grid(True, "query"), RPOT=rs[t], CPOT=cs[t], COEF=gr[t], OUT=gc[t],
                    COLUMNS=True, LSE=False, HAS_RPOT=True)
    if torch.are_deterministic_algorithms_enabled():  # dQ in a pass of its own, forming each tile's dz again
        call.launch(_sink_key_grads, call.grid(True, "kv"), STAGE=1, **common)
        call.launch(_sink_query_grads, call.grid(False, "query"), **common)
    else:  # dQ added tile by tile from the dK/dV stage, in the statistics' dtype
        acc = torch.zeros(call.q.shape, dtype=call.stats, device=call.q.device)
        call.launch(_sink_key_grads, call.grid(True, "kv"), STAGE=1, **dict(common, DQ=acc, ATOMIC_DQ=True))
        dq.copy_(acc)
    return _given(call, dq, dk, dv)


def _given(call, dq, dk, dv):
    """The gradients cut back to the head dimensions the call was given."""
    return _narrow(dq, call.d_given), _narrow(dk, call.d_given), _narrow(dv, call.dv_given)


def forward(q, k, v, sweeps=1, score_scale=1.0, masks=None, config=None):
    """The plan's output (B, H, S_q, d_v) and its statistics, without a graph: (out, c, r) for 0 or
    1 sweeps, (out, CS, RS) with a potential per sweep for more."""
    call = _Call(q, k, v, sweeps, score_scale, masks or Masks(), config)
    out, *stats = _forward(call, sweeps)
    return (_narrow(out, call.dv_given), *stats)


def received_mass(q, k, v, sweeps=1, score_scale=1.0, masks=None, config=None, sampling=None, hybrid_logit=None):
    """Σ_i p_ij per query head, (B, H, S_k): a forward's statistics, then one key pass (two for
    HNAS, one per branch, mixed by the gate). With `sampling`, the sampled weights' (the same
    draws as `bam_attention` with that sampling, over HNAS with `hybrid_logit`)."""
    if sampling is None:
        with torch.no_grad():
            if hybrid_logit is not None:
                return hybrid_attention(q, k, v, hybrid_logit, score_scale, masks, config, received=True)[1]
            return attention(q, k, v, sweeps, score_scale, masks, config, received=True)[1]
    sampling = Sampling(sampling.noise, sampling.scale, sampling.seed, draws=sampling.draws)  # no KL: the weights only
    with torch.no_grad():
        return bam_attention(q, k, v, sampling, sweeps, score_scale, masks=masks, config=config,
                             hybrid_logit=hybrid_logit, received=True)[2]


class _PlanAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sweeps, score_scale, masks, config, received):
        call = _Call(q, k, v, sweeps, score_scale, masks, config)
        call.grads = any(ctx.needs_input_grad)
        out, c, r = _forward(call, sweeps)
        ctx.save_for_backward(out, c, r)
        ctx.call, ctx.sweeps = call, sweeps
        if not received:
            return _narrow(out, call.dv_given)
        # Sinkhorn-N's weights are DNAS's with the last potentials.
        mass = _received_mass(call, c[-1] if sweeps > 1 else c, r[-1] if sweeps > 1 else r)
        ctx.mark_non_differentiable(mass)
        return _narrow(out, call.dv_given), mass

    @staticmethod
    def backward(ctx, grad_out, *_):
        out, *stats = ctx.saved_tensors
        return (*_backward(ctx.call, ctx.sweeps, out, stats, grad_out), None, None, None, None, None)


def attention(q, k, v, sweeps=1, score_scale=1.0, masks=None, config=None, received=False):
    """The plan's attention output (B, H, S_q, d_v), differentiable in q, k and v: 0 sweeps is
    softmax, 1 DNAS, N Sinkhorn-N; scores are `score_scale · q·kᵀ / sqrt(d)`. `k` and `v` may have
    fewer heads than `q` (a divisor of them: grouped-query attention, read by index). `received`:
    `(output, mass)`, the received mass `Σ_i p_ij` (B, H, S_k) from one key pass after the
    forward's, without a gradient."""
    return _PlanAttention.apply(q, k, v, sweeps, score_scale, masks or Masks(), config, received)


class _HybridAttention(torch.autograd.Function):
    """HNAS: `u·O_plan + (1 − u)·O_softmax` per head, `u = sigmoid(logit)`, both outputs from one
    row pass; the backward runs each branch's passes with its share of dO (applied in the passes,
    never formed), the second adding its gradients to the first's, and the gate's gradient is
    `Σ dO·(O_plan − O_softmax) · u(1 − u)` per head."""

    @staticmethod
    def forward(ctx, q, k, v, logit, score_scale, masks, config, received):
        call = _Call(q, k, v, 1, score_scale, masks, config)
        call.grads = any(ctx.needs_input_grad)
        out_d, c, r_d, out_s, r_s = _forward(call, 1, hybrid=True)
        u = torch.sigmoid(logit.to(call.stats))[None, :, None, None]
        ctx.save_for_backward(out_d, c, r_d, out_s, r_s, u)
        ctx.call = call
        out = _narrow((u * out_d.to(u.dtype) + (1 - u) * out_s.to(u.dtype)).to(q.dtype), call.dv_given)
        if not received:
            return out
        # Each branch's mass from its own statistics, mixed as the weights are.
        m_d, m_s = _received_mass(call, c, r_d), _received_mass(_softmax_branch(call), torch.zeros_like(c), r_s)
        mass = u[..., 0] * m_d + (1 - u[..., 0]) * m_s
        ctx.mark_non_differentiable(mass)
        return out, mass

    @staticmethod
    def backward(ctx, grad_out, *_):
        out_d, c, r_d, out_s, r_s, u = ctx.saved_tensors
        call = ctx.call
        do = _aligned(grad_out, out_d.shape[-1])
        shares = u.flatten()
        # Σ_d dO·O per row for each branch: times the branch's share, its D_i; their difference,
        # the gate's rows.
        dots_d, dots_s = _row_dots(do, out_d, call.stats), _row_dots(do, out_s, call.stats)
        delta_d, delta_s = u[..., 0] * dots_d, (1 - u[..., 0]) * dots_s
        rows = dots_d - dots_s
        # One set of gradients: DNAS's branch writes it, softmax's adds to it.
        grads = torch.empty_like(call.q), torch.empty_like(call.k), torch.empty_like(call.v)
        _backward(call, 1, out_d, (c, r_d), do, branch=(shares, delta_d, grads, False))
        dq, dk, dv = _backward(_softmax_branch(call), 0, out_s, (torch.zeros_like(c), r_s), do,
                               branch=(1 - shares, delta_s, grads, True))
        dlogit = rows.sum((0, 2)) * (shares * (1 - shares))
        return dq, dk, dv, dlogit, None, None, None, None


def _softmax_branch(call):
    """HNAS's call as its softmax branch launches its passes (no column statistic)."""
    softmax = copy.copy(call)
    softmax.args = {**call.args, "SWEEPS": 0}
    return softmax


def hybrid_attention(q, k, v, logit, score_scale=1.0, masks=None, config=None, received=False):
    """HNAS's output (B, H, S_q, d_v) with gate logits `logit (H,)`, differentiable in q, k, v and
    the logits. `received`: `(output, mass)`, the mass mixed from each branch's key pass."""
    if logit.dim() != 1 or logit.shape[0] != q.shape[1]:
        raise ValueError(f"logit must have one gate per query head, shape ({q.shape[1]},), got {tuple(logit.shape)}")
    if masks is not None and masks.causal:
        raise ValueError("HNAS mixes in DNAS, whose column sweep is not causal")
    return _HybridAttention.apply(q, k, v, logit, score_scale, masks or Masks(), config, received)


class _BamAttention(torch.autograd.Function):
    """BAM over a plan: the sampled output and the KL part T (B, H); the backward draws the same
    noise again tile by tile and stores nothing of size S_q × S_k."""

    @staticmethod
    def forward(ctx, q, k, v, prior, logit, sweeps, score_scale, sampling, masks, config, received):
        call = _Call(q, k, v, sweeps, score_scale, masks, config, sampling, prior, logit)
        call.grads = any(ctx.needs_input_grad)
        out, c, r = _forward(call, sweeps)
        part = call.kl_rows[2].sum(-1) if call.kl else torch.zeros(q.shape[:2], dtype=call.stats, device=q.device)
        # The sampled weights' mass: the same draws again in one key pass (Sinkhorn-N's weights are
        # DNAS's with the last potentials; over HNAS, the mixture's).
        mass = _received_mass(call, c[-1] if sweeps > 1 else c, r[-1] if sweeps > 1 else r) if received else None
        rows = [*call.kl_rows[:2], *(call.mix_rows if call.mix else ())]
        ctx.save_for_backward(out, c, r, *rows)
        ctx.call, ctx.sweeps, ctx.prior_shape = call, sweeps, None if prior is None else prior.shape
        if logit is not None:
            ctx.u = torch.sigmoid(logit.detach().to(call.stats))
        if not call.kl:
            ctx.mark_non_differentiable(part)
        out = _narrow(out, call.dv_given)
        if not received:
            return out, part
        ctx.mark_non_differentiable(mass)
        return out, part, mass

    @staticmethod
    def backward(ctx, grad_out, grad_part, *_mass):
        call, sweeps = ctx.call, ctx.sweeps
        out, c, r, *rows = ctx.saved_tensors
        kl_rows, mix_rows = (rows[:2], rows[2:]) if call.kl else ((), rows)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        b, h, _, s_q, s_k, _, _ = call.shape
        kl, dprior, mix, dlogit = None, None, None, None
        if call.kl and grad_part is not None:
            kl = (*kl_rows, grad_part.to(call.stats).contiguous(), call.stat(True))
        if call.mix:
            mix = (*mix_rows, torch.zeros(b, h, s_q, dtype=call.stats, device=out.device))
        dq, dk, dv = _backward(call, sweeps, out, (c, r), grad_out, kl, mix)
        if kl is not None and ctx.needs_input_grad[3]:
            dprior = kl[3][..., :s_k].unsqueeze(2).sum_to_size(ctx.prior_shape)
        if mix is not None:
            dlogit = mix[2].sum((0, 2)) * ctx.u * (1 - ctx.u)
        return dq, dk, dv, dprior, dlogit, None, None, None, None, None, None


def bam_attention(q, k, v, sampling, sweeps=1, score_scale=1.0, prior=None, masks=None, config=None,
                  hybrid_logit=None, received=False):
    """BAM's sampled attention over the plan with `sweeps` (0 softmax, 1 DNAS, N Sinkhorn-N), or
    over HNAS with its gate logits `hybrid_logit (H,)` (sweeps 1): (output (B, H, S_q, d_v),
    T (B, H)), T the KL term's score-dependent part (`Sampling`; zeros without a KL term),
    differentiable in q, k, v, the prior's values `prior` (broadcastable to (B, H, 1, S_k)) and
    the gate logits. The noise is drawn in the kernels from `sampling.seed`, the same ε as the
    tiles' and the CPU loop's for that seed (`counter_noise`), or read from `sampling.draws`.
    `received`: `(output, T, mass)`, the sampled weights' received mass `Σ_i w_ij` (B, H, S_k) from
    one key pass after the forward that draws the same noise again."""
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a plans.Sampling, got {type(sampling).__name__}")
    if hybrid_logit is not None:
        if sweeps != 1:
            raise ValueError(f"HNAS mixes DNAS (one sweep) with softmax: sweeps must be 1, got {sweeps}")
        if hybrid_logit.dim() != 1 or hybrid_logit.shape[0] != q.shape[1]:
            raise ValueError(f"hybrid_logit must have one gate per query head, shape ({q.shape[1]},), "
                             f"got {tuple(hybrid_logit.shape)}")
    return _BamAttention.apply(q, k, v, prior, hybrid_logit, sweeps, score_scale, sampling, masks or Masks(), config,
                               received)
