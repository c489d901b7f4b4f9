// Memory-efficient attention: softmax, DNAS and Sinkhorn-N (Ding et al. 2020), and BAM's sampled
// weights (Fan et al. 2020) over any of them, tiled over blocks of queries, forward and backward,
// as a torch::autograd::Function whose passes are ATen ops (CPU and CUDA alike). No (S_q, S_k)
// tensor is kept: each pass holds one (tile, S_k) block of scores at a time, and what is saved for
// backward is q, k, v, the output and O(S) statistics per head. On the CPU, where the mask allows
// it, libtorch's fused flash-attention kernel does the work of the tile loop (csrc/fused_cpu.cpp).
//
// Scores z = (q · sqrt(1/d)) kᵀ + b, b an optional additive mask (its -inf entries arrive excluded
// too), excluded entries filled with -1e30 as the eager path does; every exponential of a filled
// entry is set to exactly 0 (a fully excluded row or column is all zeros). Keys and values may have
// fewer heads than the queries (grouped-query attention): query head h reads key/value head
// h / g, g = H / H_kv, through products that take the g query heads of a group as one matrix
// (grouped_product); the key/value heads are never repeated.
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
// dk = dZᵀ (q · sqrt(1/d)), dv = Pᵀ dO, db = dZ summed to b's shape. For DNAS this is
// dZ = dY - Pc ∘ g of docs/formulas.md §5.
//
// BAM: the sampled weights are row-softmax(log π + n) = row-softmax(y + n): the per-row constant
// cancels. n = (1/k) log(-log(1 - ε)), ε ~ U(0, 1) (Weibull) or σ ε, ε ~ N(0, 1) (Lognormal), from
// a given tensor or from a counter-based generator keyed by (seed, b, h, i, j) and regenerated per
// tile, so forward and backward see the same draws. The KL term's only part that needs the scores
// is, per (b, h), over the allowed entries,
//   Weibull:   T = Σ_ij a_j log π_ij         (a_j = α_j, the Gamma prior's shape)
//   Lognormal: T = Σ_ij (log π_ij - a_j)²    (a_j = μ_p,j + σ²/2)
// returned as the third output, differentiable in the scores and in a; the Rust side adds the
// per-key and per-row terms (src/attention/tiled.rs). Its gradient in y: dT/dlog π - π ∘ Σ_j dT/dlog π.
//
// BAM over HNAS (a gate logit per head, u = sigmoid(logit), one sweep): the base's log-weights are
// y = log(u π_D + (1 - u) π_S), π_D = exp(z - C¹ - R_D) DNAS's weights and π_S = exp(z - R_S)
// softmax's, whose row statistics R_D and R_S take one more pass before the output pass. With
// e = dY (as above) and the shares w_D = u π_D / π, w_S = (1 - u) π_S / π, each branch's gradient in
// its own logits is w_D ∘ e - π_D ∘ Σ_j w_D e (DNAS, whose column correction takes g = Σ_i of it)
// and w_S ∘ e - π_S ∘ Σ_j w_S e (softmax); the gate's is Σ e ∘ (π_D - π_S) / π · u (1 - u). A tile
// holds whole rows, so the per-row sums are formed where they are used: one pass for dV, g and the
// gate, one for dZ.

#include <cmath>
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "boundary.h"
#include "tiled.h"

