// Memory-efficient attention: softmax and DNAS (Ding et al. 2020) tiled over blocks of queries,
// forward and backward, as a torch::autograd::Function whose passes are ATen ops (CPU and CUDA
// alike). No (S_q, S_k) tensor is kept: each pass holds one (tile, S_k) block of scores at a time,
// and what is saved for backward is q, k, v, the output and, for DNAS, the per-key statistic c.
//
// Scores z = (q · sqrt(1/d)) kᵀ, excluded entries filled with -1e30 as the eager path does.
// - softmax: P = row-softmax(z).
// - DNAS:    P = row-softmax(z - c), c_j = logsumexp_i z_ij (each key normalized over the
//   queries first). Pass 1 accumulates c over the query tiles (log-add-exp of each tile's column
//   logsumexp); pass 2 is ordinary attention with the per-key bias -c.
// Excluded entries get weight exactly 0 (a fully excluded row is all zeros), as in the eager path.
//
// Backward by recomputation, per tile: dP = dO vᵀ, D_i = Σ_d dO_id O_id, dS¹ = P ∘ (dP - D) (the
// softmax backward); for DNAS g_j = Σ_i dS¹_ij over all tiles (an O(S_k) vector, pass A), then
// dZ = dS¹ - Pc ∘ g with Pc_ij = exp(z_ij - c_j) (∂c_j/∂z_ij), recomputed in pass B; then
// dq = sqrt(1/d) dZ k, dk = dZᵀ (q · sqrt(1/d)), dv = Pᵀ dO.

#include <cmath>
#include <optional>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "boundary.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kMaskValue = -1.0e30;  // the eager path's mask_value for float32 and float64

// Rows [start, start + len) of a mask broadcastable to (B, H, S_q, S_k).
at::Tensor mask_rows(const at::Tensor& excluded, int64_t start, int64_t len) {
  if (!excluded.defined() || excluded.size(-2) == 1) return excluded;
  return excluded.narrow(-2, start, len);
}

at::Tensor filled(at::Tensor t, const at::Tensor& excluded, double value) {
  return excluded.defined() ? t.masked_fill(excluded, value) : t;
}

// Filled scores of one query tile, (B, H, t, S_k).
at::Tensor tile_scores(const at::Tensor& qs, const at::Tensor& k, const at::Tensor& excluded) {
  return filled(at::matmul(qs, k.transpose(-2, -1)), excluded, kMaskValue);
}

// Weights of one tile from its filled scores; `c` undefined for softmax.
at::Tensor tile_weights(const at::Tensor& z, const at::Tensor& c, const at::Tensor& excluded) {
  auto a = c.defined() ? filled(z - c, excluded, kMaskValue) : z;
  return filled(at::softmax(a, -1), excluded, 0.0);
}

struct Tiling {
  int64_t queries;
  int64_t tile;
  template <typename F>
  void each(F&& f) const {
    for (int64_t start = 0; start < queries; start += tile) f(start, std::min(tile, queries - start));
  }
};

