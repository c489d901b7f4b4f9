// The fused CUDA route: the plans' Triton kernels (python/probattn_tools/kernels/, docs/kernels.md),
// compiled ahead of time to cubins and embedded by the probattn-kernels crate, launched through the
// CUDA driver API on libtorch's current stream (csrc/fused_launch.cpp), as one
// torch::autograd::Function.
//
// The Rust side registers the embedded cubins once (pa_fused_register, csrc/fused_launch.cpp), then
// calls pa_fused_cuda_attention; which calls come here is decided on the Rust side
// (src/attention/fused_cuda.rs), which falls back to the tiles with the reason where this route
// does not serve a call.
//
// What is launched mirrors plans.py's orchestration, unpadded or padded (key and query padding
// read together, zeros for the one a call does not give):
// - 0 and 1 sweeps (softmax, causal or not; DNAS): forward, the column pass (DNAS) then the row
//   pass; backward, the key pass (dK, dV, g) then the query pass (dQ), by recomputation;
// - HNAS (`hybrid`): DNAS's row pass keeps softmax's accumulator beside its own, and the two
//   outputs are mixed by the gate here; the backward runs each branch's passes on its share of
//   dO (applied in the passes), the second adding its gradients to the first's;
// - Sinkhorn-N (N ≥ 2 sweeps): N column and N − 1 row potential reductions, DNAS's row pass with
//   the last column potential; backward, the potentials' gradients reduced sweep by sweep back
//   to the first, between three gradient stages;
// - the masked kernels (a boolean pattern, its block map and an additive mask, with both
//   paddings) for the deterministic plans;
// - BAM's sampling over softmax (causal or not), DNAS, HNAS and Sinkhorn-N, with its KL term or
//   without: the noise joins the base's row pass and its gradient passes; over HNAS the
//   row pass mixes the two bases' weights itself (`hybrid` with noise), after one reduction each
//   for their row statistics, and the gate's gradient is reduced per row;
// - the received mass, when a call asks for it: after the forward, one key pass without gradients
//   per branch (BAM: of the sampled weights, its draws made again).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "boundary.h"
#include "fused_launch.h"
#include "probattn.h"
#include "tiled.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The call's settings (pa_fused_spec, csrc/probattn.h), with the seed as the hash keys it.
struct Spec {
  double scale = 1.0;
  int64_t sweeps = 0;
  bool hybrid = false, causal = false;
  int64_t noise = 0;  // 1 Weibull, 2 Lognormal
  int64_t kl = 0;     // 1 Σ a_j log π_ij, 2 Σ (log π_ij − a_j)²; the embedded set has kl = noise or 0
  double noise_scale = 0.0;  // 1/k or σ
  uint64_t seed = 0;
  bool mass = false;  // the received mass too, after the forward

  static Spec of(const pa_fused_spec& s) {
    return {s.scale, s.sweeps, s.hybrid != 0, s.causal != 0, s.noise, s.kl, s.noise_scale, s.seed, s.mass != 0};
  }
};

// The per-key statistics (B, H, S_k) are laid out with each (batch, head) row padded to whole
// blocks of kKeyBlock keys, so that the passes that loop over key blocks read them a block at a
// time without a bound: a column statistic's padding is +inf (its exp(z − c) weighs the keys past
// S_k 0), the others' 0. As plans.py's KEY_BLOCK; the launcher refuses a cubin whose key blocks
// do not divide it.
constexpr int64_t kKeyBlock = 256;
// The widest embedded head dimension at which softmax's base adds dQ by atomics from its key pass,
// in 16-bit inputs, as settings.py's atomic_dq (at 256 that key pass needs more shared memory than
// sm_80 has; in float32, more than sm_86 and sm_89 have).
constexpr int64_t kAtomicDqWidest = 128;

struct Call {
  // kpad, qpad: uint8 (B, S_k) and (B, S_q), both or neither (the padded kernels read both; a call
  // with one passes zeros for the other)
  at::Tensor q, k, v, kpad, qpad, scale;
  at::Tensor seed_words, prior;      // BAM: the seed's two 32-bit words (int64), a_j as (B, H, S_k) float32
  at::Tensor logu;                   // BAM over HNAS: (log u, log(1 − u)) per head, (H, 2) float32
  at::Tensor shares;                 // HNAS without noise: u = sigmoid(logit) per head, (H,) float32
  // The masked kernels' pattern (uint8, nonzero = takes part), its block map (B, H, ⌈S_q / block_m⌉,
  // ⌈S_k / block_n⌉) and the additive mask (float32), each a view broadcast to its full shape;
  // all three or none, with both paddings.
  at::Tensor pattern, blocks, bias;
  Spec spec;
  int64_t d = 0, dv = 0;  // the head dimensions given; q, k and v are padded to multiples of 16
  int arch = 0;
  int64_t head_dim = 0;  // of the cubins: the smallest embedded one that holds d and d_v
  // Whether a backward may follow this forward: DNAS's column pass then leaves the queries' column
  // mean for the key pass (Forward::qbar).
  bool grads = false;
  std::map<std::string, int64_t> ints;
  mutable std::map<at::ScalarType, at::Tensor> unused;  // for pointer parameters of features the call does not use
  // A dry run (pa_fused_cuda_dry_run): each launch described here as JSON instead of run.
  mutable std::vector<std::string>* dry = nullptr;

  int64_t b() const { return q.size(0); }
  int64_t h() const { return q.size(1); }
  int64_t h_kv() const { return k.size(1); }
  int64_t s_q() const { return q.size(2); }
  int64_t s_k() const { return k.size(2); }
  int64_t s_kp() const { return (s_k() + kKeyBlock - 1) / kKeyBlock * kKeyBlock; }  // a per-key statistic's row
  at::TensorOptions stats() const { return q.options().dtype(at::kFloat); }
  // BAM over HNAS: the row pass mixes DNAS's and softmax's weights under the noise.
  bool mix() const { return spec.hybrid && spec.noise != 0; }
  // Whether the kernels leave the KL part's terms that are sums over the logits to this side
  // (`LinearKl`; the passes' KL_LINEAR, bam.linear_kl): over softmax's base, without a pattern;
  // Lognormal's without the causal mask.
  bool linear_kl() const {
    return (spec.kl == 1 || (spec.kl == 2 && !spec.causal)) && spec.sweeps == 0 && !mix() && !pattern.defined();
  }

  // Launches `name` over a grid of (blocks of `keys ? S_k : S_q`, B × heads) programs, its
  // constexprs the call's and `extra`, its pointers `tensors` (by name, with the inputs, the
  // masks and BAM's seed and prior added), its integers the call's.
  void launch(const std::string& name, bool keys, int64_t heads, const std::map<std::string, int64_t>& extra,
              std::map<std::string, at::Tensor> tensors) const {
    probattn::fused::Launch l;
    l.name = name;
    l.arch = arch;
    l.dtype = q.scalar_type();
    l.head_dim = head_dim;
    const int64_t masked = pattern.defined() ? 1 : 0;
    l.constexprs = {{"HAS_QPAD", qpad.defined() ? 1 : 0}, {"HAS_KPAD", kpad.defined() ? 1 : 0}, {"HAS_MASK", masked}, {"HAS_BIAS", masked},
                    {"SWEEPS", std::min<int64_t>(spec.sweeps, 1)}, {"CAUSAL", spec.causal ? 1 : 0}, {"NOISE", spec.noise},
                    {"KL", spec.kl}, {"MIX", mix() ? 1 : 0}, {"ROWS", 0}, {"SHARE", 0}, {"ADD", 0}, {"CONTEXT", 0}, {"ATOMIC_DQ", 0}};
    for (const auto& [n, value] : extra) l.constexprs[n] = value;
    tensors["Q"] = q;
    tensors["K"] = k;
    tensors["V"] = v;
    tensors["SCALE"] = scale;
    if (kpad.defined()) tensors["KPAD"] = kpad;
    if (qpad.defined()) tensors["QPAD"] = qpad;
    if (spec.noise != 0) tensors["DRAWS"] = seed_words;
    if (spec.kl != 0) tensors["PRIOR"] = prior;
    if (mix()) tensors["LOGU"] = logu;
    if (masked != 0) tensors["MASK"] = pattern, tensors["BLOCKS"] = blocks, tensors["BIAS"] = bias;
    l.tensors = std::move(tensors);
    l.ints = &ints;
    l.keys = keys;
    l.length = keys ? s_k() : s_q();
    l.programs = b() * heads;
    probattn::fused::launch(l, q.device(), unused, dry);
  }

