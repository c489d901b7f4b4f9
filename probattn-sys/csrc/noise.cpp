// BAM's counter-based draws for the memory-efficient path: the same ε for an entry (b, h, i, j)
// whenever and in whatever block it is asked for, so the backward pass regenerates the forward's
// noise tile by tile (csrc/tiled.h).

#include <cfloat>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "boundary.h"
#include "tiled.h"

namespace probattn::tiled {
namespace {

constexpr int64_t kLow32 = 0xffffffffLL;

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

}  // namespace

// The eager path's noise convention: ε ~ U(0, 1) for Weibull, ε ~ N(0, 1) for Lognormal (the
// inverse normal CDF of the uniform, in float64), in `dtype`. Uniform float32 draws on the CPU are
// written as float32 directly (one pass, no float64 block).
at::Tensor counter_noise(uint64_t seed, int64_t noise, at::IntArrayRef shape, int64_t start, int64_t len, at::ScalarType dtype,
                         at::Device device, bool ops) {
  if (noise == kWeibull && device.is_cpu() && !ops) {
    return counter_uniform_cpu(seed, shape, start, len, dtype == at::kFloat, dtype).to(dtype);
  }
  auto u = counter_uniform(seed, shape, start, len, dtype, device, ops);
  if (noise == kLognormal) u = at::erfinv(u * 2.0 - 1.0) * std::sqrt(2.0);
  return u.to(dtype);
}

// The log-domain perturbation of ε, as src/attention/normalize/bam.rs's `perturb`, in place on a tensor of
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

}  // namespace probattn::tiled

extern "C" {

char* pa_counter_noise(const pa_tensor* like, const int64_t* shape, int32_t noise, uint64_t seed, int64_t start, int64_t len,
                       int32_t aten_ops, pa_tensor** out) {
  return probattn::guard([&] {
    probattn::require(like, "pa_counter_noise", "like");
    probattn::require(shape, "pa_counter_noise", "shape");
    probattn::require(out, "pa_counter_noise", "out");
    TORCH_CHECK(noise == probattn::tiled::kWeibull || noise == probattn::tiled::kLognormal, "unknown noise kind ", noise);
    TORCH_CHECK(like->scalar_type() == at::kFloat || like->scalar_type() == at::kDouble, "counter-based noise is float32 or float64");
    const at::IntArrayRef dims(shape, 4);
    TORCH_CHECK(start >= 0 && len >= 0 && start + len <= dims[2], "rows [", start, ", ", start + len, ") outside ", dims[2], " queries");
    *out = new at::Tensor(probattn::tiled::counter_noise(seed, noise, dims, start, len, like->scalar_type(), like->device(), aten_ops != 0));
  });
}

}  // extern "C"
