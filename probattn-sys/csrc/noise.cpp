// BAM's counter-based draws for the memory-efficient path: the same ε for an entry (b, h, i, j)
// whenever and in whatever block it is asked for, so the backward pass regenerates the forward's
// noise tile by tile (csrc/tiled.h).

#include <cfloat>
#include <cmath>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define PROBATTN_X86_DISPATCH 1
#include <immintrin.h>
#else
#define PROBATTN_X86_DISPATCH 0
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "boundary.h"
#include "tiled.h"

namespace probattn::tiled {
namespace {

constexpr int64_t kLow32 = 0xffffffffLL;

// ---- counter-based draws: integer hashing in ATen ops, every value kept below 2^49, so int64
// never overflows on any device.

// x ← x · c mod 2^32 for 0 <= x < 2^32, in two 16-bit halves of c. These steps work in place:
// each sweeps the whole block, and writing into its operand keeps fewer blocks alive at once.
void mul32_(at::Tensor& x, uint32_t c) {
  auto high = x * static_cast<int64_t>(c >> 16);
  high.bitwise_and_(0xffff).bitwise_left_shift_(16);
  x.mul_(static_cast<int64_t>(c & 0xffffu)).add_(high).bitwise_and_(kLow32);
}

void xorshift_(at::Tensor& x, int64_t shift) { x.bitwise_xor_(at::bitwise_right_shift(x, shift)); }

// A bijection of 32-bit values with good avalanche (C. Wellons' two-round integer hash), in place.
void hash32_(at::Tensor& x) {
  xorshift_(x, 16);
  mul32_(x, 0x21f0aaadu);
  xorshift_(x, 15);
  mul32_(x, 0xd35a2d97u);
  xorshift_(x, 15);
}

inline uint32_t hash32_scalar(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0xd35a2d97u;
  x ^= x >> 15;
  return x;
}

// The 32 random bits of the entry at position `index` (below).
inline uint32_t counter_bits(uint64_t index, uint32_t s0, uint32_t s1) {
  const auto low = static_cast<uint32_t>(index & 0xffffffffULL), high = static_cast<uint32_t>(index >> 32);
  return hash32_scalar(hash32_scalar(low ^ hash32_scalar(high ^ s1)) ^ s0);
}

// Uniform draws in (0, 1) for entries (b, h, i, j) with i in [start, start + len) of a
// (B, H, S_q, S_k) score tensor: 32 random bits ((m + 1/2) / 2^32, float64), or 23 for float32
// noise: (2m + 1) / 2^24 has 24 significant bits, so float32 holds it exactly and its largest
// value, 1 - 2^-24, stays below 1 (with 24 bits the largest, 1 - 2^-25, rounded to 1.0 in float32,
// and the Weibull transform log(-log(1 - ε)) became infinite). The bits of entry e (its position in
// the score tensor) are hash(hash(low(e) ^ hash(high(e) ^ seed_hi)) ^ seed_lo).
//
// `counter_uniform_ops` computes them with ATen's integer ops (any device), in float64, or in
// float32 when `float32_out` (float32 draws only: the same values); `counter_uniform_cpu` with a
// plain loop over the same 32-bit arithmetic (unsigned, so wrapping is defined), about 30 times
// faster on the CPU, where the op-by-op form allocated and swept one int64 tensor per step. When
// every position of the score tensor is below 2^32, high(e) is 0 throughout and its hash one
// number, computed once.
// `counter_bits_ops` gives the 32 bits themselves, as int64.
at::Tensor counter_bits_ops(uint64_t seed, at::IntArrayRef shape, int64_t start, int64_t len, at::Device device) {
  const int64_t b = shape[0], h = shape[1], sq = shape[2], sk = shape[3];
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  auto heads = at::arange(b * h, opts).view({b, h, 1, 1});
  auto rows = at::arange(start, start + len, opts).view({1, 1, len, 1});
  auto cols = at::arange(sk, opts).view({1, 1, 1, sk});
  auto bits = (heads * sq + rows) * sk + cols;  // the entry's position, < 2^63
  const auto s0 = static_cast<uint32_t>(seed & 0xffffffffULL), s1 = static_cast<uint32_t>(seed >> 32);
  // The number of entries in double, which cannot overflow and is exact wherever it is near 2^32.
  const double entries = static_cast<double>(b) * static_cast<double>(h) * static_cast<double>(sq) * static_cast<double>(sk);
  if (entries <= 4294967296.0) {
    bits.bitwise_xor_(static_cast<int64_t>(hash32_scalar(s1)));
  } else {
    auto high = at::bitwise_right_shift(bits, 32);
    high.bitwise_xor_(static_cast<int64_t>(s1));
    hash32_(high);
    bits.bitwise_and_(kLow32).bitwise_xor_(high);
  }
  hash32_(bits);
  bits.bitwise_xor_(static_cast<int64_t>(s0));
  hash32_(bits);
  return bits;
}

at::Tensor counter_uniform_ops(uint64_t seed, at::IntArrayRef shape, int64_t start, int64_t len, bool float32, at::Device device,
                               bool float32_out = false) {
  auto bits = counter_bits_ops(seed, shape, start, len, device);
  if (float32) {
    bits.bitwise_right_shift_(9);
    return bits.to(float32_out ? at::kFloat : at::kDouble).add_(0.5).mul_(std::ldexp(1.0, -23));
  }
  return bits.to(at::kDouble).add_(0.5).mul_(std::ldexp(1.0, -32));
}

#if PROBATTN_X86_DISPATCH
// Whether this CPU runs AVX2 and FMA: the loops below then take 8 draws at a time, with the same
// 32-bit integer and IEEE 754 float32 operations as the scalar loops, so the same bits.
bool has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

__attribute__((target("avx2"))) inline __m256i hash32_avx2(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x21f0aaadu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xd35a2d97u)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

// Float32 draws (m + 1/2)·2^-23 of the positions base, ..., base + n − 1 into `row`, 8 at a
// time where the 8 positions share their high word (the rest one at a time). m and m + 1/2 are
// exact in float32, as is the product by 2^-23: the scalar loop's value.
__attribute__((target("avx2"))) void fill_row_float32_avx2(float* row, uint64_t base, int64_t n, uint32_t s0, uint32_t s1) {
  auto draw32 = [&](int64_t j) {
    return (static_cast<float>(counter_bits(base + static_cast<uint64_t>(j), s0, s1) >> 9) + 0.5f) * 0x1p-23f;
  };
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 half = _mm256_set1_ps(0.5f), scale = _mm256_set1_ps(0x1p-23f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const uint64_t index = base + static_cast<uint64_t>(j);
    const auto low = static_cast<uint32_t>(index & 0xffffffffULL);
    if (low > 0xffffffffu - 7u) {  // the 8 positions straddle a multiple of 2^32
      for (int64_t k = j; k < j + 8; ++k) row[k] = draw32(k);
      continue;
    }
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(hash32_scalar(static_cast<uint32_t>(index >> 32) ^ s1)));
    __m256i bits = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(low)), lanes);
    bits = hash32_avx2(_mm256_xor_si256(hash32_avx2(_mm256_xor_si256(bits, high)), _mm256_set1_epi32(static_cast<int32_t>(s0))));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 9));
    _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_add_ps(m, half), scale));
  }
  for (; j < n; ++j) row[j] = draw32(j);
}
#endif

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
#if PROBATTN_X86_DISPATCH
      if constexpr (std::is_same_v<T, float>) {
        if (float32 && has_avx2_fma()) {
          fill_row_float32_avx2(row, base, sk, s0, s1);
          continue;
        }
      }