  // Zeros for per-key (B, H, S_k) or per-query (B, H, S_q) statistics, after `lead` dimensions; a
  // per-key one padded to whole key blocks (`s_kp`) with `pad`.
  at::Tensor stat(bool keys, std::vector<int64_t> lead = {}, double pad = 0.0) const {
    lead.insert(lead.end(), {b(), h(), keys ? s_kp() : s_q()});
    auto out = at::zeros(lead, stats());
    if (keys && pad != 0.0) out.narrow(-1, s_k(), s_kp() - s_k()).fill_(pad);
    return out;
  }
  // A per-key statistic as (…, B, H, S_k), without its padding.
  at::Tensor keys_only(const at::Tensor& t) const { return t.narrow(-1, 0, s_k()); }
};

// The masks a call may carry: the paddings (bool or uint8 (B, S), true = excluded), a boolean
// pattern broadcastable to (B, H, S_q, S_k) (true = takes part) and an additive mask broadcastable
// to the same (its -inf entries excluded), each undefined when absent; and, in a backward, the
// pattern's block map its forward formed (undefined: form it).
struct Masks {
  at::Tensor kpad, qpad, pattern, bias, blocks;
};

// A mask of rank up to 4 as a rank-4 view (size-1 dimensions in front), checked to broadcast to
// `shape`.
at::Tensor rank4(const at::Tensor& mask, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(mask.dim() <= 4, "the ", name, " has shape ", mask.sizes(), ": at most 4 dimensions, broadcast to ", shape);
  std::vector<int64_t> sizes(4 - mask.dim(), 1);
  sizes.insert(sizes.end(), mask.sizes().begin(), mask.sizes().end());
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(sizes[i] == 1 || sizes[i] == shape[i], "the ", name, " of shape ", mask.sizes(), " does not broadcast to ", shape);
  }
  return mask.contiguous().reshape(sizes);
}

// The masked kernels' views, as plans.py forms them: the pattern as uint8 broadcast through
// stride-0 views (all of it taking part when absent), its block map over the cubins' blocks (a
// tile's entry nonzero where it holds an allowed pair: formed on the pattern's own dimensions,
// then broadcast the same way), and the additive mask in float32 (zero when absent).
void masked_views(Call& c, const Masks& masks) {
  const std::vector<int64_t> shape = {c.b(), c.h(), c.s_q(), c.s_k()};
  const auto own = masks.pattern.defined() ? rank4(masks.pattern.to(c.q.device(), at::kByte), shape, "boolean attention mask")
                                           : at::ones({1, 1, 1, 1}, c.q.options().dtype(at::kByte));
  c.pattern = own.expand(shape);
  if (masks.blocks.defined()) {
    c.blocks = masks.blocks;
  } else {
    const auto [block_m, block_n] = probattn::fused::blocks_of(c.arch, c.q.scalar_type(), c.head_dim);
    TORCH_CHECK(block_m > 0 && block_n > 0, "the fused CUDA route: no embedded kernel's blocks for a block map");
    const int64_t n_m = (c.s_q() + block_m - 1) / block_m, n_n = (c.s_k() + block_n - 1) / block_n;
    const auto tiles = at::constant_pad_nd(own.expand({own.size(0), own.size(1), c.s_q(), c.s_k()}),
                                           {0, n_n * block_n - c.s_k(), 0, n_m * block_m - c.s_q()}, 0);
    c.blocks = tiles.reshape({own.size(0), own.size(1), n_m, block_m, n_n, block_n}).amax({3, 5}).expand({c.b(), c.h(), n_m, n_n});
  }
  c.bias = masks.bias.defined() ? rank4(masks.bias.detach().to(c.q.device(), at::kFloat), shape, "additive mask").expand(shape)
                                : at::zeros({1, 1, 1, 1}, c.stats()).expand(shape);
}

// A view's stride along `dim`; 0 for an absent view.
int64_t at(const at::Tensor& t, int64_t dim) { return t.defined() ? t.stride(dim) : 0; }

// The next multiple of 16: the head dimensions the kernels take.
int64_t width(int64_t n) { return (n + 15) / 16 * 16; }

// x contiguous, 16-byte aligned and `w` wide in its last dimension, zero columns added (which
// change no score and no output column): the cubins are compiled knowing that the inputs' head
// dimensions and strides are multiples of 16 and their pointers aligned (aot.ALIGNED), which lets
// them load whole 16-byte pieces. plans.py's `_aligned` does the same.
at::Tensor aligned(const at::Tensor& x, int64_t w) {
  auto y = (x.size(-1) == w ? x : at::constant_pad_nd(x, {0, w - x.size(-1)})).contiguous();
  return reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0 ? y : y.clone();
}

// The first n columns of a padded result (itself where there is no padding).
at::Tensor narrowed(const at::Tensor& x, int64_t n) { return x.size(-1) == n ? x : x.narrow(-1, 0, n).contiguous(); }

