// Memory-efficient attention: softmax, DNAS and Sinkhorn-N (Ding et al. 2020), and BAM's sampled
// weights (Fan et al. 2020) over any of them, tiled over blocks of queries, forward and backward,
// as a torch::autograd::Function whose passes are ATen ops (CPU and CUDA alike). No (S_q, S_k)
// tensor is kept: each pass holds one (tile, S_k) block of scores at a time, and what is saved for
// backward is q, k, v, the output and O(S) statistics per head. On the CPU, where the mask allows
// it, libtorch's fused flash-attention kernel does the work of the tile loop (sections below).
//
// Scores z = (q · sqrt(1/d)) kᵀ, excluded entries filled with -1e30 as the eager path does; every
// exponential of a filled entry is set to exactly 0 (a fully excluded row or column is all zeros).
//
// N column/row sweeps (N = 0 softmax, 1 DNAS, N Sinkhorn-N) leave log-weights z_ij - C_j - R_i:
// the eager path's alternating log-softmaxes telescope into one per-key and one per-query sum.
//   C¹_j = LSE_i z_ij,  R^t_i = LSE_j (z_ij - C^t_j),  C^{t+1}_j = LSE_i (z_ij - R^t_i).
// The weights are P = row-softmax(y + n), y = z - C^N (y = z for softmax), n BAM's noise term
// (0 without sampling); the base normalizer's log-weights are log π = y - LSE_j y. Forward: N
// passes, each computing a tile's R^{t-1} (rows are local to the tile) and folding its column
// LSE into C^t, then the output pass.
//
// Backward by recomputation. Per tile: dP = dO vᵀ, D_i = Σ_d dO_id O_id, dY = P ∘ (dP - D), plus
// the KL term's part (below). Through the statistics, with A^t = exp(z - R^{t-1} - C^t) (∂C^t/∂z,
// R⁰ = 0) and B^t = exp(z - C^t - R^t) (∂R^t/∂z):
//   dC^N = -Σ_i dY_ij,  dR^{t-1}_i = -Σ_j A^t_ij dC^t_j,  dC^{t-1}_j = -Σ_i B^{t-1}_ij dR^{t-1}_i,
//   dZ = dY + Σ_t A^t ∘ dC^t + Σ_{t<N} B^t ∘ dR^t,
// one pass for dV and Σ_i dY, N - 1 passes down the chain, one for dZ; then dq = sqrt(1/d) dZ k,
// dk = dZᵀ (q · sqrt(1/d)), dv = Pᵀ dO. For DNAS this is dZ = dY - Pc ∘ g of docs/formulas.md §5.
//
// BAM: the sampled weights are row-softmax(log π + n) = row-softmax(y + n): the per-row constant
// cancels. n = (1/k) log(-log(1 - ε)), ε ~ U(0, 1) (Weibull) or σ ε, ε ~ N(0, 1) (Lognormal), from
// a given tensor or from a counter-based generator keyed by (seed, b, h, i, j) and regenerated per
// tile, so forward and backward see the same draws. The KL term's only part that needs the scores
// is, per (b, h), over the allowed entries,
//   Weibull:   T = Σ_ij a_j log π_ij         (a_j = α_j, the Gamma prior's shape)
//   Lognormal: T = Σ_ij (log π_ij - a_j)²    (a_j = μ_p,j + σ²/2)
// returned as the third output, differentiable in the scores and in a; the Rust side adds the
// per-key and per-row terms (src/tiled.rs). Its gradient in y: dT/dlog π - π ∘ Σ_j dT/dlog π.

#include <cfloat>
#include <cmath>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "boundary.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kMaskValue = -1.0e30;  // the eager path's mask_value for float32 and float64
constexpr int64_t kLow32 = 0xffffffffLL;

enum Noise : int64_t { kNoNoise = 0, kWeibull = 1, kLognormal = 2 };
enum Kl : int64_t { kNoKl = 0, kWeibullCross = 1, kLognormalSquares = 2 };

// ---- counter-based draws: integer hashing in ATen ops, every value kept below 2^49, so int64
// never overflows on any device.

// x · c mod 2^32 for 0 <= x < 2^32, in two 16-bit halves of c.
at::Tensor mul32(const at::Tensor& x, uint32_t c) {
  auto low = x * static_cast<int64_t>(c & 0xffffu);
  auto high = at::bitwise_left_shift(at::bitwise_and(x * static_cast<int64_t>(c >> 16), 0xffff), 16);
  return at::bitwise_and(low + high, kLow32);
}

// A bijection of 32-bit values with good avalanche (C. Wellons' two-round integer hash).
at::Tensor hash32(at::Tensor x) {
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 16));
  x = mul32(x, 0x21f0aaadu);
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 15));
  x = mul32(x, 0xd35a2d97u);
  return at::bitwise_xor(x, at::bitwise_right_shift(x, 15));
}