struct TiledAttention : public torch::autograd::Function<TiledAttention> {
  // The mask is an optional, not a possibly-undefined tensor: apply() treats tensor arguments as
  // variables of the graph, which an undefined one cannot be.
  static variable_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v,
                               std::optional<at::Tensor> excluded_or_none, int64_t tile, bool dnas) {
    const at::Tensor excluded = excluded_or_none.value_or(at::Tensor());
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    const Tiling tiling{q.size(-2), tile};
    auto qs = q * scale;
    at::Tensor c;  // (B, H, 1, S_k): each key's logsumexp over the queries
    if (dnas) {
      tiling.each([&](int64_t start, int64_t len) {
        auto lse = at::logsumexp(tile_scores(qs.narrow(-2, start, len), k, mask_rows(excluded, start, len)), {-2}, true);
        c = c.defined() ? at::logaddexp(c, lse) : lse;
      });
    }
    std::vector<at::Tensor> outputs;
    at::Tensor mass;  // (B, H, S_k): the weight each key receives
    tiling.each([&](int64_t start, int64_t len) {
      auto ex = mask_rows(excluded, start, len);
      auto p = tile_weights(tile_scores(qs.narrow(-2, start, len), k, ex), c, ex);
      outputs.push_back(at::matmul(p, v));
      auto m = p.sum(-2);
      mass = mass.defined() ? mass + m : m;
    });
    auto out = at::cat(outputs, -2);  // (B, H, S_q, d_v)
    ctx->save_for_backward({q, k, v, out});
    // Neither needs a gradient: kept beside the saved variables, `None` when absent.
    ctx->saved_data["c"] = c.defined() ? at::IValue(c) : at::IValue();
    ctx->saved_data["excluded"] = excluded.defined() ? at::IValue(excluded) : at::IValue();
    ctx->saved_data["tile"] = tile;
    ctx->mark_non_differentiable({mass});
    return {out, mass};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    auto optional = [&](const char* key) { return ctx->saved_data[key].isNone() ? at::Tensor() : ctx->saved_data[key].toTensor(); };
    const auto c = optional("c"), excluded = optional("excluded");
    const Tiling tiling{q.size(-2), ctx->saved_data["tile"].toInt()};
    const bool dnas = c.defined();
    auto dout = grads[0];
    if (!dout.defined()) dout = at::zeros_like(out);
    const double scale = std::sqrt(1.0 / static_cast<double>(q.size(-1)));
    auto qs = q * scale;
    auto d = (dout * out).sum(-1, true);  // (B, H, S_q, 1)
    auto dv = at::zeros_like(v);
    auto dk = at::zeros_like(k);
    std::vector<at::Tensor> dq(static_cast<size_t>((tiling.queries + tiling.tile - 1) / tiling.tile));
    at::Tensor g;  // (B, H, 1, S_k): Σ_i dS¹_ij
    // One tile's dS¹ and its weights.
    auto softmax_grad = [&](int64_t start, int64_t len, const at::Tensor& ex) {
      auto z = tile_scores(qs.narrow(-2, start, len), k, ex);
      auto p = tile_weights(z, c, ex);
      auto dp = at::matmul(dout.narrow(-2, start, len), v.transpose(-2, -1));
      return std::make_tuple(z, p, p * (dp - d.narrow(-2, start, len)));
    };
    auto finish = [&](int64_t start, int64_t len, const at::Tensor& dz) {
      dq[static_cast<size_t>(start / tiling.tile)] = at::matmul(dz, k) * scale;
      dk.add_(at::matmul(dz.transpose(-2, -1), qs.narrow(-2, start, len)));
    };
    tiling.each([&](int64_t start, int64_t len) {  // pass A
      auto ex = mask_rows(excluded, start, len);
      auto [z, p, ds1] = softmax_grad(start, len, ex);
      dv.add_(at::matmul(p.transpose(-2, -1), dout.narrow(-2, start, len)));
      if (dnas) {
        auto col = ds1.sum(-2, true);
        g = g.defined() ? g + col : col;
      } else {
        finish(start, len, ds1);
      }
    });
    if (dnas) {
      tiling.each([&](int64_t start, int64_t len) {  // pass B
        auto ex = mask_rows(excluded, start, len);
        auto [z, p, ds1] = softmax_grad(start, len, ex);
        auto pc = filled(at::exp(z - c), ex, 0.0);
        finish(start, len, ds1 - pc * g);
      });
    }
    return {at::cat(dq, -2), dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

char* pa_tiled_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* excluded, int64_t tile,
                         int dnas, pa_tensor** out, pa_tensor** received_mass) {
  return probattn::guard([&] {
    TORCH_CHECK(tile >= 1, "the tile size must be at least 1, got ", tile);
    std::optional<at::Tensor> mask;
    if (excluded != nullptr) mask = *excluded;
    auto result = TiledAttention::apply(*q, *k, *v, mask, tile, dnas != 0);
    *out = new at::Tensor(result[0]);
    *received_mass = new at::Tensor(result[1]);
  });
}

}  // extern "C"