// `prior`: a_j broadcastable to (B, H, 1, S_k) with a KL term. `dry_arch`: 0 for a call that
// launches; else a dry run's compute capability (any device, no driver). `backward`: the call of
// a backward, whose forward took the route: it follows that choice (float32's TF32 switch is not
// asked again: a backward may run outside the region that allowed it).
Call make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Masks& masks, const Spec& spec, const at::Tensor& prior,
               const at::Tensor& logit, int dry_arch = 0, bool backward = false) {
  const auto &kpad = masks.kpad, &qpad = masks.qpad;
  TORCH_CHECK((q.is_cuda() || dry_arch > 0) && k.device() == q.device() && v.device() == q.device(),
              "the fused CUDA route runs on one CUDA device, got ", q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "the fused CUDA route takes (B, H, S, d) tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "the fused CUDA route takes bfloat16, float16 or float32 q, k and v of one dtype, got ", c10::toString(dtype), ", ",
              c10::toString(k.scalar_type()), ", ", c10::toString(v.scalar_type()));
  // float32's cubins take TF32 products: only where libtorch lets its own float32 products do so.
  TORCH_CHECK(dtype != at::kFloat || backward || at::globalContext().allowTF32CuBLAS(),
              "the fused CUDA route takes float32 with TF32 products only, and libtorch's switch for them is off "
              "(torch.backends.cuda.matmul.allow_tf32, probattn's Precision::Tf32)");
  TORCH_CHECK(dtype != at::kFloat || spec.noise == 0, "the fused CUDA route samples BAM in bfloat16 and float16, not float32");
  TORCH_CHECK(spec.sweeps >= 0, "the fused CUDA route: sweeps must be 0 or more, got ", spec.sweeps);
  TORCH_CHECK(!(spec.causal && spec.sweeps > 0), "a causal mask with a column sweep would let later queries change earlier ones' weights");
  TORCH_CHECK(!spec.hybrid || spec.sweeps == 1, "the fused CUDA route mixes HNAS from DNAS (one sweep) and softmax; got ", spec.sweeps,
              " sweeps");
  TORCH_CHECK(!spec.hybrid || (logit.defined() && logit.dim() == 1 && logit.size(0) == q.size(1)),
              "HNAS on the fused CUDA route needs the gate logits, one per query head (", q.size(1), ")");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(3) == q.size(3) && v.size(1) == k.size(1) &&
                  v.size(2) == k.size(2) && k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
              "the fused CUDA route: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(), " do not fit together");
  Call c;
  c.d = q.size(3), c.dv = v.size(3);
  c.q = aligned(q, width(c.d));
  c.k = aligned(k, width(c.d));
  c.v = aligned(v, width(c.dv));
  c.spec = spec;
  const int device_arch = dry_arch > 0 ? dry_arch : probattn::fused::device_capability(q.device().index());
  const int64_t widest = std::max(q.size(3), v.size(3));
  std::tie(c.arch, c.head_dim) = probattn::fused::choose(device_arch, q.scalar_type(), widest);
  TORCH_CHECK(c.head_dim > 0, "the fused CUDA route has no embedded kernel for this GPU (sm_", device_arch, "), ",
              c10::toString(q.scalar_type()), " and head dimension ", widest);
  const bool masked = masks.pattern.defined() || masks.bias.defined();
  TORCH_CHECK(!masked || spec.noise == 0, "the fused CUDA route samples BAM without a boolean or additive mask");
  if (kpad.defined() || qpad.defined() || masked) {
    const auto padding = [&](const at::Tensor& mask, int64_t length, const char* name) {
      if (!mask.defined()) return at::zeros({q.size(0), length}, q.options().dtype(at::kByte));
      TORCH_CHECK(mask.dim() == 2 && mask.size(0) == q.size(0) && mask.size(1) == length, "the ", name, " padding mask must be (B, S) = (",
                  q.size(0), ", ", length, "), got ", mask.sizes());
      return mask.to(q.device(), at::kByte).contiguous();
    };
    c.kpad = padding(kpad, k.size(2), "key");
    c.qpad = padding(qpad, q.size(2), "query");
  }
  c.scale = at::tensor({spec.scale, spec.noise_scale}, at::TensorOptions().dtype(at::kFloat)).to(q.device());
  TORCH_CHECK(spec.noise >= 0 && spec.noise <= 2 && (spec.kl == 0 || spec.kl == spec.noise), "the fused CUDA route draws Weibull (1) "
              "or Lognormal (2) noise with its own KL form, got noise ", spec.noise, " and KL ", spec.kl);
  // A tile's positions must span at most two of the hash's high words: S_k · block_m ≤ 2^32 for
  // any block_m up to 256.
  TORCH_CHECK(spec.noise == 0 || k.size(2) <= (int64_t{1} << 24), "the fused CUDA route draws BAM's noise for at most 2^24 keys, got ",
              k.size(2));
  if (masked) masked_views(c, masks);
  // The padded kernels are the only ones BAM has: no padding is a padding of nothing.
  if (spec.noise != 0 && !c.kpad.defined()) {
    c.kpad = at::zeros({q.size(0), k.size(2)}, q.options().dtype(at::kByte));
    c.qpad = at::zeros({q.size(0), q.size(2)}, q.options().dtype(at::kByte));
  }
  if (spec.hybrid) {
    const auto l = logit.detach().to(q.device(), at::kFloat);
    if (c.mix()) {
      c.logu = at::stack({at::log_sigmoid(l), at::log_sigmoid(-l)}, -1).contiguous();
    } else {
      c.shares = at::sigmoid(l).contiguous();
    }
  }
  c.seed_words = at::tensor({static_cast<int64_t>(spec.seed & 0xFFFFFFFFu), static_cast<int64_t>(spec.seed >> 32)},
                            at::TensorOptions().dtype(at::kLong))
                     .to(q.device());
  if (spec.kl != 0) {
    TORCH_CHECK(prior.defined() && prior.is_floating_point() && prior.dim() <= 4, "a KL term needs the prior's per-key values, "
                "a floating-point tensor broadcastable to (B, H, 1, S_k)");
    auto own = prior.detach().to(q.device(), at::kFloat);
    while (own.dim() < 4) own = own.unsqueeze(0);
    TORCH_CHECK(own.size(2) == 1, "the prior has shape ", prior.sizes(), ": one value per key, (B, H, 1, S_k), not per query");
    c.prior = own.expand({q.size(0), q.size(1), 1, k.size(2)}).squeeze(2).contiguous();
  }
  // The strides of the contiguous inputs, from their sizes: a size-1 dimension's stride is
  // whatever its view had, and the cubins take them as multiples of 16.
  const int64_t b = c.b(), h = c.h(), s_q = c.s_q(), s_k = c.s_k(), s_kp = c.s_kp(), d = c.q.size(3), dv = c.v.size(3);
  const std::array<int64_t, 3> qs{h * s_q * d, s_q * d, d}, ks{c.h_kv() * s_k * d, s_k * d, d}, vs{c.h_kv() * s_k * dv, s_k * dv, dv};
  const bool kl = spec.kl != 0;
  c.ints = {{"stride_qb", qs[0]}, {"stride_qh", qs[1]}, {"stride_qs", qs[2]}, {"stride_kb", ks[0]}, {"stride_kh", ks[1]},
            {"stride_ks", ks[2]}, {"stride_vb", vs[0]}, {"stride_vh", vs[1]}, {"stride_vs", vs[2]},
            // outputs, gradients and statistics are contiguous, shaped as what they belong to
            {"stride_ob", h * s_q * dv}, {"stride_oh", s_q * dv}, {"stride_os", dv}, {"stride_dob", h * s_q * dv},
            {"stride_doh", s_q * dv}, {"stride_dos", dv}, {"stride_dqb", qs[0]}, {"stride_dqh", qs[1]}, {"stride_dqs", qs[2]},
            {"stride_dkb", ks[0]}, {"stride_dkh", ks[1]}, {"stride_dks", ks[2]}, {"stride_dvb", vs[0]}, {"stride_dvh", vs[1]},
            {"stride_dvs", vs[2]}, {"stride_qbarb", h * s_k * d}, {"stride_qbarh", s_k * d}, {"stride_qbars", d},
            {"stride_cb", h * s_kp}, {"stride_ch", s_kp}, {"stride_rb", h * s_q}, {"stride_rh", s_q},
            {"stride_t", b * h * s_kp}, {"stride_tr", b * h * s_q}, {"stride_qpad", c.qpad.defined() ? s_q : 0},
            {"stride_kpad", c.kpad.defined() ? s_k : 0}, {"stride_mb", at(c.pattern, 0)}, {"stride_mh", at(c.pattern, 1)},
            {"stride_mm", at(c.pattern, 2)}, {"stride_mn", at(c.pattern, 3)}, {"stride_bb", at(c.blocks, 0)}, {"stride_bh", at(c.blocks, 1)},
            {"stride_bm", at(c.blocks, 2)}, {"stride_bn", at(c.blocks, 3)}, {"stride_ab", at(c.bias, 0)}, {"stride_ah", at(c.bias, 1)},
            {"stride_am", at(c.bias, 2)}, {"stride_an", at(c.bias, 3)},
            {"stride_pb", kl ? h * s_k : 0}, {"stride_ph", kl ? s_k : 0}, {"stride_pn", kl ? 1 : 0},
            {"H", h}, {"H_KV", c.h_kv()}, {"GROUP", h / c.h_kv()}, {"S_Q", s_q}, {"S_K", s_k}, {"D", d}, {"DV", dv},
            {"N", spec.sweeps}};
  // Every offset a kernel forms is a 32-bit product of these (Sinkhorn-N's potentials: N of them).
  for (const auto& t : {c.q, c.k, c.v}) {
    TORCH_CHECK(t.numel() <= INT32_MAX, "the fused CUDA route indexes with 32-bit integers: a tensor of ", t.numel(),
                " elements is too large");
  }
  TORCH_CHECK(b * h * s_q * dv <= INT32_MAX && std::max<int64_t>(spec.sweeps, 1) * b * h * std::max(s_q, s_kp) <= INT32_MAX,
              "the fused CUDA route indexes with 32-bit integers: the output or the statistics are too large");
  return c;
}

// The KL part's terms that are sums over the logits z_ij = s·q_i·k_j, from sums over the sequence,
// as bam.py's `LinearKl` forms them (which this mirrors; its docstring has the formulas).
//
// Weibull's part (kl 1) is T = Σ_i Σ_j a_j (z_ij − RB_i) over the allowed pairs, so
// TROW_i = s·q_i·W_i − RB_i·KS_i with W_i = Σ_j a_j k_j and KS_i = Σ_j a_j over the keys query i
// sees; of its gradient the kernels leave dQ_i's s·dkl·W_i, dK_j's s·dkl·a_j·Q_j (Q_j = Σ_i q_i
// over the queries that see key j; the key pass adds dkl·a_j·Q_j from QBAR before its scale) and
// the prior's dkl·(s·k_j·Q_j − Σ_i RB_i). The allowed pairs are the unpadded ones, and j ≤ i under
// the causal mask (prefix sums over keys, suffix sums over queries). Without the causal mask W and
// Q are one vector per head; under it they take a (B, H, S, d) float32 tensor each, as large as
// the route's float32 dQ buffer.
//
// Lognormal's part (kl 2) is T = Σ_i Σ_j (z_ij − RB_i − a_j)² over the allowed pairs, without the
// causal mask; it is formed about the keys' means k̄ and ā, from C = Σ_j k̃_j k̃_jᵀ (d × d per key
// head), U = Σ_j ã_j k̃_j and, for the gradients, P = Σ_i q_i q_iᵀ, M = Σ_i m_i q_i and Q = Σ_i q_i
// per query head (k̃ = k − k̄, ã = a − ā, m_i = s·q_i·k̄ − RB_i − ā). The sums are in a's dtype
// (float32 on the route).
struct LinearKl {
  at::Tensor q, k, a, qv, kv;  // q (B, H, S_q, d), k (B, H_kv, S_k, d); a_j where key j is allowed; 1 where taking part
  bool causal = false;
  double scale = 1.0;
  int64_t kl = 1;

