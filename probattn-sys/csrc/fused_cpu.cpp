// Memory-efficient attention through libtorch's fused flash-attention kernel for the CPU, where
// the mask allows it: softmax, DNAS and Sinkhorn-N, and BAM's sampling over a softmax base. The
// notation is csrc/tiled.cpp's; what is shared is in csrc/tiled.h.

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "boundary.h"
#include "tiled.h"

namespace probattn::tiled {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- softmax, DNAS and Sinkhorn-N through libtorch's fused attention kernel for the CPU
//
// Without noise or KL, on the CPU, with no mask or a per-key one, these need no tile loop of
// ours: libtorch's flash-attention kernel for the CPU (blocked, vectorized, O(S · d) memory)
// returns each row's log-sum-exp beside its output, adds a mask broadcast over the queries, and
// has its backward exposed. Every statistic is one call, with s = sqrt(1/d) and "swapped" meaning
// the keys as queries and the queries as keys:
//   C^t, Σ_i A^t_ij q_i = the swapped call with values q and bias -R^{t-1} over its keys (none for
//       t = 1): its log-sum-exp is C^t, its output Σ_i exp(z_ij - R^{t-1}_i - C^t_j) q_i;
//   R^t, Σ_j B^t_ij k_j = the call on (q, k) with values k and the per-key bias -C^t (t < N);
//   O, R^N = the call on (q, k, v) with the bias -C^N (0 for softmax), filled keys at -1e30.
// Backward: the kernel's backward gives dq, dk, dv of dY = P ∘ (dP - D), and g_j = Σ_i dY_ij with
// a column of ones appended to q (zeros to k, v, O and dO: the scores do not change, and that
// column of dk is s · g). Then down the chain from dC^N = -g (header), two more calls a sweep:
//   Σ_j A^t_ij dC^t_j [k_j, 1] = the call on (q, k) with values [dC^t ∘ k, dC^t] and bias -C^t,
//       scaled by exp(lse_i - R^{t-1}_i): dq += s ·(its first d columns), dR^{t-1} = -(its last);
//   Σ_i B^{t-1}_ij dR^{t-1}_i [q_i, 1] = the swapped call with values [dR^{t-1} ∘ q, dR^{t-1}] and
//       bias -R^{t-1}, scaled by exp(lse_j - C^{t-1}_j): dk += s ·(first d), dC^{t-1} = -(last);
// and from the forward, dk += s · dC^t ∘ (Σ_i A^t_ij q_i), dq += s · dR^t ∘ (Σ_j B^t_ij k_j). (The
// kernel wants the values as wide as the queries: for d + 1 columns q and k get a zero column.)
// For DNAS this is dZ = dY - Pc ∘ g of docs/formulas.md §5.
// The received mass Σ_i P_ij = Σ_i exp(z_ij - C_j - R_i) is the swapped call with the bias -R^N
// over its keys: its log-sum-exp minus C^N (0 for softmax).
// A sequence whose keys are all filled keeps the tile loop (the kernel would average its values
// where the eager path returns zeros).

// The key mask as the kernel's additive bias, -bias on allowed keys; (B, H, 1, S_k), contiguous:
// the kernel's log-sum-exp comes back with strides (S·H, 1, H), and a mask laid out like that is
// expanded to a full (S_q, S_k) copy by the kernel (checked: 512 MiB more at S = 4096, H = 8).
at::Tensor key_bias(const at::Tensor& minus, const at::Tensor& excluded) {
  auto bias = excluded.defined() ? at::where(excluded, at::scalar_tensor(kMaskValue, minus.options()), -minus) : -minus;
  return bias.contiguous();
}

// The kernel on (q, k, x) with an optional bias: (output, log-sum-exp in the statistics' dtype,
// float32 for bfloat16 inputs, as the kernel computes it). Values wider than q ride on a zero
// column of q and k; narrower ones on zero columns of their own; values are taken in q's dtype.
std::pair<at::Tensor, at::Tensor> kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x, const at::Tensor& bias,
                                         double scale) {
  const int64_t d = q.size(-1), w = x.size(-1);
  const auto xs = x.to(q.scalar_type());
  auto widen = [](const at::Tensor& t, int64_t to) { return at::constant_pad_nd(t, {0, to - t.size(-1)}, 0.0); };
  std::optional<at::Tensor> mask = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  at::Tensor out, lse;
  if (w > d) {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(widen(q, w), widen(k, w), xs, 0.0, false, mask, scale);
  } else {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q, k, w < d ? widen(xs, d) : xs, 0.0, false, mask, scale);
    out = out.narrow(-1, 0, w);
  }
  return {out, lse.to(statistics_type(q.scalar_type()))};
}

