// What the memory-efficient attention's files share (csrc/tiled.cpp: the tile loop;
// csrc/fused_cpu.cpp: the routes through libtorch's fused CPU kernel; csrc/noise.cpp: BAM's
// counter-based draws). Internal to the C++ layer: the Rust side sees csrc/probattn.h only.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

namespace probattn::tiled {

constexpr double kMaskValue = -1.0e30;  // the eager path's mask_value for float32 and float64

enum Noise : int64_t { kNoNoise = 0, kWeibull = 1, kLognormal = 2 };
enum Kl : int64_t { kNoKl = 0, kWeibullCross = 1, kLognormalSquares = 2 };

// The dtype a pass keeps its scores' statistics, weights and gradients in: float32 for bfloat16
// and float16 inputs (whose matrix products stay in their dtype), the inputs' own otherwise.
inline at::ScalarType statistics_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf ? at::kFloat : t; }

// Autocast off while a pass runs: every dtype in these files is set by hand (forward and backward
// alike, whatever the caller's autocast state).
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// An optional tensor kept in an autograd context's saved_data under `key` (None when undefined),
// and read back (undefined for None): the masks, draws and priors a pass may or may not have.
inline void keep_optional(torch::autograd::AutogradContext* ctx, const char* key, const at::Tensor& t) {
  ctx->saved_data[key] = t.defined() ? at::IValue(t) : at::IValue();
}
inline at::Tensor kept_optional(torch::autograd::AutogradContext* ctx, const char* key) {
  const auto& value = ctx->saved_data[key];
  return value.isNone() ? at::Tensor() : value.toTensor();
}

// t with the excluded entries set to `value` (t itself without a mask).
inline at::Tensor filled(const at::Tensor& t, const at::Tensor& excluded, double value) {
  return excluded.defined() ? t.masked_fill(excluded, value) : t;
}

// The same, in place: for a tensor the caller has just made and shares with nothing (one
// (tile, S_k) block fewer alive than `filled` on a copy).
inline at::Tensor filled_(at::Tensor t, const at::Tensor& excluded, double value) {
  return excluded.defined() ? t.masked_fill_(excluded, value) : t;
}

// exp(t), exactly 0 on excluded entries.
inline at::Tensor masked_exp(const at::Tensor& t, const at::Tensor& excluded) { return filled_(at::exp(t), excluded, 0.0); }

// The same in place, for a fresh tensor as `filled_` takes.
inline at::Tensor masked_exp_(at::Tensor t, const at::Tensor& excluded) { return filled_(t.exp_(), excluded, 0.0); }

// BAM's draws ε for rows [start, start + len) of a (B, H, S_q, S_k) score tensor `shape`, in
// `dtype` (csrc/noise.cpp); `ops`: with ATen's integer ops even on the CPU (the same values).
at::Tensor counter_noise(uint64_t seed, int64_t noise, at::IntArrayRef shape, int64_t start, int64_t len, at::ScalarType dtype,
                         at::Device device, bool ops = false);

// The noise term of those rows, (B, H, len, S_k), a fresh tensor: from `given` (ε expanded to the
// scores' shape) or from the counter-based draws.
at::Tensor noise_rows(const at::Tensor& given, uint64_t seed, int64_t noise, double scale, at::IntArrayRef shape, int64_t start,
                      int64_t len, at::ScalarType dtype, at::Device device);

// pa_tiled_spec's fused_cpu: never the fused route, where it applies, or required (an error where
// it does not apply).
constexpr int32_t kFusedNever = 0;
constexpr int32_t kFusedWhereApplies = 1;
constexpr int32_t kFusedRequired = 2;
// The routes of pa_tiled_attention (pa_tiled_route).
constexpr int32_t kRouteTiles = 0;
constexpr int32_t kRouteFused = 1;
constexpr int32_t kRouteFusedBam = 2;
// The one decision of which route serves a call (pa_tiled_spec's fields): the tiles unless
// `fused_cpu` allows the fused CPU kernel and one of its two forms applies to these inputs and mask.
int32_t tiled_route(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& excluded, const at::Tensor& bias,
                    int32_t fused_cpu, int64_t sweeps, int32_t noise, int32_t kl);
// The fused CPU routes (csrc/fused_cpu.cpp): whether one applies, and the call, which returns
// (output, received mass, KL part) as the tile loop does.
bool fused_cpu_applies(const at::Tensor& q, const at::Tensor& v, const at::Tensor& excluded, int64_t noise, int64_t kl);
bool fused_cpu_bam_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& excluded, int64_t sweeps,
                           int64_t noise, int64_t kl);
std::vector<at::Tensor> fused_cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const std::optional<at::Tensor>& excluded, int64_t sweeps);
std::vector<at::Tensor> fused_cpu_bam(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& excluded, const std::optional<at::Tensor>& noise_given,
                                      const std::optional<at::Tensor>& prior, int64_t tile, int64_t noise, double noise_scale, int64_t seed,
                                      int64_t kl);

}  // namespace probattn::tiled