  // qpad and kpad: (B, S), nonzero where padded.
  LinearKl(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& prior, const at::Tensor& qpad, const at::Tensor& kpad,
           bool causal_, double scale_, int64_t kl_)
      : q(q_), k(k_), qv(qpad.eq(0).to(prior.scalar_type())), kv(kpad.eq(0).to(prior.scalar_type())), causal(causal_), scale(scale_),
        kl(kl_) {
    TORCH_CHECK(kl == 1 || kl == 2, "the KL part's sums: kl is 1 (Weibull) or 2 (Lognormal), not ", kl);
    TORCH_CHECK(kl == 1 || !causal, "Lognormal's KL part has no sums over the sequence under the causal mask");
    a = prior * kv.unsqueeze(1);
  }

  int64_t b() const { return q.size(0); }
  int64_t h() const { return q.size(1); }
  int64_t h_kv() const { return k.size(1); }
  int64_t group() const { return h() / h_kv(); }
  at::Tensor qf() const { return q.to(a.scalar_type()) * qv.view({b(), 1, q.size(2), 1}); }  // allowed queries, 0 elsewhere

  // (W, KS): Σ a_j k_j and Σ a_j over the keys each query sees, (B, H, S_q, d) and (B, H, S_q);
  // without the causal mask the same for every query, (B, H, 1, d) and (B, H, 1), and not
  // weighted by the query's padding.
  std::pair<at::Tensor, at::Tensor> key_sums() const {
    const int64_t s_q = q.size(2), s_k = k.size(2), d = q.size(3);
    const auto ak = a.view({b(), h_kv(), group(), s_k});
    const auto kf = k.to(a.scalar_type());
    if (!causal) return {at::matmul(ak, kf).view({b(), h(), 1, d}), a.sum(2, true)};
    const auto last = at::arange(s_q, a.options().dtype(at::kLong)).clamp_max(s_k - 1);  // the last key query i sees
    const auto qvh = qv.unsqueeze(1);
    const auto w = at::cumsum(ak.unsqueeze(-1) * kf.unsqueeze(2), 3).view({b(), h(), s_k, d}).index_select(2, last);
    return {w * qvh.unsqueeze(-1), at::cumsum(a, 2).index_select(2, last) * qvh};
  }

  // Lognormal's sums about the keys' means: n (B, 1, 1), k̄ per query head (B, H, d), k̃ (B, H_kv,
  // S_k, d), ã (B, H, S_k), C (B, H_kv, d, d), U (B, H, d) and Σ_j ã_j² (B, H); 0 at a padded key.
  struct Centred {
    at::Tensor n, kbar, kc, ac, c, u, a2;
  };
  Centred centred() const {
    const int64_t s_k = k.size(2), d = q.size(3);
    const auto n = kv.sum(1).view({b(), 1, 1});
    const auto per = 1.0 / n.clamp_min(1.0);
    const auto at_keys = kv.view({b(), 1, s_k, 1});
    const auto kf = k.to(a.scalar_type()) * at_keys;
    const auto kbar = kf.sum(2, true) * per.unsqueeze(-1);  // (B, H_kv, 1, d)
    const auto kc = (kf - kbar) * at_keys;
    const auto ac = (a - a.sum(2, true) * per) * kv.unsqueeze(1);
    const auto u = at::matmul(ac.view({b(), h_kv(), group(), s_k}), kc).view({b(), h(), d});
    return {n, kbar.expand({b(), h_kv(), group(), d}).reshape({b(), h(), d}), kc, ac, at::matmul(kc.transpose(-2, -1), kc), u,
            (ac * ac).sum(2)};
  }

  // m_i = s·q_i·k̄ − RB_i − ā (B, H, S_q), 0 at a padded query and where every key is padded.
  at::Tensor row_means(const at::Tensor& rb, const at::Tensor& kbar) const {
    const auto n = kv.sum(1).view({b(), 1, 1});
    const auto abar = a.sum(2, true) / n.clamp_min(1.0);
    const auto m = scale * at::matmul(q.to(a.scalar_type()), kbar.unsqueeze(-1)).squeeze(-1) - rb.to(a.scalar_type()) - abar;
    return at::where(qv.unsqueeze(1).gt(0).logical_and(n.gt(0)), m, at::zeros({}, m.options()));
  }

  // q_i C (B, H, S_q, d) for C one (d × d) per key head.
  at::Tensor times_c(const at::Tensor& qs, const at::Tensor& c) const {
    const int64_t s_q = q.size(2), d = q.size(3);
    return at::matmul(qs.view({b(), h_kv(), group(), s_q, d}), c.unsqueeze(2)).view({b(), h(), s_q, d});
  }

  // (KS, TROW) per row (B, H, S_q), from the row pass's RB.
  std::pair<at::Tensor, at::Tensor> rows(const at::Tensor& rb) const {
    if (kl == 2) {
      const auto cs = centred();
      const auto m = row_means(rb, cs.kbar);
      const auto qf32 = q.to(a.scalar_type());
      const auto trow = scale * scale * (times_c(qf32, cs.c) * qf32).sum(-1) -
                        2 * scale * at::matmul(qf32, cs.u.unsqueeze(-1)).squeeze(-1) + cs.n * m * m + cs.a2.unsqueeze(-1);
      return {2 * cs.n * m, at::where(qv.unsqueeze(1).gt(0), trow, at::zeros({}, trow.options()))};
    }
    auto [w, ks] = key_sums();
    at::Tensor t1;
    if (causal) {
      t1 = scale * (q.to(a.scalar_type()) * w).sum(-1);
    } else {
      ks = ks * qv.unsqueeze(1);
      t1 = scale * at::matmul(qf(), w.transpose(-2, -1)).squeeze(-1);
    }
    return {ks, t1 - rb * ks};
  }

  // (the key pass's QBAR, dkl·a_j·Q_j (B, H, S_k, d) in q's dtype; dA (B, H, S_k); the dQ term
  // s·dkl·W_i (B, H, S_q, d)), for the gradient dkl (B, H) in T; Q_j = Σ_i q_i over the queries
  // that see key j.
  std::array<at::Tensor, 3> grads(const at::Tensor& rb, const at::Tensor& dkl_) const {
    const int64_t s_q = q.size(2), s_k = k.size(2), d = q.size(3);
    if (kl == 2) return lognormal_grads(rb, dkl_);
    const auto dkl = dkl_.to(a.scalar_type()).view({b(), h(), 1});
    const auto qs_ = qf();
    const auto r = rb * qv.unsqueeze(1);
    const auto kvh = kv.unsqueeze(1);
    const auto w = key_sums().first;
    // (one (B, H, S_q, d) product: w is one vector per head without the causal mask)
    const auto dq = causal ? scale * dkl.unsqueeze(-1) * w : (scale * dkl.unsqueeze(-1) * w) * qv.view({b(), 1, s_q, 1});
    if (!causal) {
      const auto qs = qs_.sum(2, true);  // (B, H, 1, d)
      const auto rs = r.sum(2, true);    // (B, H, 1)
      const auto qbar = ((dkl * a).unsqueeze(-1) * qs).to(q.scalar_type());  // a is 0 at a padded key
      // k_j·Q per query head: (B, H_kv, S_k, d) against (B, H_kv, G, d)
      const auto kq = at::matmul(k.to(a.scalar_type()), qs.view({b(), h_kv(), group(), d}).transpose(-2, -1))
                          .permute({0, 1, 3, 2})
                          .reshape({b(), h(), s_k});
      return {qbar, dkl * (scale * kq - rs) * kvh, dq};
    }
    // suffix sums over the queries i ≥ j, for the keys j < S_q; none sees a key past them
    auto qs = at::cumsum(qs_.flip({2}), 2).flip({2});
    auto rs = at::cumsum(r.flip({2}), 2).flip({2});
    if (s_k <= s_q) {
      qs = qs.narrow(2, 0, s_k), rs = rs.narrow(2, 0, s_k);
    } else {
      qs = at::constant_pad_nd(qs, {0, 0, 0, s_k - s_q}, 0), rs = at::constant_pad_nd(rs, {0, s_k - s_q}, 0);
    }
    const auto qbar = ((dkl * a).unsqueeze(-1) * qs).to(q.scalar_type());
    const auto kq = (qs.view({b(), h_kv(), group(), s_k, d}) * k.to(a.scalar_type()).unsqueeze(2)).sum(-1).view({b(), h(), s_k});
    return {qbar, dkl * (scale * kq - rs) * kvh, dq};
  }