// Uniform draws in (0, 1), float64, for entries (b, h, i, j) with i in [start, start + len) of a
// (B, H, S_q, S_k) score tensor: 32 random bits ((m + 1/2) / 2^32), or 23 for float32 noise:
// (2m + 1) / 2^24 has 24 significant bits, so it casts to float32 exactly and its largest value,
// 1 - 2^-24, stays below 1 (with 24 bits the largest, 1 - 2^-25, rounded to 1.0 in float32, and
// the Weibull transform log(-log(1 - ε)) became infinite). The bits of entry e (its position in
// the score tensor) are hash(hash(low(e) ^ hash(high(e) ^ seed_hi)) ^ seed_lo).
//
// `counter_uniform_ops` computes them with ATen's integer ops (any device); `counter_uniform_cpu`
// with a plain loop over the same 32-bit arithmetic (unsigned, so wrapping is defined), about 30
// times faster on the CPU, where the op-by-op form allocated and swept one int64 tensor per step.
at::Tensor counter_uniform_ops(uint64_t seed, at::IntArrayRef shape, int64_t start, int64_t len, bool float32, at::Device device) {
  const int64_t b = shape[0], h = shape[1], sq = shape[2], sk = shape[3];
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  auto heads = at::arange(b * h, opts).view({b, h, 1, 1});
  auto rows = at::arange(start, start + len, opts).view({1, 1, len, 1});
  auto cols = at::arange(sk, opts).view({1, 1, 1, sk});
  auto index = (heads * sq + rows) * sk + cols;  // the entry's position, < 2^63
  auto low = at::bitwise_and(index, kLow32), high = at::bitwise_right_shift(index, 32);
  const auto s0 = static_cast<int64_t>(seed & 0xffffffffULL), s1 = static_cast<int64_t>(seed >> 32);
  auto bits = hash32(at::bitwise_xor(hash32(at::bitwise_xor(low, hash32(at::bitwise_xor(high, s1)))), s0));
  if (float32) return (at::bitwise_right_shift(bits, 9).to(at::kDouble) + 0.5) * std::ldexp(1.0, -23);
  return (bits.to(at::kDouble) + 0.5) * std::ldexp(1.0, -32);
}

inline uint32_t hash32_scalar(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0xd35a2d97u;
  x ^= x >> 15;
  return x;
}

template <typename T>
void fill_counter_uniform(T* data, uint64_t seed, int64_t sq, int64_t sk, int64_t start, int64_t len, int64_t rows, bool float32) {
  const auto s0 = static_cast<uint32_t>(seed & 0xffffffffULL), s1 = static_cast<uint32_t>(seed >> 32);
  const double scale = float32 ? std::ldexp(1.0, -23) : std::ldexp(1.0, -32);
  const int shift = float32 ? 9 : 0;
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const int64_t i = start + r % len;
      const auto base = static_cast<uint64_t>(((r / len) * sq + i) * sk);
      T* row = data + r * sk;
      for (int64_t j = 0; j < sk; ++j) {
        const uint64_t index = base + static_cast<uint64_t>(j);
        const auto low = static_cast<uint32_t>(index & 0xffffffffULL), high = static_cast<uint32_t>(index >> 32);
        const uint32_t bits = hash32_scalar(hash32_scalar(low ^ hash32_scalar(high ^ s1)) ^ s0);
        row[j] = static_cast<T>((static_cast<double>(bits >> shift) + 0.5) * scale);
      }
    }
  });
}

// `out_type` float32 (only with float32 draws, whose 24 significant bits it holds exactly) or
// float64: the same values either way.
at::Tensor counter_uniform_cpu(uint64_t seed, at::IntArrayRef shape, int64_t start, int64_t len, bool float32, at::ScalarType out_type) {
  const int64_t b = shape[0], h = shape[1], sq = shape[2], sk = shape[3];
  auto out = at::empty({b, h, len, sk}, at::TensorOptions().dtype(float32 ? out_type : at::kDouble));
  if (out.scalar_type() == at::kFloat) {
    fill_counter_uniform(out.data_ptr<float>(), seed, sq, sk, start, len, b * h * len, float32);
  } else {
    fill_counter_uniform(out.data_ptr<double>(), seed, sq, sk, start, len, b * h * len, float32);
  }
  return out;
}

at::Tensor counter_uniform(uint64_t seed, at::IntArrayRef shape, int64_t start, int64_t len, at::ScalarType dtype, at::Device device,
                           bool ops = false) {
  const bool float32 = dtype == at::kFloat;
  if (device.is_cpu() && !ops) return counter_uniform_cpu(seed, shape, start, len, float32, at::kDouble);
  return counter_uniform_ops(seed, shape, start, len, float32, device);
}

// The eager path's noise convention: ε ~ U(0, 1) for Weibull, ε ~ N(0, 1) for Lognormal (the
// inverse normal CDF of the uniform, in float64), in `dtype`. Uniform float32 draws on the CPU are
// written as float32 directly (one pass, no float64 block).
at::Tensor counter_noise(uint64_t seed, int64_t noise, at::IntArrayRef shape, int64_t start, int64_t len, at::ScalarType dtype,
                         at::Device device, bool ops = false) {
  if (noise == kWeibull && device.is_cpu() && !ops) {
    return counter_uniform_cpu(seed, shape, start, len, dtype == at::kFloat, dtype).to(dtype);
  }
  auto u = counter_uniform(seed, shape, start, len, dtype, device, ops);
  if (noise == kLognormal) u = at::erfinv(u * 2.0 - 1.0) * std::sqrt(2.0);
  return u.to(dtype);
}

// The log-domain perturbation of ε, as src/normalize/bam.rs's `perturb`, in place on a tensor of
// the caller's own (the same operations, in the same order, as the out-of-place form).
at::Tensor noise_term_(at::Tensor eps, int64_t noise, double scale) {
  if (noise == kWeibull) eps.clamp_min_(static_cast<double>(FLT_MIN)).neg_().log1p_().neg_().log_();
  return eps.mul_(scale);
}