namespace {

using namespace probattn::tiled;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- tiles

// t (B, H, len, x) as (B, H_kv, g · len, x), H = g · H_kv: the g query heads of each group as one
// matrix (a copy of t when it is a narrowed tile and g > 1).
at::Tensor as_groups(const at::Tensor& t, int64_t kv_heads) {
  return t.reshape({t.size(0), kv_heads, t.size(1) / kv_heads * t.size(2), t.size(3)});
}

// rows (B, H, t, x) times m (B, H_kv, x, y), (B, H, t, y), where head h of `rows` meets head h / g
// of `m`: the g heads of a group are one product, `m` is read as it is. With H = H_kv,
// at::matmul(rows, m) itself.
at::Tensor grouped_product(const at::Tensor& rows, const at::Tensor& m) {
  if (rows.size(1) == m.size(1)) return at::matmul(rows, m);
  auto product = at::matmul(as_groups(rows, m.size(1)), m);
  return product.view({rows.size(0), rows.size(1), rows.size(2), product.size(-1)});
}

// Σ over the g query heads of each group of aᵀ b: a (B, H, t, x), b (B, H, t, y), (B, H_kv, x, y).
at::Tensor grouped_transposed_product(const at::Tensor& a, const at::Tensor& b, int64_t kv_heads) {
  if (a.size(1) == kv_heads) return at::matmul(a.transpose(-2, -1), b);
  return at::matmul(as_groups(a, kv_heads).transpose(-2, -1), as_groups(b, kv_heads));
}

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
  at::Tensor bias;            // the additive mask in the statistics' dtype, rank 4; undefined: none
  at::Tensor log_u{}, log_1mu{};  // BAM over HNAS: log u and log(1 - u), (1, H, 1, 1); undefined: no mix
  at::Tensor rd{}, rs{};          // and DNAS's and softmax's row log-sum-exps, (B, H, S_q, 1)
  // The keys as the scores multiply them, arranged once per call. Scores come out in the
  // statistics' dtype unrounded, as the fused route and the eager path form them (scores rounded to
  // bfloat16 are off by up to 2^-9 of their size, and every weight by as much, relatively): on the
  // CPU bfloat16 keys are widened and multiplied in float32; on CUDA they stay bfloat16 for the
  // tensor cores, whose float32 sums bmm's out_dtype returns unrounded (see product), and are made
  // contiguous so that their B·H matrices are one view.
  at::Tensor score_keys = qs.is_cpu() ? k.to(stats()) : k.scalar_type() == stats() ? k : k.contiguous();

  int64_t queries() const { return qs.size(-2); }
  at::ScalarType stats() const { return statistics_type(qs.scalar_type()); }
  std::vector<int64_t> shape() const { return {qs.size(0), qs.size(1), qs.size(2), k.size(2)}; }

  template <typename F>
  void each(F&& f) const {
    for (int64_t start = 0; start < queries(); start += tile) f(start, std::min(tile, queries() - start));
  }