  // Lognormal's (QBAR, dA, the dQ term), from 2·dkl·e_ij's terms (bam.py's `LinearKl`).
  std::array<at::Tensor, 3> lognormal_grads(const at::Tensor& rb, const at::Tensor& dkl_) const {
    const int64_t s_k = k.size(2), d = q.size(3);
    const auto cs = centred();
    const auto m = row_means(rb, cs.kbar);
    const auto qvh = qv.unsqueeze(1);  // (B, 1, S_q)
    const auto kvh = kv.unsqueeze(1);  // (B, 1, S_k)
    const auto qa = qf();              // the allowed queries, 0 elsewhere
    const auto dkl2 = 2 * dkl_.to(a.scalar_type()).view({b(), h(), 1});
    const auto dq = dkl2.unsqueeze(-1) * scale *
                    (scale * times_c(qa, cs.c) - cs.u.unsqueeze(2) + (cs.n * m).unsqueeze(-1) * cs.kbar.unsqueeze(2)) *
                    qvh.unsqueeze(-1);
    const auto p = at::matmul(qa.transpose(-2, -1), qa);  // (B, H, d, d): Σ_i q_i q_iᵀ
    const auto big_m = (m.unsqueeze(-1) * qa).sum(2), big_q = qa.sum(2);  // (B, H, d)
    // P k̃_j per query head: (B, H_kv, 1, S_k, d) against (B, H_kv, G, d, d)
    const auto pk = at::matmul(cs.kc.unsqueeze(2), p.view({b(), h_kv(), group(), d, d})).view({b(), h(), s_k, d});
    const auto qbar = dkl2.unsqueeze(-1) * (scale * pk + big_m.unsqueeze(2) - cs.ac.unsqueeze(-1) * big_q.unsqueeze(2)) *
                      kvh.unsqueeze(-1);
    const auto kq = (cs.kc.unsqueeze(2) * big_q.view({b(), h_kv(), group(), 1, d})).sum(-1).view({b(), h(), s_k});  // Q·k̃_j
    const auto da = -dkl2 * (scale * kq + m.sum(2, true) - qvh.sum(2, true) * cs.ac) * kvh;
    return {qbar.to(q.scalar_type()), da, dq};
  }
};

// A call's `LinearKl`.
LinearKl linear_of(const Call& c) { return LinearKl(c.q, c.k, c.prior, c.qpad, c.kpad, c.spec.causal, c.spec.scale, c.spec.kl); }

// What a forward leaves for its backward. 0 and 1 sweeps: c (B, H, S_k, padded as `Call::stat`
// pads the per-key statistics; zeros for softmax) and r (B, H, S_q), and with a sweep and a
// backward to follow the queries' column mean qbar (B, H, S_k, d, in q's dtype:
// Σ_i exp(z_ij − c_j) q_i, from which the key pass takes DNAS's correction to dK); HNAS adds
// softmax's output and row statistic (out2, r2), BAM over HNAS the two bases' row statistics (rd,
// rs); a KL term its per-row statistics (rb, ks, and the part's rows trow). Sinkhorn-N: c and r
// hold a potential per sweep, (N, B, H, S).
struct Forward {
  at::Tensor out, c, r, out2, r2, rd, rs, rb, ks, trow, qbar;
};

// A row pass's tensors for the KL term's per-row statistics, made in `f`.
void with_kl_rows(const Call& call, Forward& f, std::map<std::string, at::Tensor>& row) {
  if (call.spec.kl == 0) return;
  f.rb = call.stat(false), f.ks = call.stat(false), f.trow = call.stat(false);
  row.insert({{"RB", f.rb}, {"KS", f.ks}, {"TROW", f.trow}});
}

Forward sinkhorn_forward(const Call& call, at::Tensor out) {
  const int64_t n = call.spec.sweeps;
  auto cs = call.stat(true, {n}, INFINITY), rs = call.stat(false, {n});
  for (int64_t t = 0; t < n; ++t) {
    call.launch("_sink_reduce", true, call.h(), {{"COLUMNS", 1}, {"LSE", 1}, {"HAS_RPOT", t > 0 ? 1 : 0}},
                {{"RPOT", rs[t > 0 ? t - 1 : 0]}, {"CPOT", cs[t]}, {"COEF", cs[t]}, {"OUT", cs[t]}});
    if (t < n - 1) {
      call.launch("_sink_reduce", false, call.h(), {{"COLUMNS", 0}, {"LSE", 1}, {"HAS_RPOT", 0}},
                  {{"RPOT", rs[t]}, {"CPOT", cs[t]}, {"COEF", rs[t]}, {"OUT", rs[t]}});
    }
  }
  Forward f;
  f.out = out, f.c = cs, f.r = rs;
  // The last row pass is DNAS's with the last column potential as its statistic.
  std::map<std::string, at::Tensor> row = {{"C", cs[n - 1]}, {"O", out}, {"R", rs[n - 1]}, {"O2", out}, {"R2", rs[n - 1]}};
  with_kl_rows(call, f, row);
  call.launch("_row_pass", false, call.h(), {{"HYBRID", 0}, {"SWEEPS", 1}}, row);
  return f;
}

Forward fused_forward(const Call& call) {
  auto out = at::empty({call.b(), call.h(), call.s_q(), call.v.size(3)}, call.q.options());
  if (call.spec.sweeps > 1) return sinkhorn_forward(call, out);
  Forward f;
  f.out = out, f.c = call.stat(true, {}, INFINITY), f.r = call.stat(false);
  if (call.spec.sweeps > 0) {
    std::map<std::string, at::Tensor> column = {{"C", f.c}};
    if (call.grads) {
      f.qbar = at::empty({call.b(), call.h(), call.s_k(), call.q.size(3)}, call.q.options());
      column["QBAR"] = f.qbar;
    }
    call.launch("_column_pass", true, call.h(), {{"CONTEXT", call.grads ? 1 : 0}}, column);
  }
  const bool two = call.spec.hybrid && !call.mix();  // HNAS's two accumulators
  f.out2 = two ? at::empty_like(out) : out;
  f.r2 = two ? call.stat(false) : f.r;
  std::map<std::string, at::Tensor> row = {{"C", f.c}, {"O", out}, {"R", f.r}, {"O2", f.out2}, {"R2", f.r2}};
  if (call.mix()) {
    // DNAS's and softmax's row statistics first, for the mixture's row pass.
    f.rd = call.stat(false), f.rs = call.stat(false);
    const auto none = at::zeros_like(f.c);
    for (const auto& [columns, rows] : {std::pair{f.c, f.rd}, std::pair{none, f.rs}}) {
      call.launch("_sink_reduce", false, call.h(), {{"COLUMNS", 0}, {"LSE", 1}, {"HAS_RPOT", 0}},
                  {{"RPOT", f.r}, {"CPOT", columns}, {"COEF", columns}, {"OUT", rows}});
    }
    row.insert({{"RD", f.rd}, {"RS", f.rs}});
  }
  with_kl_rows(call, f, row);
  call.launch("_row_pass", false, call.h(), {{"HYBRID", two ? 1 : 0}}, row);
  if (call.linear_kl()) {
    const auto [ks, trow] = linear_of(call).rows(f.rb);
    f.ks.copy_(ks), f.trow.copy_(trow);
  }
  if (!two) f.out2 = f.r2 = at::Tensor();
  return f;
}