// The noise term of rows [start, start + len) of the scores, (B, H, len, S_k), a fresh tensor:
// from `given` (ε expanded to the scores' shape) or from the counter-based draws.
at::Tensor noise_rows(const at::Tensor& given, uint64_t seed, int64_t noise, double scale, at::IntArrayRef shape, int64_t start,
                      int64_t len, at::ScalarType dtype, at::Device device) {
  at::Tensor eps;
  if (given.defined()) {
    const auto rows = given.narrow(-2, start, len);
    eps = at::empty(rows.sizes(), rows.options().dtype(dtype));
    eps.copy_(rows);
  } else {
    eps = counter_noise(seed, noise, shape, start, len, dtype, device);
  }
  return noise_term_(eps, noise, scale);
}

// ---- tiles

at::Tensor filled(const at::Tensor& t, const at::Tensor& excluded, double value) {
  return excluded.defined() ? t.masked_fill(excluded, value) : t;
}

// exp(t), exactly 0 on excluded entries.
at::Tensor masked_exp(const at::Tensor& t, const at::Tensor& excluded) { return filled(at::exp(t), excluded, 0.0); }

// What the forward and backward passes of one call share: the inputs, the settings and the
// statistics, and how a tile's scores, log-weights and weights are formed from them.
struct Problem {
  at::Tensor qs, k, v;     // q already scaled by sqrt(1/d)
  at::Tensor excluded;     // bool, broadcastable to (B, H, S_q, S_k); undefined: none
  at::Tensor given_noise;  // ε expanded to (B, H, S_q, S_k); undefined: counter-based draws
  int64_t tile, sweeps, noise;
  double noise_scale;
  uint64_t seed;
  std::vector<at::Tensor> c;  // c[t] = C^{t+1}, (B, H, 1, S_k)
  std::vector<at::Tensor> r;  // r[t] = R^{t+1}, (B, H, S_q, 1), t < sweeps - 1

  int64_t queries() const { return qs.size(-2); }
  std::vector<int64_t> shape() const { return {qs.size(0), qs.size(1), qs.size(2), k.size(2)}; }

  template <typename F>
  void each(F&& f) const {
    for (int64_t start = 0; start < queries(); start += tile) f(start, std::min(tile, queries() - start));
  }

  at::Tensor excluded_rows(int64_t start, int64_t len) const {
    if (!excluded.defined() || excluded.size(-2) == 1) return excluded;
    return excluded.narrow(-2, start, len);
  }
  at::Tensor scores(int64_t start, int64_t len, const at::Tensor& ex) const {
    return filled(at::matmul(qs.narrow(-2, start, len), k.transpose(-2, -1)), ex, kMaskValue);
  }
  // z - s filled, s a per-row or per-key statistic.
  static at::Tensor minus(const at::Tensor& z, const at::Tensor& s, const at::Tensor& ex) { return filled(z - s, ex, kMaskValue); }
  // y = z - C^N.
  at::Tensor logits(const at::Tensor& z, const at::Tensor& ex) const { return sweeps == 0 ? z : minus(z, c.back(), ex); }
  // The (noisy) weights of a tile from its logits y.
  at::Tensor weights(const at::Tensor& y, int64_t start, int64_t len, const at::Tensor& ex) const {
    auto a = y;
    if (noise != kNoNoise) {
      a = filled(noise_rows(given_noise, seed, noise, noise_scale, shape(), start, len, y.scalar_type(), y.device()).add_(y), ex,
                 kMaskValue);
    }
    return filled(at::softmax(a, -1), ex, 0.0);
  }
  at::Tensor r_rows(size_t t, int64_t start, int64_t len) const { return r[t].narrow(-2, start, len); }
  // A^t of a tile (t 1-based): exp(z - R^{t-1} - C^t).
  at::Tensor col_jacobian(size_t t, const at::Tensor& z, int64_t start, int64_t len, const at::Tensor& ex) const {
    auto base = t == 1 ? z : minus(z, r_rows(t - 2, start, len), ex);
    return masked_exp(base - c[t - 1], ex);
  }
  // B^t of a tile (t 1-based, t < N): exp(z - C^t - R^t).
  at::Tensor row_jacobian(size_t t, const at::Tensor& z, int64_t start, int64_t len, const at::Tensor& ex) const {
    return masked_exp(minus(z, c[t - 1], ex) - r_rows(t - 1, start, len), ex);
  }

  // C¹ … C^N and R¹ … R^{N-1}.
  void sweep() {
    for (int64_t t = 1; t <= sweeps; ++t) {
      at::Tensor col;
      std::vector<at::Tensor> rows;
      each([&](int64_t start, int64_t len) {
        auto ex = excluded_rows(start, len);
        auto z = scores(start, len, ex);
        if (t > 1) {
          auto r_tile = at::logsumexp(minus(z, c.back(), ex), {-1}, true);
          z = minus(z, r_tile, ex);
          rows.push_back(r_tile);
        }
        auto lse = at::logsumexp(z, {-2}, true);
        col = col.defined() ? at::logaddexp(col, lse) : lse;
      });
      if (t > 1) r.push_back(at::cat(rows, -2));
      c.push_back(col);
    }
  }
};