// Σ_i P_ij with P = exp(z - col - R) (col the per-key statistic the output pass subtracted, zeros
// for softmax), (B, H, S_k); 0 on filled keys. The swapped kernel with the bias -R over its keys
// (the queries) returns log Σ_i exp(z_ij - R_i) as its log-sum-exp, stabilised by the kernel's own
// running maximum, so mass_j = exp(that - col_j) for any spread of R. (Folding exp(-R_i) into the
// values instead underflows to 0 for every row whose R_i lies ~700 (float64) or ~90 (float32)
// above the smallest: large scores lost whole rows of mass that way.)
at::Tensor fused_mass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& col, const at::Tensor& r, const at::Tensor& excluded,
                      double scale) {
  auto lse = kernel(k, q, q, (-r).unsqueeze(-2).contiguous(), scale).second;  // (B, H, S_k)
  auto mass = at::exp(lse - col);
  return excluded.defined() ? mass.masked_fill(excluded.squeeze(-2).expand_as(mass), 0.0) : mass;
}

struct FusedCpuAttention : public torch::autograd::Function<FusedCpuAttention> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> excluded,
                               int64_t sweeps) {
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    const auto ex = excluded.value_or(at::Tensor());
    std::vector<at::Tensor> c, r, col_q, row_k;  // C^t, R^t (t < N), Σ_i A^t_ij q_i, Σ_j B^t_ij k_j
    for (int64_t t = 1; t <= sweeps; ++t) {
      auto rows = t == 1 ? at::Tensor() : (-r.back()).unsqueeze(-2).contiguous();
      auto [aq, lse] = kernel(k, q, q, rows, scale);
      c.push_back(lse);
      col_q.push_back(aq);
      if (t == sweeps) break;
      auto [bk, lse_r] = kernel(q, k, k, key_bias(lse.unsqueeze(-2), ex), scale);
      r.push_back(lse_r);
      row_k.push_back(bk);
    }
    const auto stats = q.options().dtype(statistics_type(q.scalar_type()));
    auto col = sweeps > 0 ? c.back() : at::zeros({q.size(0), q.size(1), k.size(2)}, stats);
    auto bias = key_bias(col.unsqueeze(-2), ex);
    auto [out, r_last] = kernel(q, k, v, bias, scale);
    auto mass = fused_mass(q, k, col, r_last, ex, scale);
    ctx->save_for_backward({q, k, v, out, r_last, bias});
    keep_optional(ctx, "excluded", ex);
    ctx->saved_data["c"] = at::IValue(c);
    ctx->saved_data["r"] = at::IValue(r);
    ctx->saved_data["col_q"] = at::IValue(col_q);
    ctx->saved_data["row_k"] = at::IValue(row_k);
    ctx->mark_non_differentiable({mass});
    return {out, mass, at::zeros({q.size(0), q.size(1)}, stats)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NoAutocast no_autocast;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &r_last = saved[4], &bias = saved[5];
    const auto c = ctx->saved_data["c"].toTensorVector(), r = ctx->saved_data["r"].toTensorVector();
    const auto col_q = ctx->saved_data["col_q"].toTensorVector(), row_k = ctx->saved_data["row_k"].toTensorVector();
    const auto ex = kept_optional(ctx, "excluded");
    const size_t n = c.size();
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    const int64_t d = q.size(-1);
    auto dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    at::Tensor dq, dk, dv;
    if (n == 0) {
      std::tie(dq, dk, dv) =
          at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, r_last, 0.0, false, bias, scale);
      return {dq, dk, dv, at::Tensor(), at::Tensor()};
    }
    // One column of ones on q (zeros on the others) carries g = Σ_i dY_ij into dk. The padded q
    // and k serve the calls below as well: k's zero column keeps the scores q·k whatever q's is.
    auto pad = [](const at::Tensor& t) { return at::constant_pad_nd(t, {0, 1}, 0.0); };
    auto qa = pad(q), kz = pad(k);
    qa.select(-1, d).fill_(1.0);
    std::tie(dq, dk, dv) =
        at::_scaled_dot_product_flash_attention_for_cpu_backward(pad(dout), qa, kz, pad(v), pad(out), r_last, 0.0, false, bias, scale);
    auto g = dk.select(-1, d).to(statistics_type(q.scalar_type())) / scale;  // (B, H, S_k)
    dq = dq.narrow(-1, 0, d);
    dk = dk.narrow(-1, 0, d);
    dv = dv.narrow(-1, 0, d);
    auto keys_only = [&](const at::Tensor& t) { return ex.defined() ? t.masked_fill(ex.squeeze(-2).expand_as(t), 0.0) : t; };
    // Every (B, H, S, ·) tensor below stays in the inputs' dtype, the per-row factors (in the
    // statistics' dtype) cast to it first: an operation that mixes dtypes would take float32
    // copies of its (B, H, S, ·) operands on the CPU, twice the bfloat16 ones. The terms add into
    // the kernel's gradients in place (no second copy of dq or dk), unless the backward pass is
    // itself recorded (create_graph), which in-place and out= operations would break.
    const bool recorded = at::GradMode::is_enabled();
    const auto factor = [&](const at::Tensor& w) { return w.unsqueeze(-1).to(q.scalar_type()); };
    auto add = [&](at::Tensor& into, const at::Tensor& x, const at::Tensor& w) {
      if (recorded) {
        into = into + x * factor(w);
      } else {
        into.addcmul_(x, factor(w));
      }
    };
    // [w ∘ x, w] (the kernel's values), written once.
    auto with_ones = [&](const at::Tensor& w, const at::Tensor& x) {
      if (recorded) return at::cat({x * factor(w), factor(w)}, -1);
      auto sizes = x.sizes().vec();
      const int64_t width = sizes.back();
      sizes.back() = width + 1;
      auto out = at::empty(sizes, x.options());
      auto scaled = out.narrow(-1, 0, width);
      at::mul_out(scaled, x, factor(w));
      out.select(-1, width).copy_(w);
      return out;
    };
    auto dc = keys_only(-g);  // dC^N
    for (size_t t = n; t >= 1; --t) {
      auto [a, lse] = kernel(qa, kz, with_ones(dc, k), key_bias(c[t - 1].unsqueeze(-2), ex), scale);
      auto a_scale = t >= 2 ? at::exp(lse - r[t - 2]) : at::exp(lse);  // exp(lse_i - R^{t-1}_i)
      add(dq, a.narrow(-1, 0, d), a_scale * scale);
      add(dk, col_q[t - 1], dc * scale);
      if (t == 1) break;
      auto dr = -a.select(-1, d) * a_scale;  // dR^{t-1}
      add(dq, row_k[t - 2], dr * scale);
      auto [b, lse_c] = kernel(kz, qa, with_ones(dr, q), (-r[t - 2]).unsqueeze(-2).contiguous(), scale);
      auto b_scale = keys_only(at::exp(lse_c - c[t - 2]));  // exp(lse_j - C^{t-1}_j), 0 on filled keys
      add(dk, b.narrow(-1, 0, d), b_scale * scale);
      dc = -b.select(-1, d) * b_scale;  // dC^{t-1}
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

// ---- softmax attention of bfloat16 (or float16) q, k, v, computed in float32
//
// Scores, weights and the value mix in float32 from the low-precision inputs, as libtorch's fused
// kernel computes inside, for the lengths where that kernel is slower than this form (the caller
// decides). Autograd over the same operations would keep float32 copies of q, k and v for the
// backward pass; this keeps the inputs themselves and the float32 weights, and widens the inputs
// again there. `allowed` (bool, broadcastable to the scores, true = taking part): a query with no
// allowed key gets a zero output and zero gradients, as the eager path's.
struct WidenedSoftmax : public torch::autograd::Function<WidenedSoftmax> {
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> allowed,
                               double scale) {
    const NoAutocast no_autocast;
    auto scores = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)).mul_(scale);
    at::Tensor w;
    if (allowed.has_value()) {
      const auto excluded = allowed->logical_not();
      w = at::softmax(scores.masked_fill_(excluded, -std::numeric_limits<double>::infinity()), -1).masked_fill_(excluded, 0.0);
    } else {
      w = at::softmax(scores, -1);
    }
    auto out = at::matmul(w, v.to(at::kFloat));
    ctx->save_for_backward({q, k, v, w});
    ctx->saved_data["scale"] = scale;
    return {out.to(v.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NoAutocast no_autocast;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &w = saved[3];
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto dout = grads[0].to(at::kFloat);
    auto dv = at::matmul(w.transpose(-2, -1), dout);
    auto dw = at::matmul(dout, v.to(at::kFloat).transpose(-2, -1));
    auto ds = (dw - (dw * w).sum(-1, /*keepdim=*/true)) * w * scale;  // softmax's backward, then the scale
    auto dq = at::matmul(ds, k.to(at::kFloat));
    auto dk = at::matmul(ds.transpose(-2, -1), q.to(at::kFloat));
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

// a · b with a in bfloat16 or float16 widened to b's dtype, differentiable in both, keeping a
// itself for the backward pass and widening it again there, where autograd over a.to(b) · b would
// keep the widened copy (twice a's size in float32) from the forward pass to the backward. The
// forward is the same product, bit for bit; the gradients are its gradients formed in b's dtype,
// b's summed over the dimensions b was broadcast along, a's rounded once to a's dtype. (The
// contextual prior's first layer over the keys: a (B, H_kv, S_k, d), b (1, H_kv, d, G · hidden).)
struct WidenedMatmul : public torch::autograd::Function<WidenedMatmul> {
  static variable_list forward(AutogradContext* ctx, at::Tensor a, at::Tensor b) {
    const NoAutocast no_autocast;
    ctx->save_for_backward({a, b});
    return {at::matmul(a.to(b.scalar_type()), b)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NoAutocast no_autocast;
    auto saved = ctx->get_saved_variables();
    const auto &a = saved[0], &b = saved[1];
    const auto& dout = grads[0];
    at::Tensor da, db;
    if (ctx->needs_input_grad(0)) {
      da = at::matmul(dout, b.transpose(-2, -1)).sum_to_size(a.sizes()).to(a.scalar_type());
    }
    if (ctx->needs_input_grad(1)) {
      db = at::matmul(a.to(b.scalar_type()).transpose(-2, -1), dout).sum_to_size(b.sizes());
    }
    return {da, db};
  }
};

// ---- BAM over a softmax base through the same kernel, a block of queries at a time
//
// The sampled weights are P = row-softmax(z + n) (the base's per-row constant cancels): the kernel
// on a block of queries with the block's noise term (plus the key mask) as its additive mask, so
// one (tile, S_k) block of noise is all that exists at a time, drawn again in backward. Its
// backward gives dq, dk, dv of dY = P ∘ (dP - D). The received mass of a block is the kernel with
// the keys as queries and the mask (n - L)ᵀ, L the block's row log-sum-exps: its log-sum-exp is
// log Σ_i P_ij. With a key mask only, the KL's part T needs no (S_q, S_k) block at all: with
// log π_ij = z_ij - l_i (l_i = LSE_j z_ij over the allowed keys A, from one kernel call that also
// returns πK), a'_j = a_j on A and 0 elsewhere, α = Σ_j a'_j, z_ij = qs_i · k_j:
//   Weibull:   T = Σ_j a'_j zc_j - α Σ_i l_i,             zc_j = k_j · Σ_i qs_i
//   Lognormal: T = Σ_{i, j∈A} e_ij²,  e_ij = z_ij - l_i - a_j = qs_i · k̃_j + m_i - ã_j,
//              about A's means: k̃_j = k_j - k̄, ã_j = a_j - ā (0 off A), m_i = qs_i · k̄ - l_i - ā,
//              so that Σ_A k̃_j = 0 and Σ_A ã_j = 0:
//              T = Σ_i qs_i C qs_iᵀ - 2 Σ_i qs_i · U + |A| Σ_i m_i² + S_q Σ_j ã_j²,
//              C = Σ_{j∈A} k̃_jᵀ k̃_j (d × d), U = Σ_{j∈A} ã_j k̃_j.
// Gradients, dT/dz_ij = u_ij - π_ij U_i with u = ∂T/∂log π on A and U_i = Σ_j u_ij, so through
// z = qs kᵀ: dqs_i = Σ_j u_ij k_j - U_i (πK)_i and dk_j = Σ_i u_ij qs_i - Σ_i π_ij U_i qs_i, the
// last the kernel with the keys as queries and the bias -l: out_j exp(lse_j) = Σ_i π_ij x_i.
//   Weibull:   u_ij = a'_j:       Σ_j u_ij k_j = a'K,  Σ_i u_ij qs_i = a'_j Σ_i qs_i, U_i = α
//   Lognormal: u_ij = 2 e_ij:     Σ_j u_ij k_j = 2 (qs_i C - U + |A| m_i k̄),
//              Σ_i u_ij qs_i = 2 (k̃_j QᵀQ + Σ_i m_i qs_i - ã_j Σ_i qs_i) (QᵀQ = Σ_i qs_iᵀ qs_i), U_i = 2 |A| m_i
// and ∂T/∂a_j = Σ_i log π_ij = zc_j - Σ_i l_i (Weibull), -2 (Σ_i qs_i · k̃_j + Σ_i m_i - S_q ã_j) (Lognormal), on A.
// Lognormal's sums are formed about the means so that they do not cancel: expanded about 0
// (Σ_i qs_i G qs_iᵀ with G = Σ_A k_jᵀ k_j, and so on) they are sums of squares of the scores
// whose float32 rounding grows as eps · z², 1e-4 of T where the scores sit near 100; about the
// means it grows as the tiles' does, as eps · |z| (docs/precision.md).

struct FusedCpuBam : public torch::autograd::Function<FusedCpuBam> {
  // What forward and backward both form: the shape, the key bias and the noise of a block.
  struct Blocks {
    at::Tensor q, bias, given;  // bias (B, H, 1, S_k); given: ε expanded to the scores' shape, or undefined
    int64_t tile, noise;
    double noise_scale;
    uint64_t seed;
    std::vector<int64_t> shape;

    template <typename F>
    void each(F&& f) const {
      for (int64_t start = 0; start < shape[2]; start += tile) f(start, std::min(tile, shape[2] - start));
    }
    // The kernel's mask for queries [start, start + len): the noise term plus the key bias.
    at::Tensor mask(int64_t start, int64_t len) const {
      return noise_rows(given, seed, noise, noise_scale, shape, start, len, q.scalar_type(), q.device()).add_(bias);
    }
  };

  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> excluded,
                               std::optional<at::Tensor> noise_given, std::optional<at::Tensor> prior, int64_t tile, int64_t noise,
                               double noise_scale, int64_t seed, int64_t kl) {
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    const auto ex = excluded.value_or(at::Tensor());
    const std::vector<int64_t> shape{q.size(0), q.size(1), q.size(2), k.size(2)};
    const auto bias = key_bias(at::zeros({shape[0], shape[1], 1, shape[3]}, q.options()), ex);
    const Blocks blocks{q, bias, noise_given.has_value() ? noise_given->expand(shape) : at::Tensor(), tile, noise, noise_scale,
                        static_cast<uint64_t>(seed), shape};
    std::vector<at::Tensor> outputs, lses;
    auto mass = at::zeros({shape[0], shape[1], shape[3]}, q.options());
    blocks.each([&](int64_t start, int64_t len) {
      auto qt = q.narrow(-2, start, len);
      auto m = blocks.mask(start, len);
      auto [out, lse] = kernel(qt, k, v, m, scale);
      auto swapped = m.sub_(lse.unsqueeze(-1)).transpose(-2, -1).contiguous();  // (n + bias - L)ᵀ
      mass += at::exp(kernel(k, qt, qt, swapped, scale).second);
      outputs.push_back(out);
      lses.push_back(lse);
    });
    if (ex.defined()) mass.masked_fill_(ex.squeeze(-2).expand_as(mass), 0.0);
    auto out = at::cat(outputs, -2);
    auto lse = at::cat(lses, -1);
    auto kl_part = at::zeros({shape[0], shape[1]}, q.options());
    at::Tensor pik, l;
    if (kl != kNoKl) {
      std::tie(pik, l) = kernel(q, k, k, bias, scale);
      kl_part = KlClosedForm(q * scale, k, *prior, ex, kl).value(l);
    }
    ctx->save_for_backward({q, k, v, out, lse, bias});
    keep_optional(ctx, "excluded", ex);
    keep_optional(ctx, "given", blocks.given);
    keep_optional(ctx, "prior", prior.value_or(at::Tensor()));
    keep_optional(ctx, "pik", pik);
    keep_optional(ctx, "l", l);
    ctx->saved_data["settings"] = std::vector<int64_t>{tile, noise, seed, kl};
    ctx->saved_data["noise_scale"] = noise_scale;
    ctx->mark_non_differentiable({mass});
    return {out, mass, kl_part};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NoAutocast no_autocast;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4], &bias = saved[5];
    const auto settings = ctx->saved_data["settings"].toIntVector();
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    const std::vector<int64_t> shape{q.size(0), q.size(1), q.size(2), k.size(2)};
    const Blocks blocks{q, bias, kept_optional(ctx, "given"), settings[0], settings[1], ctx->saved_data["noise_scale"].toDouble(),
                        static_cast<uint64_t>(settings[2]), shape};
    const int64_t kl = settings[3];
    auto dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    auto dq = at::empty_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    blocks.each([&](int64_t start, int64_t len) {
      auto rows = [&](const at::Tensor& t) { return t.narrow(-2, start, len).contiguous(); };
      auto [dqt, dkt, dvt] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          rows(dout), q.narrow(-2, start, len), k, v, rows(out), lse.narrow(-1, start, len).contiguous(), 0.0, false,
          blocks.mask(start, len), scale);
      dq.narrow(-2, start, len).copy_(dqt);
      dk.add_(dkt);
      dv.add_(dvt);
    });
    at::Tensor dprior;
    const auto prior = kept_optional(ctx, "prior");
    if (kl != kNoKl && grads[2].defined()) {
      const KlClosedForm form(q * scale, k, prior, kept_optional(ctx, "excluded"), kl);
      auto [dqs, dkk, da] = form.grad(kept_optional(ctx, "l"), kept_optional(ctx, "pik"), grads[2], scale);
      dq.add_(dqs * scale);
      dk.add_(dkk);
      if (prior.requires_grad()) dprior = at::sum_to(da, prior.sizes());
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor(), dprior, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  // The KL's part T in closed form (above), its gradients in qs, k and the prior.
  struct KlClosedForm {
    at::Tensor qs, k, a, allowed;  // a' (B, H, 1, S_k), 0 off A; allowed (B, H, 1, S_k) as 0 / 1
    int64_t kind;
    at::Tensor zc, sq;  // zc (B, H, 1, S_k), sq = Σ_i qs_i (B, H, 1, d)

    KlClosedForm(const at::Tensor& qs_, const at::Tensor& k_, const at::Tensor& prior, const at::Tensor& ex, int64_t kind_)
        : qs(qs_), k(k_), kind(kind_) {
      const auto opts = qs.options();
      allowed = at::ones({qs.size(0), qs.size(1), 1, k.size(2)}, opts);
      if (ex.defined()) allowed = allowed.masked_fill(ex, 0.0);
      a = prior.expand_as(allowed) * allowed;
      sq = qs.sum(-2, true);
      zc = at::matmul(sq, k.transpose(-2, -1));
    }
    at::Tensor alpha() const { return a.sum(-1); }  // (B, H, 1)
    at::Tensor key_sum() const { return (k * allowed.transpose(-2, -1)).sum(-2, true); }  // (B, H, 1, d)
    at::Tensor count() const { return allowed.sum(-1); }                                   // |A|, (B, H, 1)

    // Lognormal's sums about A's means (above): k̃_j = k_j − k̄ and ã_j = a_j − ā on A (0 off it),
    // C = Σ_A k̃_jᵀ k̃_j and U = Σ_A ã_j k̃_j, and the row means m_i = qs_i · k̄ − l_i − ā.
    struct Centred {
      at::Tensor kbar, kc, ac, c, u, m;  // kbar and u (B, H, 1, d), kc (B, H, S_k, d), ac (B, H, 1, S_k), m (B, H, S_q)
    };
    Centred centred(const at::Tensor& l) const {
      const auto n = count().unsqueeze(-1);  // (B, H, 1, 1); A holds a key (fused_cpu_bam_applies)
      const auto keys = allowed.transpose(-2, -1);
      const auto kbar = key_sum() / n;
      const auto kc = (k - kbar) * keys;
      const auto abar = alpha().unsqueeze(-1) / n;
      const auto ac = (a - abar) * allowed;
      const auto m = at::matmul(qs, kbar.transpose(-2, -1)).squeeze(-1) - l - abar.squeeze(-1);
      return {kbar, kc, ac, at::matmul(kc.transpose(-2, -1), kc), at::matmul(ac, kc), m};
    }

    at::Tensor value(const at::Tensor& l) const {  // l (B, H, S_q)
      const auto sum_l = l.sum(-1);
      if (kind == kWeibullCross) return (a * zc).sum({-2, -1}) - alpha().squeeze(-1) * sum_l;
      const auto cs = centred(l);
      return (at::matmul(qs, cs.c) * qs).sum({-2, -1}) - (at::matmul(qs, cs.u.transpose(-2, -1))).sum({-2, -1}) * 2.0 +
             count().squeeze(-1) * cs.m.square().sum(-1) + cs.ac.square().sum({-2, -1}) * static_cast<double>(qs.size(-2));
    }

    // (d qs, d k, d a) for the incoming gradient dt (B, H) of T.
    std::tuple<at::Tensor, at::Tensor, at::Tensor> grad(const at::Tensor& l, const at::Tensor& pik, const at::Tensor& dt,
                                                        double scale) const {
      const auto g = dt.view({dt.size(0), dt.size(1), 1, 1});
      const auto sum_l = l.sum(-1).view_as(g);
      const auto ak = at::matmul(a, k);                      // a'K, (B, H, 1, d)
      const auto keys = allowed.transpose(-2, -1);           // (B, H, S_k, 1)
      // Σ_i π_ij x_i: the kernel with the keys as queries, bias -l over its keys.
      // A filled key is no query's key: its z_ij − l_i is not bounded by l_i and may exceed exp's
      // range (inf, then inf · 0 = NaN below), so its sum is 0 before the exponential.
      const auto filled_keys = allowed.squeeze(-2).eq(0.0);  // (B, H, S_k)
      auto pi_t = [&](const at::Tensor& x) {
        auto [o, lse] = kernel(k, qs / scale, x, (-l).unsqueeze(-2).contiguous(), scale);
        return o * at::exp(lse.masked_fill(filled_keys, -std::numeric_limits<double>::infinity())).unsqueeze(-1);
      };
      at::Tensor dqs, dk, da;
      if (kind == kWeibullCross) {
        const auto al = alpha().unsqueeze(-1);  // (B, H, 1, 1)
        dqs = (ak - pik * al) * g;
        dk = (a.transpose(-2, -1) * sq - pi_t(qs) * al) * keys * g;
        da = (zc - sum_l) * allowed * g;
      } else {
        const auto cs = centred(l);
        const auto n = count().unsqueeze(-1);               // (B, H, 1, 1)
        const auto mi = cs.m.unsqueeze(-1);                 // (B, H, S_q, 1)
        const auto u_rows = mi * n * 2.0;                   // U_i = Σ_j u_ij = 2 |A| m_i
        dqs = ((at::matmul(qs, cs.c) - cs.u + mi * n * cs.kbar) * 2.0 - pik * u_rows) * g;
        const auto qq = at::matmul(qs.transpose(-2, -1), qs);
        const auto mq = (mi * qs).sum(-2, true);            // Σ_i m_i qs_i
        dk = ((at::matmul(cs.kc, qq) + mq - cs.ac.transpose(-2, -1) * sq) * 2.0 - pi_t(u_rows * qs)) * keys * g;
        const auto qk = at::matmul(sq, cs.kc.transpose(-2, -1));  // Σ_i qs_i · k̃_j, (B, H, 1, S_k)
        da = (qk + cs.m.sum(-1, true).unsqueeze(-1) - cs.ac * static_cast<double>(qs.size(-2))) * allowed * (g * -2.0);
      }
      return {dqs, dk, da};
    }
  };
};

}  // namespace

// Where the routes apply: the CPU, no mask or a per-key one with a key left in every sequence
// (sections above); for BAM, sampling over a softmax base.
bool fused_cpu_applies(const at::Tensor& q, const at::Tensor& v, const at::Tensor& excluded, int64_t noise, int64_t kl) {
  if (!q.device().is_cpu() || noise != kNoNoise || kl != kNoKl) return false;
  if (q.dim() != 4 || v.size(-1) != q.size(-1)) return false;
  if (!excluded.defined()) return true;
  return excluded.size(-2) == 1 && !excluded.all(-1).any().item<bool>();
}

bool fused_cpu_bam_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& excluded, int64_t sweeps,
                           int64_t noise, int64_t kl) {
  if (!q.device().is_cpu() || noise == kNoNoise || sweeps != 0 || q.dim() != 4 || v.size(-1) != q.size(-1)) return false;
  // The KL's closed form cancels large sums: bfloat16 and float16 inputs take the tiles.
  if (statistics_type(q.scalar_type()) != q.scalar_type()) return false;
  if (!excluded.defined()) return true;
  return excluded.size(-2) == 1 && !excluded.all(-1).any().item<bool>();
}

std::vector<at::Tensor> fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& excluded, int64_t sweeps) {
  return FusedCpuAttention::apply(q, k, v, excluded, sweeps);
}