#endif
      for (int64_t j = 0; j < sk; ++j) {
        const uint32_t bits = counter_bits(base + static_cast<uint64_t>(j), s0, s1);
        row[j] = static_cast<T>((static_cast<double>(bits >> shift) + 0.5) * scale);
      }
    }
  });
}

// ---- Lognormal's ε of float32 draws: a fixed sequence of float32 operations, each rounded as
// IEEE 754 defines it (fused multiply-adds, products, sums, one square root), so that the CPU
// loop, the tiles on any device and the Triton kernels (python/probattn_tools/kernels/bam.py's
// `_normal32`, with the same constants) draw the same bits. It approximates
// sqrt(2)·erfinv(2u − 1) to within 3.3e-7 of its value (5.1 units in the last place) over all
// 2^23 float32 draws u (docs/kernels.md): y = 2u − 1 and t = (1 − y)(1 + y), whose two factors are
// exact; w = −log t from t's exponent e and its significand m in [1/sqrt(2), sqrt(2)),
// log t = e·ln 2 + f·P(f) with f = m − 1; then ε = y·C(w − 2.5) where w < 5 and y·T(sqrt(w) − c)
// beyond. P, C and T are polynomials of degree 8, fitted to relative error on those ranges.

constexpr float kLog1p[9] = {0x1p+0f,          -0x1.fffff8p-2f, 0x1.555792p-2f,  -0x1.00057p-2f,  0x1.98b748p-3f,
                             -0x1.5332a2p-3f,  0x1.3238f2p-3f,  -0x1.263bacp-3f, 0x1.65449ep-4f};