// The KL's part T of a tile and its derivative in log π, over the allowed entries.
struct KlTerm {
  int64_t kind;
  at::Tensor a;  // broadcastable to (B, H, 1, S_k)

  at::Tensor value(const at::Tensor& log_pi, const at::Tensor& ex) const {
    auto t = kind == kWeibullCross ? a * log_pi : (log_pi - a).square();
    return filled(t, ex, 0.0).sum({-2, -1});  // (B, H)
  }
  at::Tensor grad(const at::Tensor& log_pi, const at::Tensor& ex) const {
    auto g = kind == kWeibullCross ? (a * at::ones_like(log_pi)) : (log_pi - a) * 2.0;
    return filled(g, ex, 0.0);
  }
  // ∂T/∂a_j summed over the tile's rows, (B, H, 1, S_k).
  at::Tensor grad_a(const at::Tensor& log_pi, const at::Tensor& ex) const {
    auto g = kind == kWeibullCross ? log_pi : (a - log_pi) * 2.0;
    return filled(g, ex, 0.0).sum(-2, true);
  }
};

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
// The received mass Σ_i P_ij = Σ_i exp(z_ij - C_j - R_i) is the kernel with the keys as queries
// and values exp(min R - R), scaled back (exp(C' - C) for softmax, whose C is that call's own).
// A sequence whose keys are all filled keeps the tile loop (the kernel would average its values
// where the eager path returns zeros).

bool fused_cpu_applies(const at::Tensor& q, const at::Tensor& v, const at::Tensor& excluded, int64_t noise, int64_t kl) {
  if (!q.device().is_cpu() || noise != kNoNoise || kl != kNoKl) return false;
  if (q.dim() != 4 || v.size(-1) != q.size(-1)) return false;
  if (!excluded.defined()) return true;
  return excluded.size(-2) == 1 && !excluded.all(-1).any().item<bool>();
}

// The key mask as the kernel's additive bias, -bias on allowed keys; (B, H, 1, S_k), contiguous:
// the kernel's log-sum-exp comes back with strides (S·H, 1, H), and a mask laid out like that is
// expanded to a full (S_q, S_k) copy by the kernel (checked: 512 MiB more at S = 4096, H = 8).
at::Tensor key_bias(const at::Tensor& minus, const at::Tensor& excluded) {
  auto bias = excluded.defined() ? at::where(excluded, at::scalar_tensor(kMaskValue, minus.options()), -minus) : -minus;
  return bias.contiguous();
}

// The kernel on (q, k, x) with an optional bias: (output, log-sum-exp in q's dtype). Values wider
// than q ride on a zero column of q and k; narrower ones on zero columns of their own.
std::pair<at::Tensor, at::Tensor> kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& x, const at::Tensor& bias,
                                         double scale) {
  const int64_t d = q.size(-1), w = x.size(-1);
  auto widen = [](const at::Tensor& t, int64_t to) { return at::constant_pad_nd(t, {0, to - t.size(-1)}, 0.0); };
  std::optional<at::Tensor> mask = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  at::Tensor out, lse;
  if (w > d) {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(widen(q, w), widen(k, w), x, 0.0, false, mask, scale);
  } else {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(q, k, w < d ? widen(x, d) : x, 0.0, false, mask, scale);
    out = out.narrow(-1, 0, w);
  }
  return {out, lse.to(q.scalar_type())};
}