std::vector<at::Tensor> fused_cpu_bam(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& excluded, const std::optional<at::Tensor>& noise_given,
                                      const std::optional<at::Tensor>& prior, int64_t tile, int64_t noise, double noise_scale, int64_t seed,
                                      int64_t kl) {
  return FusedCpuBam::apply(q, k, v, excluded, noise_given, prior, tile, noise, noise_scale, seed, kl);
}

}  // namespace probattn::tiled

extern "C" {

char* pa_widened_softmax(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* allowed, double scale,
                         pa_tensor** out) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}}) {
      probattn::require(pointer, "pa_widened_softmax", name);
    }
    auto some = allowed != nullptr ? std::optional<at::Tensor>(*allowed) : std::nullopt;
    auto result = probattn::tiled::WidenedSoftmax::apply(*q, *k, *v, some, scale);
    *out = std::make_unique<at::Tensor>(result[0]).release();
  });
}

char* pa_widened_matmul(const pa_tensor* a, const pa_tensor* b, pa_tensor** out) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{a, "a"}, {b, "b"}, {out, "out"}}) {
      probattn::require(pointer, "pa_widened_matmul", name);
    }
    auto result = probattn::tiled::WidenedMatmul::apply(*a, *b);
    *out = std::make_unique<at::Tensor>(result[0]).release();
  });
}

}  // extern "C"