constexpr float kCentral[9] = {0x1.0fc8bep+1f,  0x1.652c86p-2f,  -0x1.8332aap-8f, -0x1.d0c8b2p-10f, 0x1.442aep-12f,
                               -0x1.a14832p-18f, -0x1.4ee932p-18f, 0x1.04f986p-21f, 0x1.5aa41ep-25f};
constexpr float kTail[9] = {0x1.0744p+2f,    0x1.6b1e0ep+0f,  0x1.6de5b2p-7f, -0x1.1a5cbap-7f, 0x1.9bca76p-8f,
                            -0x1.190dbp-8f,  0x1.09f33ep-9f,  -0x1.ce856ep-15f, -0x1.717cb8p-12f};
constexpr float kCentre = 2.5f, kSplit = 5.0f, kTailShift = 0x1.89ab8cp+1f, kLn2 = 0x1.62e43p-1f;
constexpr int32_t kSqrtHalfBits = 0x3f3504f3;  // the float32 bits of 1/sqrt(2)

inline float horner(const float (&c)[9], float x) {
  float p = c[8];
  for (int i = 7; i >= 0; --i) p = std::fma(p, x, c[i]);
  return p;
}

inline float normal32(float u) {
  const float y = u * 2.0f - 1.0f;
  const float t = (1.0f - y) * (1.0f + y);
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  const int32_t e = (bits - kSqrtHalfBits) >> 23;  // an arithmetic shift: floor((bits − c) / 2^23)
  const int32_t significand = bits - e * (1 << 23);
  float m;
  std::memcpy(&m, &significand, sizeof m);
  const float f = m - 1.0f;
  const float w = -std::fma(f, horner(kLog1p, f), static_cast<float>(e) * kLn2);
  return y * (w < kSplit ? horner(kCentral, w - kCentre) : horner(kTail, std::sqrt(w) - kTailShift));
}

// On x86-64 Linux a CPU with AVX2 and FMA takes 8 draws at a time (`normal32_avx2_`); otherwise
// the scalar loop is compiled twice, with the FMA instructions and without, and the loader picks
// the one the CPU runs: without them each fused multiply-add is a call to C's fmaf (the same
// bits), and a draw took 126 ns where the clone takes 22 (2 cores, under load), and ATen's
// float64 erfinv 82.
#if PROBATTN_X86_DISPATCH
#define PROBATTN_FMA_CLONES __attribute__((target_clones("fma", "default")))
#else
#define PROBATTN_FMA_CLONES
#endif

PROBATTN_FMA_CLONES void normal32_scalar_(float* data, int64_t n) {
  for (int64_t i = 0; i < n; ++i) data[i] = normal32(data[i]);
}

#if PROBATTN_X86_DISPATCH
__attribute__((target("avx2,fma"))) inline __m256 horner_avx2(const float (&c)[9], __m256 x) {
  __m256 p = _mm256_set1_ps(c[8]);
  for (int i = 7; i >= 0; --i) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(c[i]));
  return p;
}