// Σ_i P_ij with P = exp(z - col - R) (col the per-key statistic the output pass subtracted, zeros
// for softmax), (B, H, S_k); 0 on filled keys.
at::Tensor fused_mass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& col, const at::Tensor& r, const at::Tensor& excluded,
                      double scale) {
  auto r_min = r.amin(-1, true);                                                   // (B, H, 1)
  auto weights = at::exp(r_min - r).unsqueeze(-1).expand(q.sizes()).contiguous();  // ≤ 1
  auto [out, lse] = kernel(k, q, weights, at::Tensor(), scale);
  // out_j = Σ_i exp(z_ij - lse_j) exp(r_min - R_i), so mass_j = out_j exp(lse_j - col_j - r_min).
  auto mass = at::exp(at::log(out.select(-1, 0)) + lse - col - r_min);
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
    auto col = sweeps > 0 ? c.back() : at::zeros({q.size(0), q.size(1), k.size(2)}, q.options());
    auto bias = key_bias(col.unsqueeze(-2), ex);
    auto [out, r_last] = kernel(q, k, v, bias, scale);
    auto mass = fused_mass(q, k, col, r_last, ex, scale);
    ctx->save_for_backward({q, k, v, out, r_last, bias});
    ctx->saved_data["excluded"] = ex.defined() ? at::IValue(ex) : at::IValue();
    ctx->saved_data["c"] = at::IValue(c);
    ctx->saved_data["r"] = at::IValue(r);
    ctx->saved_data["col_q"] = at::IValue(col_q);
    ctx->saved_data["row_k"] = at::IValue(row_k);
    ctx->mark_non_differentiable({mass});
    return {out, mass, at::zeros({q.size(0), q.size(1)}, q.options())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &r_last = saved[4], &bias = saved[5];
    const auto c = ctx->saved_data["c"].toTensorVector(), r = ctx->saved_data["r"].toTensorVector();
    const auto col_q = ctx->saved_data["col_q"].toTensorVector(), row_k = ctx->saved_data["row_k"].toTensorVector();
    const auto ex = ctx->saved_data["excluded"].isNone() ? at::Tensor() : ctx->saved_data["excluded"].toTensor();
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
    // One column of ones on q (zeros on the others) carries g = Σ_i dY_ij into dk.
    auto pad = [](const at::Tensor& t) { return at::constant_pad_nd(t, {0, 1}, 0.0); };
    auto qa = pad(q);
    qa.select(-1, d).fill_(1.0);
    std::tie(dq, dk, dv) =
        at::_scaled_dot_product_flash_attention_for_cpu_backward(pad(dout), qa, pad(k), pad(v), pad(out), r_last, 0.0, false, bias, scale);
    auto g = dk.select(-1, d) / scale;  // (B, H, S_k)
    dq = dq.narrow(-1, 0, d);
    dk = dk.narrow(-1, 0, d);
    dv = dv.narrow(-1, 0, d);
    auto keys_only = [&](const at::Tensor& t) { return ex.defined() ? t.masked_fill(ex.squeeze(-2).expand_as(t), 0.0) : t; };
    auto with_ones = [](const at::Tensor& w, const at::Tensor& x) { return at::cat({w.unsqueeze(-1) * x, w.unsqueeze(-1)}, -1); };
    auto dc = keys_only(-g);  // dC^N
    for (size_t t = n; t >= 1; --t) {
      auto [a, lse] = kernel(q, k, with_ones(dc, k), key_bias(c[t - 1].unsqueeze(-2), ex), scale);
      auto a_scale = t >= 2 ? at::exp(lse - r[t - 2]) : at::exp(lse);  // exp(lse_i - R^{t-1}_i)
      dq = dq + a.narrow(-1, 0, d) * (a_scale * scale).unsqueeze(-1);
      dk = dk + col_q[t - 1] * (dc * scale).unsqueeze(-1);
      if (t == 1) break;
      auto dr = -a.select(-1, d) * a_scale;  // dR^{t-1}
      dq = dq + row_k[t - 2] * (dr * scale).unsqueeze(-1);
      auto [b, lse_c] = kernel(k, q, with_ones(dr, q), (-r[t - 2]).unsqueeze(-2).contiguous(), scale);
      auto b_scale = keys_only(at::exp(lse_c - c[t - 2]));  // exp(lse_j - C^{t-1}_j), 0 on filled keys
      dk = dk + b.narrow(-1, 0, d) * (b_scale * scale).unsqueeze(-1);
      dc = -b.select(-1, d) * b_scale;  // dC^{t-1}
    }
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
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
//   Lognormal: T = Σ_{i, j∈A} (z_ij - l_i - a_j)²
//                = Σ_i qs_i G qs_iᵀ + |A| Σ_i l_i² + S_q Σ_j a'_j² - 2 Σ_i l_i zr_i - 2 Σ_j a'_j zc_j + 2 α Σ_i l_i,
//              G = Σ_{j∈A} k_jᵀ k_j (d × d), zr_i = qs_i · Σ_{j∈A} k_j.
// Gradients, dT/dz_ij = u_ij - π_ij U_i with u = ∂T/∂log π on A and U_i = Σ_j u_ij, so through
// z = qs kᵀ: dqs_i = Σ_j u_ij k_j - U_i (πK)_i and dk_j = Σ_i u_ij qs_i - Σ_i π_ij U_i qs_i, the
// last the kernel with the keys as queries and the bias -l: out_j exp(lse_j) = Σ_i π_ij x_i.
//   Weibull:   u_ij = a'_j:                  Σ_j u_ij k_j = a'K,  Σ_i u_ij qs_i = a'_j Σ_i qs_i, U_i = α
//   Lognormal: u_ij = 2 (z_ij - l_i - a_j):  Σ_j u_ij k_j = 2 (qs_i G - l_i Σ_{A} k - a'K),
//              Σ_i u_ij qs_i = 2 (k_j QᵀQ - Σ_i l_i qs_i - a_j Σ_i qs_i) (QᵀQ = Σ_i qs_iᵀ qs_i), U_i = 2 (zr_i - |A| l_i - α)
// and ∂T/∂a_j = Σ_i log π_ij = zc_j - Σ_i l_i (Weibull), -2 (zc_j - Σ_i l_i - S_q a_j) (Lognormal), on A.
// Sums like Σ_i qs_i G qs_iᵀ replace sums of squares of the scores: in float32 they agree with
// the tiles to rounding of the (large) total, not entry by entry.

bool fused_cpu_bam_applies(const at::Tensor& q, const at::Tensor& v, const at::Tensor& excluded, int64_t sweeps, int64_t noise) {
  if (!q.device().is_cpu() || noise == kNoNoise || sweeps != 0 || q.dim() != 4 || v.size(-1) != q.size(-1)) return false;
  if (!excluded.defined()) return true;
  return excluded.size(-2) == 1 && !excluded.all(-1).any().item<bool>();
}

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
    auto keep = [&](const char* key, const at::Tensor& t) { ctx->saved_data[key] = t.defined() ? at::IValue(t) : at::IValue(); };
    keep("excluded", ex);
    keep("given", blocks.given);
    keep("prior", prior.value_or(at::Tensor()));
    keep("pik", pik);
    keep("l", l);
    ctx->saved_data["settings"] = std::vector<int64_t>{tile, noise, seed, kl};
    ctx->saved_data["noise_scale"] = noise_scale;
    ctx->mark_non_differentiable({mass});
    return {out, mass, kl_part};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4], &bias = saved[5];
    auto optional = [&](const char* key) { return ctx->saved_data[key].isNone() ? at::Tensor() : ctx->saved_data[key].toTensor(); };
    const auto settings = ctx->saved_data["settings"].toIntVector();
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    const std::vector<int64_t> shape{q.size(0), q.size(1), q.size(2), k.size(2)};
    const Blocks blocks{q, bias, optional("given"), settings[0], settings[1], ctx->saved_data["noise_scale"].toDouble(),
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
    const auto prior = optional("prior");
    if (kl != kNoKl && grads[2].defined()) {
      const KlClosedForm form(q * scale, k, prior, optional("excluded"), kl);
      auto [dqs, dkk, da] = form.grad(optional("l"), optional("pik"), grads[2], scale);
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
    at::Tensor gram() const {                       // G and Σ_A k: the keys of A only
      auto ka = k * allowed.transpose(-2, -1);
      return at::matmul(ka.transpose(-2, -1), ka);
    }
    at::Tensor key_sum() const { return (k * allowed.transpose(-2, -1)).sum(-2, true); }  // (B, H, 1, d)
    at::Tensor count() const { return allowed.sum(-1); }                                   // |A|, (B, H, 1)

    at::Tensor value(const at::Tensor& l) const {  // l (B, H, S_q)
      const auto sum_l = l.sum(-1);
      if (kind == kWeibullCross) return (a * zc).sum({-2, -1}) - alpha().squeeze(-1) * sum_l;
      const auto zr = at::matmul(qs, key_sum().transpose(-2, -1)).squeeze(-1);  // (B, H, S_q)
      const double sq_rows = static_cast<double>(qs.size(-2));
      return (at::matmul(qs, gram()) * qs).sum({-2, -1}) + count().squeeze(-1) * l.square().sum(-1) +
             a.square().sum({-2, -1}) * sq_rows - (l * zr).sum(-1) * 2.0 - (a * zc).sum({-2, -1}) * 2.0 +
             sum_l * alpha().squeeze(-1) * 2.0;
    }

    // (d qs, d k, d a) for the incoming gradient dt (B, H) of T.
    std::tuple<at::Tensor, at::Tensor, at::Tensor> grad(const at::Tensor& l, const at::Tensor& pik, const at::Tensor& dt,
                                                        double scale) const {
      const auto g = dt.view({dt.size(0), dt.size(1), 1, 1});
      const auto li = l.unsqueeze(-1);                       // (B, H, S_q, 1)
      const auto sum_l = l.sum(-1).view_as(g);
      const auto ak = at::matmul(a, k);                      // a'K, (B, H, 1, d)
      const auto keys = allowed.transpose(-2, -1);           // (B, H, S_k, 1)
      // Σ_i π_ij x_i: the kernel with the keys as queries, bias -l over its keys.
      auto pi_t = [&](const at::Tensor& x) {
        auto [o, lse] = kernel(k, qs / scale, x, (-l).unsqueeze(-2).contiguous(), scale);
        return o * at::exp(lse).unsqueeze(-1);
      };
      at::Tensor dqs, dk, da;
      if (kind == kWeibullCross) {
        const auto al = alpha().unsqueeze(-1);  // (B, H, 1, 1)
        dqs = (ak - pik * al) * g;
        dk = (a.transpose(-2, -1) * sq - pi_t(qs) * al) * keys * g;
        da = (zc - sum_l) * allowed * g;
      } else {
        const auto ks = key_sum();
        const auto u_rows = (at::matmul(qs, ks.transpose(-2, -1)) - li * count().unsqueeze(-1) - alpha().unsqueeze(-1)) * 2.0;
        dqs = ((at::matmul(qs, gram()) - li * ks - ak) * 2.0 - pik * u_rows) * g;
        const auto qq = at::matmul(qs.transpose(-2, -1), qs);
        const auto lq = (li * qs).sum(-2, true);
        dk = ((at::matmul(k, qq) - lq - a.transpose(-2, -1) * sq) * 2.0 - pi_t(u_rows * qs)) * keys * g;
        da = (zc - sum_l - a * static_cast<double>(qs.size(-2))) * allowed * (g * -2.0);
      }
      return {dqs, dk, da};
    }
  };
};

struct TiledAttention : public torch::autograd::Function<TiledAttention> {
  // Optional tensors are optionals, not possibly-undefined tensors: apply() treats tensor
  // arguments as variables of the graph, which an undefined one cannot be.
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> excluded,
                               std::optional<at::Tensor> noise_given, std::optional<at::Tensor> prior, int64_t tile, int64_t sweeps,
                               int64_t noise, double noise_scale, int64_t seed, int64_t kl) {
    Problem pb{q * std::sqrt(1.0 / static_cast<double>(q.size(-1))), k, v, excluded.value_or(at::Tensor()), at::Tensor(), tile,
               sweeps, noise, noise_scale, static_cast<uint64_t>(seed), {}, {}};
    if (noise != kNoNoise && noise_given.has_value()) pb.given_noise = noise_given->expand(pb.shape());
    const KlTerm term{kl, prior.value_or(at::Tensor())};
    pb.sweep();
    std::vector<at::Tensor> outputs, row_lse;
    at::Tensor mass = at::zeros({q.size(0), q.size(1), k.size(2)}, q.options());  // Σ_i P_ij
    at::Tensor kl_part = at::zeros({q.size(0), q.size(1)}, q.options());
    pb.each([&](int64_t start, int64_t len) {
      auto ex = pb.excluded_rows(start, len);
      auto y = pb.logits(pb.scores(start, len, ex), ex);
      auto p = pb.weights(y, start, len, ex);
      outputs.push_back(at::matmul(p, v));
      mass += p.sum(-2);
      if (kl != kNoKl) {
        row_lse.push_back(at::logsumexp(y, {-1}, true));
        kl_part += term.value(y - row_lse.back(), ex);
      }
    });
    auto out = at::cat(outputs, -2);  // (B, H, S_q, d_v)
    ctx->save_for_backward({q, k, v, out});
    auto keep = [&](const char* key, const at::Tensor& t) { ctx->saved_data[key] = t.defined() ? at::IValue(t) : at::IValue(); };
    keep("excluded", pb.excluded);
    keep("noise", pb.given_noise);
    keep("prior", term.a);
    keep("row_lse", kl != kNoKl ? at::cat(row_lse, -2) : at::Tensor());
    ctx->saved_data["c"] = at::IValue(pb.c);
    ctx->saved_data["r"] = at::IValue(pb.r);
    ctx->saved_data["settings"] = std::vector<int64_t>{tile, sweeps, noise, seed, kl};
    ctx->saved_data["noise_scale"] = noise_scale;
    ctx->mark_non_differentiable({mass});
    return {out, mass, kl_part};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    auto optional = [&](const char* key) { return ctx->saved_data[key].isNone() ? at::Tensor() : ctx->saved_data[key].toTensor(); };
    const auto settings = ctx->saved_data["settings"].toIntVector();
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    Problem pb{q * scale, k, v, optional("excluded"), optional("noise"), settings[0], settings[1], settings[2],
               ctx->saved_data["noise_scale"].toDouble(), static_cast<uint64_t>(settings[3]), ctx->saved_data["c"].toTensorVector(),
               ctx->saved_data["r"].toTensorVector()};
    const KlTerm term{settings[4], optional("prior")};
    const auto row_lse = optional("row_lse");
    const size_t n = static_cast<size_t>(pb.sweeps);
    auto dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const bool with_kl = term.kind != kNoKl && grads[2].defined();
    const auto dkl = with_kl ? grads[2].view({q.size(0), q.size(1), 1, 1}) : at::Tensor();
    auto d = (dout * out).sum(-1, true);  // (B, H, S_q, 1)
    auto dv = at::zeros_like(v), dk = at::zeros_like(k);
    at::Tensor da = with_kl ? at::zeros({q.size(0), q.size(1), 1, k.size(2)}, q.options()) : at::Tensor();
    std::vector<at::Tensor> dq;

    // The KL term's part of dY in a tile (undefined without one); the first pass also adds its
    // gradient in the prior's values.
    auto kl_grad = [&](int64_t start, int64_t len, const at::Tensor& ex, const at::Tensor& y, bool first_pass) {
      if (!with_kl) return at::Tensor();
      auto log_pi = y - row_lse.narrow(-2, start, len);
      auto pi = masked_exp(log_pi, ex);
      auto dlog_pi = term.grad(log_pi, ex) * dkl;
      if (first_pass) da += term.grad_a(log_pi, ex) * dkl;
      return dlog_pi - pi * dlog_pi.sum(-1, true);
    };
    // dY of a tile (the gradient in y = z - C^N), with the weights P.
    auto logits_grad = [&](int64_t start, int64_t len, const at::Tensor& ex, const at::Tensor& z, bool first_pass) {
      auto y = pb.logits(z, ex);
      auto p = pb.weights(y, start, len, ex);
      auto dp = at::matmul(dout.narrow(-2, start, len), v.transpose(-2, -1));
      auto dy = p * (dp - d.narrow(-2, start, len));
      auto dy_kl = kl_grad(start, len, ex, y, first_pass);
      if (dy_kl.defined()) dy = dy + dy_kl;
      return std::make_pair(p, dy);
    };
    auto finish = [&](int64_t start, int64_t len, const at::Tensor& dz) {
      dq.push_back(at::matmul(dz, k) * scale);
      dk.add_(at::matmul(dz.transpose(-2, -1), pb.qs.narrow(-2, start, len)));
    };

    // First pass: dV, and for softmax dZ itself. With sweeps it gathers g = Σ_i dY_ij instead,
    // without dP: Σ_i P_ij (dP_ij - D_i) = v_j · dV_j - Σ_i P_ij D_i, so one matrix product fewer.
    at::Tensor g, pd;  // pd = Σ_i P_ij D_i, (B, H, 1, S_k)
    pb.each([&](int64_t start, int64_t len) {
      auto ex = pb.excluded_rows(start, len);
      auto z = pb.scores(start, len, ex);
      if (n == 0) {
        auto [p, dy] = logits_grad(start, len, ex, z, true);
        dv.add_(at::matmul(p.transpose(-2, -1), dout.narrow(-2, start, len)));
        finish(start, len, dy);
        return;
      }
      auto y = pb.logits(z, ex);
      auto p = pb.weights(y, start, len, ex);
      dv.add_(at::matmul(p.transpose(-2, -1), dout.narrow(-2, start, len)));
      auto col = at::matmul(d.narrow(-2, start, len).transpose(-2, -1), p);
      auto dy_kl = kl_grad(start, len, ex, y, true);
      if (dy_kl.defined()) col = col - dy_kl.sum(-2, true);
      pd = pd.defined() ? pd + col : col;
    });
    if (n > 0) g = (v * dv).sum(-1).unsqueeze(-2) - pd;
    if (n > 0) {
      std::vector<at::Tensor> dc(n), dr(n > 1 ? n - 1 : 0);
      dc[n - 1] = -g;
      for (size_t t = n; t >= 2; --t) {  // down the chain of statistics
        std::vector<at::Tensor> rows;
        at::Tensor col;
        pb.each([&](int64_t start, int64_t len) {
          auto ex = pb.excluded_rows(start, len);
          auto z = pb.scores(start, len, ex);
          auto dr_tile = -(pb.col_jacobian(t, z, start, len, ex) * dc[t - 1]).sum(-1, true);
          auto dc_tile = -(pb.row_jacobian(t - 1, z, start, len, ex) * dr_tile).sum(-2, true);
          col = col.defined() ? col + dc_tile : dc_tile;
          rows.push_back(dr_tile);
        });
        dr[t - 2] = at::cat(rows, -2);
        dc[t - 2] = col;
      }
      pb.each([&](int64_t start, int64_t len) {  // dZ
        auto ex = pb.excluded_rows(start, len);
        auto z = pb.scores(start, len, ex);
        auto dz = logits_grad(start, len, ex, z, false).second;
        for (size_t t = 1; t <= n; ++t) dz = dz + pb.col_jacobian(t, z, start, len, ex) * dc[t - 1];
        for (size_t t = 1; t < n; ++t) dz = dz + pb.row_jacobian(t, z, start, len, ex) * dr[t - 1].narrow(-2, start, len);
        finish(start, len, dz);
      });
    }
    at::Tensor dprior;
    if (with_kl && term.a.defined() && term.a.requires_grad()) dprior = at::sum_to(da, term.a.sizes());
    return {at::cat(dq, -2), dk, dv, at::Tensor(), at::Tensor(), dprior, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

char* pa_tiled_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* excluded, const pa_tensor* noise,
                         const pa_tensor* prior, const pa_tiled_spec* spec, pa_tensor** out, pa_tensor** received_mass,
                         pa_tensor** kl_part) {
  return probattn::guard([&] {
    TORCH_CHECK(spec->tile >= 1, "the tile size must be at least 1, got ", spec->tile);
    TORCH_CHECK(spec->sweeps >= 0, "the number of sweeps must be at least 0, got ", spec->sweeps);
    TORCH_CHECK(spec->noise >= kNoNoise && spec->noise <= kLognormal, "unknown noise kind ", spec->noise);
    TORCH_CHECK(spec->kl >= kNoKl && spec->kl <= kLognormalSquares, "unknown KL kind ", spec->kl);
    TORCH_CHECK(spec->kl == kNoKl || prior != nullptr, "a KL term needs the prior's per-key values");
    auto some = [](const pa_tensor* t) { return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt; };
    if (spec->fused_cpu != 0 && fused_cpu_applies(*q, *v, excluded != nullptr ? *excluded : at::Tensor(), spec->noise, spec->kl)) {
      auto result = FusedCpuAttention::apply(*q, *k, *v, some(excluded), spec->sweeps);
      *out = new at::Tensor(result[0]);
      *received_mass = new at::Tensor(result[1]);
      *kl_part = new at::Tensor(result[2]);
      return;
    }
    if (spec->fused_cpu != 0 &&
        fused_cpu_bam_applies(*q, *v, excluded != nullptr ? *excluded : at::Tensor(), spec->sweeps, spec->noise)) {
      auto result = FusedCpuBam::apply(*q, *k, *v, some(excluded), some(noise), some(prior), spec->tile, spec->noise, spec->noise_scale,
                                       static_cast<int64_t>(spec->seed), spec->kl);
      *out = new at::Tensor(result[0]);
      *received_mass = new at::Tensor(result[1]);
      *kl_part = new at::Tensor(result[2]);
      return;
    }
    auto result = TiledAttention::apply(*q, *k, *v, some(excluded), some(noise), some(prior), spec->tile, spec->sweeps, spec->noise,
                                        spec->noise_scale, static_cast<int64_t>(spec->seed), spec->kl);
    *out = new at::Tensor(result[0]);
    *received_mass = new at::Tensor(result[1]);
    *kl_part = new at::Tensor(result[2]);
  });
}

char* pa_counter_noise(const pa_tensor* like, const int64_t* shape, int32_t noise, uint64_t seed, int64_t start, int64_t len,
                       int32_t aten_ops, pa_tensor** out) {
  return probattn::guard([&] {
    TORCH_CHECK(noise == kWeibull || noise == kLognormal, "unknown noise kind ", noise);
    TORCH_CHECK(like->scalar_type() == at::kFloat || like->scalar_type() == at::kDouble, "counter-based noise is float32 or float64");
    const at::IntArrayRef dims(shape, 4);
    TORCH_CHECK(start >= 0 && len >= 0 && start + len <= dims[2], "rows [", start, ", ", start + len, ") outside ", dims[2], " queries");
    *out = new at::Tensor(counter_noise(seed, noise, dims, start, len, like->scalar_type(), like->device(), aten_ops != 0));
  });
}

}  // extern "C"