  // Rows [start, start + len) of a mask broadcastable to (B, H, S_q, S_k) (itself when it has one row).
  static at::Tensor rows_of(const at::Tensor& t, int64_t start, int64_t len) {
    if (!t.defined() || t.size(-2) == 1) return t;
    return t.narrow(-2, start, len);
  }
  at::Tensor excluded_rows(int64_t start, int64_t len) const { return rows_of(excluded, start, len); }
  // A tile's scores in the statistics' dtype, its rows in score_keys' dtype.
  at::Tensor scores(int64_t start, int64_t len, const at::Tensor& ex) const {
    auto z = product(qs.narrow(-2, start, len).to(score_keys.scalar_type()));
    if (bias.defined()) z.add_(rows_of(bias, start, len));
    return filled_(z, ex, kMaskValue);
  }
  // rows · score_keysᵀ in the statistics' dtype, grouped where the keys have fewer heads. Narrower
  // operands (bfloat16 on CUDA) go through bmm with out_dtype over the B·H_kv matrices.
  at::Tensor product(const at::Tensor& rows) const {
    const auto keys_t = score_keys.transpose(-2, -1);
    if (rows.scalar_type() == stats()) return grouped_product(rows, keys_t);
    const auto grouped = as_groups(rows, keys_t.size(1));
    return at::bmm(grouped.flatten(0, 1), keys_t.flatten(0, 1), stats()).view({rows.size(0), rows.size(1), rows.size(2), keys_t.size(-1)});
  }
  // z - s filled, s a per-row or per-key statistic.
  static at::Tensor minus(const at::Tensor& z, const at::Tensor& s, const at::Tensor& ex) { return filled_(z - s, ex, kMaskValue); }
  bool mix() const { return log_u.defined(); }
  // A tile's log π_D and log π_S (BAM over HNAS).
  std::pair<at::Tensor, at::Tensor> branch_logs(const at::Tensor& z, int64_t start, int64_t len, const at::Tensor& ex) const {
    return {minus(minus(z, c[0], ex), rd.narrow(-2, start, len), ex), minus(z, rs.narrow(-2, start, len), ex)};
  }
  // HNAS's log-weights log(u π_D + (1 - u) π_S) from the branches' log-weights.
  at::Tensor mixed(const at::Tensor& log_d, const at::Tensor& log_s, const at::Tensor& ex) const {
    return filled_(at::logaddexp(log_d + log_u, log_s + log_1mu), ex, kMaskValue);
  }
  // The base's logits: y = z - C^N, or HNAS's log-weights when mixing.
  at::Tensor logits(const at::Tensor& z, int64_t start, int64_t len, const at::Tensor& ex) const {
    if (mix()) {
      auto [log_d, log_s] = branch_logs(z, start, len, ex);
      return mixed(log_d, log_s, ex);
    }
    return sweeps == 0 ? z : minus(z, c.back(), ex);
  }
  // The (noisy) weights of a tile from its logits y.
  at::Tensor weights(const at::Tensor& y, int64_t start, int64_t len, const at::Tensor& ex) const {
    auto a = y;
    if (noise != kNoNoise) {
      a = filled_(noise_rows(given_noise, seed, noise, noise_scale, shape(), start, len, y.scalar_type(), y.device()).add_(y), ex,
                  kMaskValue);
    }
    return filled_(at::softmax(a, -1), ex, 0.0);
  }
  at::Tensor r_rows(size_t t, int64_t start, int64_t len) const { return r[t].narrow(-2, start, len); }
  // A^t of a tile (t 1-based): exp(z - R^{t-1} - C^t).
  at::Tensor col_jacobian(size_t t, const at::Tensor& z, int64_t start, int64_t len, const at::Tensor& ex) const {
    return masked_exp_(t == 1 ? z - c[t - 1] : minus(z, r_rows(t - 2, start, len), ex).sub_(c[t - 1]), ex);
  }
  // B^t of a tile (t 1-based, t < N): exp(z - C^t - R^t).
  at::Tensor row_jacobian(size_t t, const at::Tensor& z, int64_t start, int64_t len, const at::Tensor& ex) const {
    return masked_exp_(minus(z, c[t - 1], ex).sub_(r_rows(t - 1, start, len)), ex);
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

  // R_D and R_S, after `sweep` (BAM over HNAS).
  void mix_rows() {
    std::vector<at::Tensor> d, s;
    each([&](int64_t start, int64_t len) {
      auto ex = excluded_rows(start, len);
      auto z = scores(start, len, ex);
      d.push_back(at::logsumexp(minus(z, c[0], ex), {-1}, true));
      s.push_back(at::logsumexp(z, {-1}, true));
    });
    rd = at::cat(d, -2);
    rs = at::cat(s, -2);
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

// BAM over HNAS: the gate's log u and log(1 - u) from its logits (H,) (undefined: no mix).
void set_mix(Problem& pb, const at::Tensor& logit) {
  if (!logit.defined()) return;
  const auto l = logit.detach().to(pb.stats()).view({1, -1, 1, 1});
  pb.log_u = at::log_sigmoid(l);
  pb.log_1mu = at::log_sigmoid(-l);
}

struct TiledAttention : public torch::autograd::Function<TiledAttention> {
  // Optional tensors are optionals, not possibly-undefined tensors: apply() treats tensor
  // arguments as variables of the graph, which an undefined one cannot be.
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v, std::optional<at::Tensor> excluded,
                               std::optional<at::Tensor> bias, std::optional<at::Tensor> noise_given, std::optional<at::Tensor> prior,
                               std::optional<at::Tensor> hybrid_logit, int64_t tile, int64_t sweeps, int64_t noise, double noise_scale,
                               int64_t seed, int64_t kl) {
    const NoAutocast no_autocast;
    Problem pb{q * std::sqrt(1.0 / static_cast<double>(q.size(-1))), k, v, excluded.value_or(at::Tensor()), at::Tensor(), tile,
               sweeps, noise, noise_scale, static_cast<uint64_t>(seed), {}, {}, bias.value_or(at::Tensor())};
    if (noise != kNoNoise && noise_given.has_value()) pb.given_noise = noise_given->expand(pb.shape());
    const KlTerm term{kl, prior.value_or(at::Tensor())};
    set_mix(pb, hybrid_logit.value_or(at::Tensor()));
    pb.sweep();
    if (pb.mix()) pb.mix_rows();
    std::vector<at::Tensor> outputs, row_lse;
    const auto stats = q.options().dtype(pb.stats());
    at::Tensor mass = at::zeros({q.size(0), q.size(1), k.size(2)}, stats);  // Σ_i P_ij
    at::Tensor kl_part = at::zeros({q.size(0), q.size(1)}, stats);
    pb.each([&](int64_t start, int64_t len) {
      auto ex = pb.excluded_rows(start, len);
      auto y = pb.logits(pb.scores(start, len, ex), start, len, ex);
      auto p = pb.weights(y, start, len, ex);
      outputs.push_back(grouped_product(p.to(v.scalar_type()), v));
      mass += p.sum(-2);
      if (kl != kNoKl) {
        row_lse.push_back(at::logsumexp(y, {-1}, true));
        kl_part += term.value(y - row_lse.back(), ex);
      }
    });
    auto out = at::cat(outputs, -2);  // (B, H, S_q, d_v)
    ctx->save_for_backward({q, k, v, out});
    keep_optional(ctx, "excluded", pb.excluded);
    keep_optional(ctx, "bias", pb.bias);
    keep_optional(ctx, "noise", pb.given_noise);
    keep_optional(ctx, "prior", term.a);
    keep_optional(ctx, "row_lse", kl != kNoKl ? at::cat(row_lse, -2) : at::Tensor());
    keep_optional(ctx, "hybrid_logit", hybrid_logit.value_or(at::Tensor()));
    keep_optional(ctx, "rd", pb.rd);
    keep_optional(ctx, "rs", pb.rs);
    ctx->saved_data["c"] = at::IValue(pb.c);
    ctx->saved_data["r"] = at::IValue(pb.r);
    ctx->saved_data["settings"] = std::vector<int64_t>{tile, sweeps, noise, seed, kl};
    ctx->saved_data["noise_scale"] = noise_scale;
    ctx->mark_non_differentiable({mass});
    return {out, mass, kl_part};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const NoAutocast no_autocast;
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const auto settings = ctx->saved_data["settings"].toIntVector();
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    Problem pb{q * scale, k, v, kept_optional(ctx, "excluded"), kept_optional(ctx, "noise"), settings[0], settings[1], settings[2],
               ctx->saved_data["noise_scale"].toDouble(), static_cast<uint64_t>(settings[3]), ctx->saved_data["c"].toTensorVector(),
               ctx->saved_data["r"].toTensorVector(), kept_optional(ctx, "bias")};
    const KlTerm term{settings[4], kept_optional(ctx, "prior")};
    const auto hybrid_logit = kept_optional(ctx, "hybrid_logit");
    set_mix(pb, hybrid_logit);
    pb.rd = kept_optional(ctx, "rd");
    pb.rs = kept_optional(ctx, "rs");
    const auto row_lse = kept_optional(ctx, "row_lse");
    const size_t n = static_cast<size_t>(pb.sweeps);
    auto dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const bool with_kl = term.kind != kNoKl && grads[2].defined();
    const auto dkl = with_kl ? grads[2].view({q.size(0), q.size(1), 1, 1}) : at::Tensor();
    // Statistics and the accumulated gradients in the statistics' dtype, products in the inputs'.
    const auto stats = q.options().dtype(pb.stats());
    const auto lower = [&](const at::Tensor& t) { return t.to(q.scalar_type()); };
    // D_i = Σ_d dO_id O_id, (B, H, S_q, 1). Inputs narrower than the statistics go through one
    // buffer of the statistics' dtype (addcmul_ widens them element by element, so the products
    // are exact, as widened copies of both would give), not through widened copies of dO and O
    // beside their product.
    const bool widened = dout.scalar_type() != pb.stats() || out.scalar_type() != pb.stats();
    auto d = (widened ? at::zeros(out.sizes(), stats).addcmul_(dout, out) : dout * out).sum(-1, true);
    // dV per query head (B, H, S_k, d_v), summed over each group at the end: Σ_i dY_ij below reads
    // it head by head.
    const int64_t kv_heads = k.size(1), groups = q.size(1) / kv_heads;
    auto dv = at::zeros({q.size(0), q.size(1), v.size(2), v.size(3)}, stats), dk = at::zeros(k.sizes(), stats);
    const bool with_bias_grad = pb.bias.defined() && pb.bias.requires_grad();
    at::Tensor dbias = with_bias_grad ? at::zeros(pb.bias.sizes(), stats) : at::Tensor();
    at::Tensor da = with_kl ? at::zeros({q.size(0), q.size(1), 1, k.size(2)}, stats) : at::Tensor();
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
      auto y = pb.logits(z, start, len, ex);
      auto p = pb.weights(y, start, len, ex);
      auto dy_kl = kl_grad(start, len, ex, y, first_pass);
      y = at::Tensor();  // not needed past here: one block fewer alive beside dP's
      // dY = P ∘ (dP - D), built in dP's block.
      auto dy = grouped_product(dout.narrow(-2, start, len), v.transpose(-2, -1)).to(pb.stats()).sub_(d.narrow(-2, start, len)).mul_(p);
      if (dy_kl.defined()) dy.add_(dy_kl);
      return std::make_pair(p, dy);
    };
    auto finish = [&](int64_t start, int64_t len, const at::Tensor& dz) {
      dq.push_back(grouped_product(lower(dz), k) * scale);
      dk.add_(grouped_transposed_product(lower(dz), pb.qs.narrow(-2, start, len), kv_heads));
      if (with_bias_grad) {
        auto rows = Problem::rows_of(dbias, start, len);
        rows.add_(at::sum_to(dz, rows.sizes()));
      }
    };

    at::Tensor g, dlogit;
    if (pb.mix()) {  // BAM over HNAS: one pass for dV, g and the gate, one for dZ
      // Each branch's gradient in its own logits (DNAS's first), from a tile's z and dY.
      auto branches = [&](int64_t start, int64_t len, const at::Tensor& ex, const at::Tensor& z, const at::Tensor& e) {
        auto [log_d, log_s] = pb.branch_logs(z, start, len, ex);
        auto y = pb.mixed(log_d, log_s, ex);
        auto w_d = masked_exp(log_d + pb.log_u - y, ex), w_s = masked_exp(log_s + pb.log_1mu - y, ex);
        auto pi_d = masked_exp(log_d, ex), pi_s = masked_exp(log_s, ex);
        auto dy_d = w_d * e - pi_d * (w_d * e).sum(-1, true);
        auto dz_s = w_s * e - pi_s * (w_s * e).sum(-1, true);
        auto gate = (e * (w_d * at::exp(-pb.log_u) - w_s * at::exp(-pb.log_1mu))).sum({0, 2, 3});  // Σ e (π_D - π_S) / π
        return std::make_tuple(dy_d, dz_s, gate);
      };
      at::Tensor gate = at::zeros({q.size(1)}, stats);
      g = at::zeros({q.size(0), q.size(1), 1, k.size(2)}, stats);
      pb.each([&](int64_t start, int64_t len) {
        auto ex = pb.excluded_rows(start, len);
        auto z = pb.scores(start, len, ex);
        auto [p, e] = logits_grad(start, len, ex, z, true);
        dv.add_(at::matmul(lower(p).transpose(-2, -1), dout.narrow(-2, start, len)));
        auto [dy_d, dz_s, gate_tile] = branches(start, len, ex, z, e);
        g.add_(dy_d.sum(-2, true));
        gate.add_(gate_tile);
      });
      pb.each([&](int64_t start, int64_t len) {
        auto ex = pb.excluded_rows(start, len);
        auto z = pb.scores(start, len, ex);
        auto e = logits_grad(start, len, ex, z, false).second;
        auto [dy_d, dz_s, gate_tile] = branches(start, len, ex, z, e);
        finish(start, len, dy_d.add_(dz_s).sub_(pb.col_jacobian(1, z, start, len, ex).mul_(g)));
      });
      const auto u = pb.log_u.exp().flatten();
      dlogit = (gate * u * (1.0 - u)).to(hybrid_logit.scalar_type());
    }

    // First pass: dV, and for softmax dZ itself. With sweeps it gathers g = Σ_i dY_ij instead,
    // without dP: Σ_i P_ij (dP_ij - D_i) = v_j · dV_j - Σ_i P_ij D_i, so one matrix product fewer.
    at::Tensor pd;  // pd = Σ_i P_ij D_i, (B, H, 1, S_k)
    if (!pb.mix()) pb.each([&](int64_t start, int64_t len) {
      auto ex = pb.excluded_rows(start, len);
      auto z = pb.scores(start, len, ex);
      if (n == 0) {
        auto [p, dy] = logits_grad(start, len, ex, z, true);
        dv.add_(at::matmul(lower(p).transpose(-2, -1), dout.narrow(-2, start, len)));
        finish(start, len, dy);
        return;
      }
      auto y = pb.logits(z, start, len, ex);
      auto p = pb.weights(y, start, len, ex);
      dv.add_(at::matmul(lower(p).transpose(-2, -1), dout.narrow(-2, start, len)));
      auto col = at::matmul(d.narrow(-2, start, len).transpose(-2, -1), p);
      auto dy_kl = kl_grad(start, len, ex, y, true);
      if (dy_kl.defined()) col = col - dy_kl.sum(-2, true);
      pd = pd.defined() ? pd + col : col;
    });
    if (n > 0 && !pb.mix()) {
      const auto vd = groups == 1 ? (v * dv).sum(-1)
                                  : (v.unsqueeze(2) * dv.view({q.size(0), kv_heads, groups, v.size(2), v.size(3)})).sum(-1).flatten(1, 2);
      g = vd.unsqueeze(-2) - pd;
    }
    if (n > 0 && !pb.mix()) {
      std::vector<at::Tensor> dc(n), dr(n > 1 ? n - 1 : 0);
      dc[n - 1] = -g;
      for (size_t t = n; t >= 2; --t) {  // down the chain of statistics
        std::vector<at::Tensor> rows;
        at::Tensor col;
        pb.each([&](int64_t start, int64_t len) {
          auto ex = pb.excluded_rows(start, len);
          auto z = pb.scores(start, len, ex);
          auto dr_tile = pb.col_jacobian(t, z, start, len, ex).mul_(dc[t - 1]).sum(-1, true).neg_();
          auto dc_tile = pb.row_jacobian(t - 1, z, start, len, ex).mul_(dr_tile).sum(-2, true).neg_();
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
        // Each term is made and added in place: two (tile, S_k) blocks alive besides z and dZ.
        for (size_t t = 1; t <= n; ++t) dz.add_(pb.col_jacobian(t, z, start, len, ex).mul_(dc[t - 1]));
        for (size_t t = 1; t < n; ++t) dz.add_(pb.row_jacobian(t, z, start, len, ex).mul_(dr[t - 1].narrow(-2, start, len)));
        finish(start, len, dz);
      });
    }
    at::Tensor dprior;
    if (with_kl && term.a.defined() && term.a.requires_grad()) dprior = at::sum_to(da, term.a.sizes());
    if (groups > 1) dv = dv.view({q.size(0), kv_heads, groups, v.size(2), v.size(3)}).sum(2);
    return {at::cat(dq, -2), dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor(), dbias, at::Tensor(), dprior, dlogit,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int32_t probattn::tiled::tiled_route(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& excluded,
                                     const at::Tensor& bias, int32_t fused_cpu, int64_t sweeps, int32_t noise, int32_t kl) {
  // The fused CPU kernel takes neither an additive mask nor grouped key/value heads.
  if (fused_cpu == kFusedNever || bias.defined() || k.size(1) != q.size(1)) return kRouteTiles;
  if (fused_cpu_applies(q, v, excluded, noise, kl)) return kRouteFused;
  if (fused_cpu_bam_applies(q, k, v, excluded, sweeps, noise, kl)) return kRouteFusedBam;
  return kRouteTiles;
}

extern "C" {

char* pa_tiled_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* excluded, const pa_tensor* bias,
                         const pa_tensor* noise, const pa_tensor* prior, const pa_tensor* hybrid_logit, const pa_tiled_spec* spec,
                         pa_tensor** out, pa_tensor** received_mass, pa_tensor** kl_part, int32_t* route_taken) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {spec, "spec"}, {out, "out"},
                                 {received_mass, "received_mass"}, {kl_part, "kl_part"}}) {
      probattn::require(pointer, "pa_tiled_attention", name);
    }
    TORCH_CHECK(spec->tile >= 1, "the tile size must be at least 1, got ", spec->tile);
    TORCH_CHECK(spec->sweeps >= 0, "the number of sweeps must be at least 0, got ", spec->sweeps);
    TORCH_CHECK(spec->noise >= kNoNoise && spec->noise <= kLognormal, "unknown noise kind ", spec->noise);
    TORCH_CHECK(spec->kl >= kNoKl && spec->kl <= kLognormalSquares, "unknown KL kind ", spec->kl);
    TORCH_CHECK(spec->kl == kNoKl || prior != nullptr, "a KL term needs the prior's per-key values");
    TORCH_CHECK(hybrid_logit == nullptr || spec->sweeps == 1, "HNAS's mix takes one sweep (DNAS and softmax), got ", spec->sweeps);
    TORCH_CHECK(hybrid_logit == nullptr || (hybrid_logit->dim() == 1 && hybrid_logit->size(0) == q->size(1)),
                "HNAS's gate logits must be one per query head, (", q->size(1), ",)");
    const NoAutocast no_autocast;
    auto some = [](const pa_tensor* t) { return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt; };
    const auto ex = excluded != nullptr ? *excluded : at::Tensor();
    std::vector<at::Tensor> result;
    // HNAS's mix runs on the tiles only.
    const int32_t route = hybrid_logit != nullptr ? kRouteTiles
                                                  : tiled_route(*q, *k, *v, ex, bias != nullptr ? *bias : at::Tensor(), spec->fused_cpu,
                                                                spec->sweeps, spec->noise, spec->kl);
    if (route_taken != nullptr) *route_taken = route;
    // The fused kernel was required and does not apply: nothing runs, no output is written.
    if (route == kRouteTiles && spec->fused_cpu == kFusedRequired) return;
    if (route == kRouteFused) {
      result = fused_cpu_attention(*q, *k, *v, some(excluded), spec->sweeps);
    } else if (route == kRouteFusedBam) {
      result = fused_cpu_bam(*q, *k, *v, some(excluded), some(noise), some(prior), spec->tile, spec->noise, spec->noise_scale,
                             static_cast<int64_t>(spec->seed), spec->kl);
    } else {
      result = TiledAttention::apply(*q, *k, *v, some(excluded), some(bias), some(noise), some(prior), some(hybrid_logit), spec->tile,
                                     spec->sweeps, spec->noise, spec->noise_scale, static_cast<int64_t>(spec->seed), spec->kl);
    }
    // All three handles exist before any is handed out: an allocation that fails leaks none.
    auto o = std::make_unique<at::Tensor>(result[0]);
    auto m = std::make_unique<at::Tensor>(result[1]);
    auto p = std::make_unique<at::Tensor>(result[2]);
    *out = o.release();
    *received_mass = m.release();
    *kl_part = p.release();
  });
}

}  // extern "C"