// `normal32` of 8 draws at a time: the same operations in the same order, each a correctly
// rounded AVX instruction (VFMADD, VSQRTPS, ...), both polynomials formed and one kept by w < 5.
__attribute__((target("avx2,fma"))) void normal32_avx2_(float* data, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(data + i), two), one);
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(one, y), _mm256_add_ps(one, y));
    const __m256i bits = _mm256_castps_si256(t);
    const __m256i e = _mm256_srai_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(kSqrtHalfBits)), 23);
    const __m256 f = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_sub_epi32(bits, _mm256_slli_epi32(e, 23))), one);
    const __m256 log_t = _mm256_fmadd_ps(f, horner_avx2(kLog1p, f), _mm256_mul_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(kLn2)));
    const __m256 w = _mm256_xor_ps(log_t, sign);
    const __m256 central = horner_avx2(kCentral, _mm256_sub_ps(w, _mm256_set1_ps(kCentre)));
    const __m256 tail = horner_avx2(kTail, _mm256_sub_ps(_mm256_sqrt_ps(w), _mm256_set1_ps(kTailShift)));
    const __m256 below = _mm256_cmp_ps(w, _mm256_set1_ps(kSplit), _CMP_LT_OQ);
    _mm256_storeu_ps(data + i, _mm256_mul_ps(y, _mm256_blendv_ps(tail, central, below)));
  }
  normal32_scalar_(data + i, n - i);
}
#endif

// `normal32` of each of `n` float32 draws, in place.
void normal32_(float* data, int64_t n) {
#if PROBATTN_X86_DISPATCH
  if (has_avx2_fma()) {
    normal32_avx2_(data, n);
    return;
  }
#endif
  normal32_scalar_(data, n);
}

void normal32_parallel_(at::Tensor& draws) {
  float* data = draws.data_ptr<float>();
  at::parallel_for(0, draws.numel(), int64_t{1} << 14, [&](int64_t first, int64_t last) { normal32_(data + first, last - first); });
}

// `normal32` of every float32 draw, (m + 1/2)·2^-23 for m < 2^23, on `device`: what the ATen ops'
// form of the draws takes its Lognormal ε from (by m), so that it matches the CPU loop without
// redoing the float32 arithmetic in tensor ops. Built once per device (32 MiB) and kept for the
// process; the tables are never freed, so that none outlives the CUDA context at exit.
at::Tensor normal32_table(at::Device device) {
  static std::mutex lock;
  static auto* tables = new std::vector<std::pair<at::Device, at::Tensor>>();
  const std::lock_guard<std::mutex> guard(lock);
  for (const auto& [on, table] : *tables) {
    if (on == device) return table;
  }
  auto table = at::arange(int64_t{1} << 23, at::kDouble).add_(0.5).mul_(std::ldexp(1.0, -23)).to(at::kFloat);  // exact
  normal32_parallel_(table);
  tables->emplace_back(device, table.to(device));
  return tables->back().second;
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

// `float32_out`: float32 draws in float32 rather than float64 (the same values).
at::Tensor counter_uniform(uint64_t seed, at::IntArrayRef shape, int64_t start, int64_t len, at::ScalarType dtype, at::Device device,
                           bool ops = false, bool float32_out = false) {
  const bool float32 = dtype == at::kFloat;
  if (device.is_cpu() && !ops) return counter_uniform_cpu(seed, shape, start, len, float32, float32_out ? at::kFloat : at::kDouble);
  return counter_uniform_ops(seed, shape, start, len, float32, device, float32_out);
}

}  // namespace

// The eager path's noise convention: ε ~ U(0, 1) for Weibull, ε ~ N(0, 1) for Lognormal, in
// `dtype`: the inverse normal CDF of the uniform, sqrt(2)·erfinv(2u − 1), by ATen's erfinv in
// float64 for float64 draws and as `normal32` approximates it for float32 ones. Uniform float32 draws are formed in
// float32 directly (no float64 block).
at::Tensor counter_noise(uint64_t seed, int64_t noise, at::IntArrayRef shape, int64_t start, int64_t len, at::ScalarType dtype,
                         at::Device device, bool ops) {
  if (noise == kLognormal && dtype == at::kFloat) {
    if (device.is_cpu() && !ops) {
      auto out = counter_uniform_cpu(seed, shape, start, len, true, at::kFloat);
      normal32_parallel_(out);
      return out;
    }
    // The draw (m + 1/2)·2^-23 has m = bits >> 9.
    return at::take(normal32_table(device), counter_bits_ops(seed, shape, start, len, device).bitwise_right_shift_(9));
  }
  auto u = counter_uniform(seed, shape, start, len, dtype, device, ops, noise == kWeibull);
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