// The received mass Σ_i p_ij, (1, B, H, S_k): a key pass without gradients per branch from the
// forward's statistics (HNAS without noise: DNAS's and softmax's, mixed by the gate; Sinkhorn-N:
// DNAS's weights with the last potentials), as plans.py's `received=True` launches it. BAM's: the
// sampled weights', the same draws again, without the KL term (which moves no weight); over HNAS
// the mixture's, from its row pass's statistics.
at::Tensor received_mass(const Call& call, const Forward& f) {
  const auto one = [&](int64_t sweeps, const at::Tensor& c, const at::Tensor& r) {
    auto mass = call.stat(true);
    std::map<std::string, at::Tensor> key = {{"C", c},      {"R", r},          {"DO", call.q}, {"DELTA", r},
                                             {"DK", call.k}, {"DV_OUT", call.v}, {"G", mass},    {"MASS", mass}};
    if (call.mix()) key.insert({{"RD", f.rd}, {"RS", f.rs}});
    call.launch("_key_pass", true, call.h_kv(), {{"GRADS", 0}, {"SWEEPS", sweeps}, {"KL", 0}}, key);
    return call.keys_only(mass).contiguous();
  };
  const int64_t n = call.spec.sweeps;
  if (n > 1) return one(1, f.c[n - 1], f.r[n - 1]).unsqueeze(0);
  if (f.out2.defined()) {
    // HNAS without noise: each branch's mass from its own statistics (DNAS's first, as plans.py
    // launches them), mixed as the weights are.
    const auto u = call.shares.view({1, -1, 1});
    const auto dnas = one(1, f.c, f.r);
    const auto softmax = one(0, at::zeros_like(f.c), f.r2);
    return (u * dnas + (1 - u) * softmax).unsqueeze(0);
  }
  return one(n, f.c, f.r).unsqueeze(0);
}

// The elements of the float32 buffers that row_dots and mixed form a block of rows at a time
// (16 MiB): at the output's full size such a buffer would be twice the output in bfloat16.
constexpr int64_t kRowBlock = int64_t{1} << 22;

// Applies f(start, count) to blocks of x's rows (dimension 2 of (B, H, S, d)) that hold at most
// kRowBlock elements (at least one row).
template <typename F>
void by_row_blocks(const at::Tensor& x, F f) {
  const int64_t per_row = std::max<int64_t>(x.size(0) * x.size(1) * x.size(3), 1);
  const int64_t rows = std::max<int64_t>(kRowBlock / per_row, 1);
  for (int64_t i = 0; i < x.size(2); i += rows) f(i, std::min(rows, x.size(2) - i));
}

// dO in the inputs' dtype, as wide as the padded output (zeros where no gradient came).
at::Tensor grad_of(const Call& call, const at::Tensor& out, const at::Tensor& grad_out) {
  return grad_out.defined() ? aligned(grad_out.to(call.q.scalar_type()), out.size(-1)) : at::zeros_like(out);
}

// D_i = Σ_d dO_id O_id, (B, H, S_q) float32. The products are formed exactly in float32
// (addcmul_ widens dO and O element by element, as float32 copies of both would), a block of
// rows at a time.
at::Tensor row_dots(const at::Tensor& grad, const at::Tensor& out) {
  auto dots = at::empty({out.size(0), out.size(1), out.size(2)}, out.options().dtype(at::kFloat));
  by_row_blocks(out, [&](int64_t i, int64_t n) {
    auto products = at::zeros({out.size(0), out.size(1), n, out.size(3)}, out.options().dtype(at::kFloat));
    products.addcmul_(grad.narrow(2, i, n), out.narrow(2, i, n));
    dots.narrow(2, i, n).copy_(products.sum(-1));
  });
  return dots;
}

// HNAS's output u·O_DNAS + (1 − u)·O_softmax per head (u: `shares`), formed in float32 and rounded
// once to the outputs' dtype, a block of rows at a time. Each block takes two float32 copies, scaled
// and summed in place: the same products and sum as the one expression, whose five temporaries
// would all live until its end (at S = 4,096, B 1, H 8, d 64: 40 MiB beside a 4 MiB output).
// The copies are copies even for float32 outputs, which are kept for the backward pass.
at::Tensor mixed(const at::Tensor& out_d, const at::Tensor& out_s, const at::Tensor& shares) {
  auto out = at::empty_like(out_d);
  const auto u = shares.view({1, -1, 1, 1});
  const auto rest = 1 - u;
  by_row_blocks(out, [&](int64_t i, int64_t n) {
    auto dnas = out_d.narrow(2, i, n).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    auto softmax = out_s.narrow(2, i, n).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    out.narrow(2, i, n).copy_(dnas.mul_(u).add_(softmax.mul_(rest)));
  });
  return out;
}

// The gradients a backward returns: in q, k, v, the prior's values (B, H, S_k) with a KL term,
// and, over HNAS, the gate's per-row gradient (B, H, S_q).
struct Grads {
  at::Tensor dq, dk, dv, da, gu;
};

// The KL term's tensors for a gradient pass: its per-row statistics from the forward, the
// gradient in its part (`grad_part`; undefined: none, and the passes take zeros, which add
// nothing), and the prior's gradient, made in `d`.
std::map<std::string, at::Tensor> kl_grads(const Call& call, const Forward& f, const at::Tensor& grad_part, Grads& d) {
  if (call.spec.kl == 0) return {};
  const auto dkl = grad_part.defined() ? grad_part.to(at::kFloat).contiguous() : at::zeros({call.b(), call.h()}, call.stats());
  d.da = call.stat(true);
  return {{"RB", f.rb}, {"KS", f.ks}, {"DKL", dkl}, {"DA", d.da}};
}

// One of HNAS's branches in a backward: each head's share of dO (H,), the branch's D_i (the
// share times Σ_d dO·O of its output), and whether its passes add their gradients to those in `Grads` (the other branch's).
struct Branch {
  at::Tensor shares, delta;
  bool add = false;
};

// The gradient passes of the plan with `sweeps` 0 or 1 for statistics (c, r), by recomputation,
// writing d.dq, d.dk and d.dv (and the KL term's and the gate's gradients); `branch`: one of
// HNAS's. Over softmax's base alone (no sweeps, no mixture, no branch), in 16-bit inputs up to
// kAtomicDqWidest, the key pass adds dQ by atomics, in float32, and no query pass follows,
// unless libtorch's deterministic algorithms are asked for, as `plans.py` does.
void gradient_passes(const Call& call, int64_t sweeps, const at::Tensor& c, const at::Tensor& r, const Forward& f,
                     const at::Tensor& grad, const at::Tensor& delta, const at::Tensor& grad_part, Grads& d,
                     const Branch* branch = nullptr) {
  auto g = call.stat(true);
  std::map<std::string, at::Tensor> key = {{"C", c},     {"R", r},         {"DO", grad}, {"DELTA", delta},
                                           {"DK", d.dk}, {"DV_OUT", d.dv}, {"G", g},     {"MASS", g}};
  std::map<std::string, at::Tensor> query = {{"C", c}, {"R", r}, {"DO", grad}, {"DELTA", delta}, {"G", g}, {"DQ", d.dq}};
  for (const auto& [name, t] : kl_grads(call, f, grad_part, d)) key[name] = query[name] = t;
  if (sweeps > 0) {
    TORCH_CHECK(f.qbar.defined(), "the fused CUDA route: DNAS's backward needs the queries' column mean of a forward that had "
                "a backward in view");
    key["QBAR"] = f.qbar;
  }
  at::Tensor dq_term;  // the KL part's linear terms (`LinearKl`)
  if (call.linear_kl()) {  // (kl_grads gave DKL: zeros where no gradient reached the part)
    auto [qbar, da, term] = linear_of(call).grads(f.rb, key.at("DKL"));
    key["QBAR"] = qbar;
    call.keys_only(d.da).copy_(da);
    dq_term = term;
  }
  std::map<std::string, int64_t> key_settings = {{"GRADS", 1}, {"SWEEPS", sweeps}}, query_settings = {{"SWEEPS", sweeps}};
  if (branch != nullptr) {
    key["SHARES"] = query["SHARES"] = branch->shares;
    for (auto* settings : {&key_settings, &query_settings}) settings->insert({{"SHARE", 1}, {"ADD", branch->add ? 1 : 0}});
  }
  if (call.mix()) {
    const auto rho_d = call.stat(false), rho_s = call.stat(false);
    for (auto* pass : {&key, &query}) pass->insert({{"RD", f.rd}, {"RS", f.rs}, {"RHO_D", rho_d}, {"RHO_S", rho_s}});
    // The gate's gradient per row and the rows' terms of the mixture, before the key pass.
    d.gu = call.stat(false);
    auto rows = query;
    rows["GU"] = d.gu;
    call.launch("_query_pass", false, call.h(), {{"SWEEPS", sweeps}, {"ROWS", 1}}, rows);
  }
  if (sweeps == 0 && branch == nullptr && !call.mix() && call.q.scalar_type() != at::kFloat &&
      call.head_dim <= kAtomicDqWidest && !at::globalContext().deterministicAlgorithms()) {
    auto dq = dq_term.defined() ? dq_term.contiguous() : at::zeros(call.q.sizes(), call.stats());
    key["DQ"] = dq;
    key_settings["ATOMIC_DQ"] = 1;
    call.launch("_key_pass", true, call.h_kv(), key_settings, key);
    d.dq.copy_(dq);
    return;
  }
  call.launch("_key_pass", true, call.h_kv(), key_settings, key);
  call.launch("_query_pass", false, call.h(), query_settings, query);
}

// The plan with `sweeps` 0 or 1 for statistics (c, r), by recomputation.
Grads plan_backward(const Call& call, int64_t sweeps, const at::Tensor& out, const at::Tensor& c, const at::Tensor& r, const Forward& f,
                    const at::Tensor& grad_out, const at::Tensor& grad_part) {
  const auto grad = grad_of(call, out, grad_out);
  const auto delta = row_dots(grad, out);
  Grads d;
  d.dq = at::empty_like(call.q), d.dk = at::empty_like(call.k), d.dv = at::empty_like(call.v);
  gradient_passes(call, sweeps, c, r, f, grad, delta, grad_part, d);
  return d;
}

// HNAS without noise, u·(DNAS's) + (1 − u)·(softmax's) per head: each branch's passes take its
// share of dO, applied in the passes (share·dO is never formed); DNAS's branch writes dq, dk and
// dv and softmax's adds to them, so that one set of gradients exists. The gate's gradient per
// row is Σ_d dO·(O_DNAS − O_softmax). Every row reduction comes before dq, dk and dv are
// allocated.
Grads hybrid_backward(const Call& call, const Forward& f, const at::Tensor& grad_out) {
  const auto grad = grad_of(call, f.out, grad_out);
  const auto dots_d = row_dots(grad, f.out), dots_s = row_dots(grad, f.out2);
  const auto u = call.shares.view({1, -1, 1});
  const Branch dnas{call.shares, u * dots_d, false}, softmax{1 - call.shares, (1 - u) * dots_s, true};
  Grads d;
  d.gu = dots_d - dots_s;
  d.dq = at::empty_like(call.q), d.dk = at::empty_like(call.k), d.dv = at::empty_like(call.v);
  gradient_passes(call, 1, f.c, f.r, f, grad, dnas.delta, at::Tensor(), d, &dnas);
  gradient_passes(call, 0, at::zeros_like(f.c), f.r2, f, grad, softmax.delta, at::Tensor(), d, &softmax);
  return d;
}

// Sinkhorn-N: g from dS¹, the potentials' gradients reduced from the last sweep back to the
// first, then dK, dV and dQ with the whole dz: dQ added by atomics from the dK/dV stage, in
// float32, or in a stage of its own (forming each tile's dz again) where libtorch's deterministic
// algorithms are asked for (`torch.use_deterministic_algorithms`), as `plans.py` does.
Grads sinkhorn_backward(const Call& call, const Forward& f, const at::Tensor& grad_out, const at::Tensor& grad_part) {
  const int64_t n = call.spec.sweeps;
  const auto grad = grad_of(call, f.out, grad_out);
  const auto delta = row_dots(grad, f.out);
  Grads d;
  d.dq = at::empty_like(call.q), d.dk = at::empty_like(call.k), d.dv = at::empty_like(call.v);
  auto gc = at::zeros_like(f.c), gr = at::zeros_like(f.r), g = call.stat(true);
  std::map<std::string, at::Tensor> common = {{"CS", f.c},       {"RS", f.r},  {"GC", gc},   {"GR", gr},       {"DO", grad},
                                              {"DELTA", delta}, {"DQ", d.dq}, {"DK", d.dk}, {"DV_OUT", d.dv}, {"G", g}};
  for (const auto& [name, t] : kl_grads(call, f, grad_part, d)) common[name] = t;
  call.launch("_sink_key_grads", true, call.h(), {{"STAGE", 0}}, common);
  gc[n - 1].copy_(-g);
  for (int64_t t = n - 2; t >= 0; --t) {
    call.launch("_sink_reduce", false, call.h(), {{"COLUMNS", 0}, {"LSE", 0}, {"HAS_RPOT", 1}},
                {{"RPOT", f.r[t]}, {"CPOT", f.c[t + 1]}, {"COEF", gc[t + 1]}, {"OUT", gr[t]}});
    call.launch("_sink_reduce", true, call.h(), {{"COLUMNS", 1}, {"LSE", 0}, {"HAS_RPOT", 1}},
                {{"RPOT", f.r[t]}, {"CPOT", f.c[t]}, {"COEF", gr[t]}, {"OUT", gc[t]}});
  }
  if (at::globalContext().deterministicAlgorithms()) {
    call.launch("_sink_key_grads", true, call.h_kv(), {{"STAGE", 1}}, common);
    call.launch("_sink_query_grads", false, call.h(), {}, common);
  } else {
    auto dq = at::zeros(call.q.sizes(), call.stats());
    auto stage = common;
    stage["DQ"] = dq;
    call.launch("_sink_key_grads", true, call.h_kv(), {{"STAGE", 1}, {"ATOMIC_DQ", 1}}, stage);
    d.dq.copy_(dq);
  }
  return d;
}

// The gradients for a forward's statistics; `grads` the gradients in (out, the KL part).
Grads fused_backward(const Call& call, const Forward& f, const variable_list& grads) {
  const auto grad_part = call.spec.kl != 0 ? grads[1] : at::Tensor();
  if (call.spec.sweeps > 1) return sinkhorn_backward(call, f, grads[0], grad_part);
  if (call.spec.hybrid && !call.mix()) return hybrid_backward(call, f, grads[0]);
  return plan_backward(call, std::min<int64_t>(call.spec.sweeps, 1), f.out, f.c, f.r, f, grads[0], grad_part);
}

struct FusedAttention : torch::autograd::Function<FusedAttention> {
  // (output, the KL part T (B, H): zeros without a KL term, the received mass: empty unless
  // asked), differentiable in q, k, v, the prior and (HNAS) the gate logits.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               std::optional<at::Tensor> kpad, std::optional<at::Tensor> qpad, std::optional<at::Tensor> pattern,
                               std::optional<at::Tensor> bias, std::optional<at::Tensor> prior, std::optional<at::Tensor> logit,
                               double scale, int64_t sweeps, bool hybrid, bool causal, int64_t noise, int64_t kl, double noise_scale,
                               int64_t seed, bool mass, bool grads) {
    const Spec spec{scale, sweeps, hybrid, causal, noise, kl, noise_scale, static_cast<uint64_t>(seed), mass};
    const Masks masks{kpad.value_or(at::Tensor()), qpad.value_or(at::Tensor()), pattern.value_or(at::Tensor()),
                      bias.value_or(at::Tensor()), at::Tensor()};
    auto call = make_call(q, k, v, masks, spec, prior.value_or(at::Tensor()), logit.value_or(at::Tensor()));
    call.grads = grads;
    const auto f = fused_forward(call);
    const auto part = kl != 0 ? f.trow.sum(-1) : at::zeros({call.b(), call.h()}, call.stats());
    // HNAS without noise: the branches' outputs mixed here (both kept for the backward).
    const auto out = hybrid && noise == 0 ? mixed(f.out, f.out2, call.shares) : f.out;
    const auto received = mass ? received_mass(call, f) : at::empty({0}, call.stats());
    // q, k and v as given (the backward's call pads them again, and cuts its gradients back to
    // them); the outputs padded, as the backward's passes read them.
    ctx->save_for_backward({q, k, v, f.out, f.c, f.r, f.out2, f.r2, f.rd, f.rs, f.rb, f.ks, f.qbar});
    // The backward forms its call from these again, the block map included (formed once).
    for (const auto& [name, t] : {std::pair<const char*, at::Tensor>{"kpad", call.kpad}, {"qpad", call.qpad}, {"pattern", masks.pattern},
                                  {"bias", masks.bias}, {"blocks", call.blocks}, {"prior", prior.value_or(at::Tensor())},
                                  {"logit", logit.value_or(at::Tensor())}}) {
      probattn::tiled::keep_optional(ctx, name, t);
    }
    auto& data = ctx->saved_data;
    data["scale"] = scale, data["sweeps"] = sweeps, data["hybrid"] = hybrid, data["causal"] = causal;
    data["noise"] = noise, data["kl"] = kl, data["noise_scale"] = noise_scale, data["seed"] = seed;
    if (kl == 0) ctx->mark_non_differentiable({part});
    ctx->mark_non_differentiable({received});
    return {narrowed(out, call.dv), part, received};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto prior = probattn::tiled::kept_optional(ctx, "prior"), logit = probattn::tiled::kept_optional(ctx, "logit");
    auto& data = ctx->saved_data;
    const Spec spec{data["scale"].toDouble(), data["sweeps"].toInt(), data["hybrid"].toBool(), data["causal"].toBool(),
                    data["noise"].toInt(),   data["kl"].toInt(),     data["noise_scale"].toDouble(),
                    static_cast<uint64_t>(data["seed"].toInt())};
    const auto kept = [&](const char* name) { return probattn::tiled::kept_optional(ctx, name); };
    const auto call =
        make_call(saved[0], saved[1], saved[2], Masks{kept("kpad"), kept("qpad"), kept("pattern"), kept("bias"), kept("blocks")}, spec,
                  prior, logit, 0, /*backward=*/true);
    Forward f;
    f.out = saved[3], f.c = saved[4], f.r = saved[5], f.out2 = saved[6], f.r2 = saved[7], f.rd = saved[8], f.rs = saved[9];
    f.rb = saved[10], f.ks = saved[11], f.qbar = saved[12];
    const auto d = fused_backward(call, f, grads);
    variable_list out(20);  // one per input of forward: q, k, v, kpad, qpad, pattern, bias, prior, logit, then the settings
    out[0] = narrowed(d.dq, call.d), out[1] = narrowed(d.dk, call.d), out[2] = narrowed(d.dv, call.dv);
    if (prior.defined() && d.da.defined()) {
      out[7] = call.keys_only(d.da).unsqueeze(2).sum_to_size(prior.sizes()).to(prior.scalar_type());
    }
    if (logit.defined() && d.gu.defined()) {
      // d/dlogit of u·(DNAS's) + (1 − u)·(softmax's) through u = sigmoid(logit): Σ over batch and rows.
      const auto u = at::sigmoid(logit.detach().to(at::kFloat));
      out[8] = (d.gu.sum(at::IntArrayRef{0, 2}) * u * (1 - u)).to(logit.scalar_type());
    }
    return out;
  }
};

std::optional<at::Tensor> some(const pa_tensor* t) { return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt; }

}  // namespace

extern "C" {

char* pa_fused_cuda_dry_run(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* key_padding,
                            const pa_tensor* query_padding, const pa_tensor* pattern, const pa_tensor* bias, const pa_tensor* prior,
                            const pa_tensor* hybrid_logit, const pa_fused_spec* spec, int32_t arch, char** json) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {spec, "spec"}, {json, "json"}}) {
      probattn::require(pointer, "pa_fused_cuda_dry_run", name);
    }
    TORCH_CHECK(arch > 0, "pa_fused_cuda_dry_run: a compute capability, such as 90, got ", arch);
    const probattn::tiled::NoAutocast no_autocast;
    const at::NoGradGuard no_grad;
    const auto given = [](const pa_tensor* t) { return t != nullptr ? *t : at::Tensor(); };
    const Masks masks{given(key_padding), given(query_padding), given(pattern), given(bias), at::Tensor()};
    auto call = make_call(*q, *k, *v, masks, Spec::of(*spec), given(prior), given(hybrid_logit), arch);
    call.grads = true;  // the backward's launches follow
    std::vector<std::string> launches;
    call.dry = &launches;
    const auto f = fused_forward(call);
    if (spec->mass != 0) received_mass(call, f);
    fused_backward(call, f, {at::ones_like(f.out), spec->kl != 0 ? at::ones({call.b(), call.h()}, call.stats()) : at::Tensor()});
    std::string text = "[";
    for (size_t i = 0; i < launches.size(); ++i) text += (i > 0 ? ",\n " : "") + launches[i];
    *json = probattn::copy_string(text + "]");
  });
}

char* pa_fused_linear_kl_terms(const pa_tensor* q, const pa_tensor* k, const pa_tensor* prior, const pa_tensor* query_padding,
                               const pa_tensor* key_padding, int32_t causal, double scale, int32_t kl, const pa_tensor* rb,
                               const pa_tensor* dkl, pa_tensor** terms) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {prior, "prior"}, {query_padding, "query_padding"},
                                 {key_padding, "key_padding"}, {rb, "rb"}, {dkl, "dkl"}, {terms, "terms"}}) {
      probattn::require(pointer, "pa_fused_linear_kl_terms", name);
    }
    const at::NoGradGuard no_grad;
    const LinearKl linear(*q, *k, *prior, *query_padding, *key_padding, causal != 0, scale, kl);
    const auto [ks, trow] = linear.rows(*rb);
    const auto [qbar, da, dq] = linear.grads(*rb, *dkl);
    // Every handle exists before any is handed out: an allocation that fails leaks none.
    std::array<std::unique_ptr<at::Tensor>, 5> held;
    const std::array<at::Tensor, 5> formed{ks, trow, qbar, da, dq};
    for (size_t i = 0; i < held.size(); ++i) held[i] = std::make_unique<at::Tensor>(formed[i].contiguous());
    for (size_t i = 0; i < held.size(); ++i) terms[i] = held[i].release();
  });
}

char* pa_fused_cuda_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* key_padding,
                              const pa_tensor* query_padding, const pa_tensor* pattern, const pa_tensor* bias, const pa_tensor* prior,
                              const pa_tensor* hybrid_logit, const pa_fused_spec* spec, pa_tensor** out, pa_tensor** kl_part,
                              pa_tensor** mass) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {spec, "spec"}, {out, "out"},
                                 {kl_part, "kl_part"}, {mass, "mass"}}) {
      probattn::require(pointer, "pa_fused_cuda_attention", name);
    }
    const probattn::tiled::NoAutocast no_autocast;
    const auto s = *spec;
    // Whether autograd will record this call, so that a backward may follow.
    bool grads = false;
    for (const pa_tensor* t : {q, k, v, prior, hybrid_logit}) grads = grads || (t != nullptr && t->defined() && t->requires_grad());
    grads = grads && at::GradMode::is_enabled();
    auto result = FusedAttention::apply(*q, *k, *v, some(key_padding), some(query_padding), some(pattern), some(bias), some(prior),
                                        some(hybrid_logit), s.scale, s.sweeps, s.hybrid != 0, s.causal != 0,
                                        int64_t{s.noise}, int64_t{s.kl}, s.noise_scale, static_cast<int64_t>(s.seed), s.mass != 0,
                                        grads);
    // Every handle exists before any is handed out: an allocation that fails leaks none.
    auto o = std::make_unique<at::Tensor>(result[0]);
    auto p = std::make_unique<at::Tensor>(result[1]);
    auto m = std::make_unique<at::Tensor>(result[2]);
    *out = o.release();
    *kl_part = p.release();
    *mass = m.release();
  });
}

}  // extern "C"
