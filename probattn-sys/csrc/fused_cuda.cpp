// The fused CUDA route: the plans' Triton kernels (python/probattn_tools/kernels/, docs/kernels.md),
// compiled ahead of time to cubins and embedded by the probattn-kernels crate, launched here
// through the CUDA driver API on libtorch's current stream, as one torch::autograd::Function.
//
// The driver library (libcuda.so.1) is opened on first use, never linked: a machine without a GPU
// builds and runs as before, and a call here says what is missing. The Rust side registers the
// embedded cubins once (pa_fused_register), then calls pa_fused_cuda_attention; which calls come
// here is decided on the Rust side (src/attention/fused_cuda.rs), which falls back to the tiles
// with the reason where this route does not serve a call.
//
// What is launched mirrors plans.py's orchestration for 0 and 1 sweeps (softmax, DNAS), with and
// without key padding, causal for softmax: forward, the column pass (DNAS) then the row pass;
// backward, the key pass (dK, dV, g) then the query pass (dQ), by recomputation. Kernel parameters
// are filled by name from the manifest's list, in its order, and checked against their declared
// types, so a kernel whose signature changes fails here by name instead of reading the wrong bytes.

#include <dlfcn.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>

#include "boundary.h"
#include "tiled.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- the CUDA driver, opened at run time (the few entry points and constants used, from cuda.h)

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
constexpr int kComputeMajor = 75;           // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kComputeMinor = 76;           // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
constexpr int kSharedOptin = 97;            // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kMaxDynamicShared = 8;        // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr unsigned kDefaultShared = 49152;  // what a launch may use without raising the limit

struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*device_get_attribute)(int*, int, CUdevice) = nullptr;
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, int, int) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**,
                            void**) = nullptr;
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  std::string missing;  // why the driver cannot be used ("" when it can)

  // Throws `what` failed with the driver's name for `status`, unless it succeeded.
  void check(CUresult status, const std::string& what) const {
    if (status == 0) return;
    const char* name = nullptr;
    if (get_error_name == nullptr || get_error_name(status, &name) != 0 || name == nullptr) name = "unknown error";
    TORCH_CHECK(false, "the fused CUDA route: ", what, " failed: ", name, " (CUresult ", status, ")");
  }
};

template <typename F>
bool bind(void* lib, const char* symbol, F& f, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, symbol));
  if (f == nullptr && missing.empty()) missing = std::string("libcuda.so.1 has no ") + symbol;
  return f != nullptr;
}

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      d.missing = std::string("the CUDA driver library libcuda.so.1 cannot be opened (") + (why != nullptr ? why : "no reason given") +
                  "): no NVIDIA driver on this machine";
      return d;
    }
    bind(lib, "cuInit", d.init, d.missing);
    bind(lib, "cuCtxGetCurrent", d.ctx_get_current, d.missing);
    bind(lib, "cuCtxSetCurrent", d.ctx_set_current, d.missing);
    bind(lib, "cuCtxGetDevice", d.ctx_get_device, d.missing);
    bind(lib, "cuDeviceGet", d.device_get, d.missing);
    bind(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx_retain, d.missing);
    bind(lib, "cuDeviceGetAttribute", d.device_get_attribute, d.missing);
    bind(lib, "cuModuleLoadData", d.module_load_data, d.missing);
    bind(lib, "cuModuleGetFunction", d.module_get_function, d.missing);
    bind(lib, "cuFuncSetAttribute", d.func_set_attribute, d.missing);
    bind(lib, "cuLaunchKernel", d.launch_kernel, d.missing);
    bind(lib, "cuGetErrorName", d.get_error_name, d.missing);
    if (d.missing.empty()) {
      const CUresult status = d.init(0);
      if (status != 0) d.missing = "cuInit failed (CUresult " + std::to_string(status) + "): the driver sees no usable GPU";
    }
    return d;
  }();
  return d;
}

const Driver& working_driver() {
  const auto& d = driver();
  TORCH_CHECK(d.missing.empty(), "the fused CUDA route: ", d.missing);
  return d;
}

// The driver's device for libtorch's CUDA device `index`, its primary context made current on this
// thread (libtorch's runtime uses the same context).
CUdevice current_context(const Driver& d, int index) {
  CUdevice device = 0;
  d.check(d.device_get(&device, index), "cuDeviceGet");
  CUcontext ctx = nullptr;
  d.check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  CUdevice on = -1;
  if (ctx != nullptr) d.check(d.ctx_get_device(&on), "cuCtxGetDevice");
  if (ctx == nullptr || on != device) {
    d.check(d.primary_ctx_retain(&ctx, device), "cuDevicePrimaryCtxRetain");
    d.check(d.ctx_set_current(ctx), "cuCtxSetCurrent");
  }
  return device;
}

int compute_capability(const Driver& d, CUdevice device) {
  int major = 0, minor = 0;
  d.check(d.device_get_attribute(&major, kComputeMajor, device), "cuDeviceGetAttribute(compute capability)");
  d.check(d.device_get_attribute(&minor, kComputeMinor, device), "cuDeviceGetAttribute(compute capability)");
  return major * 10 + minor;
}

// ---- the embedded kernels

struct Entry {
  std::string kernel;
  int arch = 0;
  at::ScalarType dtype = at::kBFloat16;
  int64_t head_dim = 0;
  std::map<std::string, int64_t> key;
  std::vector<std::pair<std::string, std::string>> params;  // (name, type), launch order
  unsigned num_warps = 4, shared = 0;
  int64_t block_m = 64, block_n = 64;
  std::string symbol;
  const void* image = nullptr;
};

struct Registry {
  std::mutex lock;
  std::vector<Entry> entries;
  std::map<std::pair<size_t, CUcontext>, CUfunction> loaded;  // (entry, context) → function
};

Registry& registry() {
  static Registry r;
  return r;
}

at::ScalarType dtype_named(const std::string& name) {
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  TORCH_CHECK(false, "the fused CUDA route: an embedded kernel's dtype is ", name, ", not bfloat16 or float16");
}

// "A=1,B=0" → {A: 1, B: 0}; "x:*bf16,y:i32" → [(x, *bf16), (y, i32)].
std::vector<std::pair<std::string, std::string>> pairs(const std::string& text, char sep) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const auto item = text.substr(start, end - start);
    const auto at = item.find(sep);
    TORCH_CHECK(at != std::string::npos, "the fused CUDA route: '", item, "' has no '", sep, "'");
    out.emplace_back(item.substr(0, at), item.substr(at + 1));
    start = end + 1;
  }
  return out;
}

// The kernel `name` of this architecture, dtype and head dimension whose constexprs are the
// launch's: every constexpr the entry was specialized on has the launch's value.
const Entry& find(const std::string& name, int arch, at::ScalarType dtype, int64_t head_dim,
                  const std::map<std::string, int64_t>& constexprs, size_t* index) {
  auto& r = registry();
  for (size_t i = 0; i < r.entries.size(); ++i) {
    const auto& e = r.entries[i];
    if (e.kernel != name || e.arch != arch || e.dtype != dtype || e.head_dim != head_dim) continue;
    bool same = true;
    for (const auto& [n, value] : e.key) {
      const auto it = constexprs.find(n);
      TORCH_CHECK(it != constexprs.end(), "the fused CUDA route: ", name, " was compiled with the constexpr ", n,
                  ", which this launch does not set");
      same = same && it->second == value;
    }
    if (same) {
      *index = i;
      return e;
    }
  }
  std::string asked;
  for (const auto& [n, value] : constexprs) asked += n + "=" + std::to_string(value) + " ";
  TORCH_CHECK(false, "the fused CUDA route: no embedded ", name, " for sm_", arch, ", ", c10::toString(dtype), ", head dimension ",
              head_dim, " and ", asked);
}

// The function of entry `index` in the current context, its module loaded on first use.
CUfunction function_of(const Driver& d, size_t index, CUdevice device) {
  auto& r = registry();
  CUcontext ctx = nullptr;
  d.check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  const auto key = std::make_pair(index, ctx);
  if (const auto it = r.loaded.find(key); it != r.loaded.end()) return it->second;
  const auto& e = r.entries[index];
  CUmodule module = nullptr;
  d.check(d.module_load_data(&module, e.image), "loading the cubin of " + e.kernel + " (sm_" + std::to_string(e.arch) + ")");
  CUfunction f = nullptr;
  d.check(d.module_get_function(&f, module, e.symbol.c_str()), "finding " + e.symbol + " in its cubin");
  if (e.shared > kDefaultShared) {
    int optin = 0;
    d.check(d.device_get_attribute(&optin, kSharedOptin, device), "cuDeviceGetAttribute(shared memory)");
    TORCH_CHECK(e.shared <= static_cast<unsigned>(optin), "the fused CUDA route: ", e.kernel, " needs ", e.shared,
                " bytes of shared memory per block, this GPU allows ", optin);
    d.check(d.func_set_attribute(f, kMaxDynamicShared, static_cast<int>(e.shared)), "raising " + e.kernel + "'s shared memory");
  }
  r.loaded.emplace(key, f);
  return f;
}

// ---- one call

// As Python names it (the dry run's record is compared with plans.py's).
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kByte: return "uint8";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

at::ScalarType declared_type(const std::string& type) {
  if (type == "*bf16") return at::kBFloat16;
  if (type == "*fp16") return at::kHalf;
  if (type == "*fp32") return at::kFloat;
  if (type == "*fp64") return at::kDouble;
  if (type == "*u8") return at::kByte;
  if (type == "*i64") return at::kLong;
  TORCH_CHECK(false, "the fused CUDA route: an embedded kernel takes a parameter of type ", type, ", which the launcher does not know");
}

// Pointer parameters a kernel of this route declares for features it does not use (masks,
// BAM's draws and KL term, HNAS's mixture): a one-element tensor of the declared type.
const std::set<std::string> kUnused = {"QPAD", "KPAD", "MASK", "BLOCKS", "BIAS", "DRAWS", "PRIOR", "RB", "KS", "TROW",
                                       "DKL",  "DA",   "RD",   "RS",     "LOGU", "RHO_D", "RHO_S", "GU"};

// BAM's sampling over the plan: the noise drawn in the kernels from the counter-based hash keyed by
// `seed` (the same ε as the tiles' and the CPU loop's), and the KL term's score-dependent part
// reduced there, against the prior's per-key values.
struct Sampling {
  int64_t noise = 0;  // 1 Weibull, 2 Lognormal
  int64_t kl = 0;     // 1 Σ a_j log π_ij, 2 Σ (log π_ij − a_j)²; the embedded set has kl = noise
  double scale = 0.0;  // 1/k or σ
  uint64_t seed = 0;
};

struct Call {
  at::Tensor q, k, v, kpad, scale;  // kpad: uint8 (B, S_k), undefined without key padding
  at::Tensor seed_words, prior;      // BAM: the seed's two 32-bit words (int64), a_j as (B, H, S_k) float32
  int64_t sweeps = 0, noise = 0, kl = 0;
  bool causal = false;
  int arch = 0;
  int64_t head_dim = 0;  // of the cubins: the smallest embedded one that holds d and d_v
  std::map<std::string, int64_t> ints;
  mutable std::map<at::ScalarType, at::Tensor> unused;  // one per declared type, for kUnused's parameters
  // A dry run (pa_fused_cuda_dry_run): each launch described here as JSON instead of run.
  mutable std::vector<std::string>* dry = nullptr;

  int64_t b() const { return q.size(0); }
  int64_t h() const { return q.size(1); }
  int64_t h_kv() const { return k.size(1); }
  int64_t s_q() const { return q.size(2); }
  int64_t s_k() const { return k.size(2); }
  at::TensorOptions stats() const { return q.options().dtype(at::kFloat); }

  std::map<std::string, int64_t> constexprs() const {
    return {{"HAS_QPAD", 0}, {"HAS_KPAD", kpad.defined() ? 1 : 0}, {"HAS_MASK", 0}, {"HAS_BIAS", 0},
            {"SWEEPS", std::min<int64_t>(sweeps, 1)}, {"CAUSAL", causal ? 1 : 0}, {"NOISE", noise}, {"KL", kl},
            {"WIDE", 0}, {"MIX", 0}, {"ROWS", 0}};
  }

  // Launches `name` over a grid of (blocks of `keys ? S_k : S_q`, B × heads) programs, its
  // constexprs the call's and `extra`, its pointers `tensors` (by name), its integers the call's.
  void launch(const std::string& name, bool keys, int64_t heads, const std::map<std::string, int64_t>& extra,
              const std::map<std::string, at::Tensor>& tensors) const {
    auto constexprs = this->constexprs();
    for (const auto& [n, value] : extra) constexprs[n] = value;
    std::lock_guard<std::mutex> hold(registry().lock);
    size_t index = 0;
    const auto& e = find(name, arch, q.scalar_type(), head_dim, constexprs, &index);
    std::string ints_json, tensors_json;

    std::vector<CUdeviceptr> pointers;
    std::vector<int32_t> integers;
    pointers.reserve(e.params.size() + 2);
    integers.reserve(e.params.size());
    std::vector<void*> args;
    for (const auto& [pname, type] : e.params) {
      if (type == "i32") {
        const auto it = ints.find(pname);
        TORCH_CHECK(it != ints.end(), "the fused CUDA route: ", name, " takes the integer ", pname, ", which the launcher does not set");
        TORCH_CHECK(it->second >= INT32_MIN && it->second <= INT32_MAX, "the fused CUDA route: ", pname, " = ", it->second,
                    " does not fit the kernels' 32-bit integers");
        integers.push_back(static_cast<int32_t>(it->second));
        args.push_back(&integers.back());
        ints_json += (ints_json.empty() ? "\"" : ", \"") + pname + "\": " + std::to_string(it->second);
        continue;
      }
      const auto want = declared_type(type);
      at::Tensor t;
      if (const auto it = tensors.find(pname); it != tensors.end()) {
        t = it->second;
        std::string shape;
        for (const auto n : t.sizes()) shape += (shape.empty() ? "" : ", ") + std::to_string(n);
        tensors_json += (tensors_json.empty() ? "\"" : ", \"") + pname + "\": [[" + shape + "], \"" + dtype_name(t.scalar_type()) + "\"]";
      } else {
        TORCH_CHECK(kUnused.count(pname) > 0, "the fused CUDA route: ", name, " takes the tensor ", pname,
                    ", which the launcher does not pass");
        auto& slot = unused[want];
        if (!slot.defined()) slot = at::zeros({2}, q.options().dtype(want));
        t = slot;
      }
      TORCH_CHECK(t.scalar_type() == want && t.device() == q.device() && t.is_contiguous(), "the fused CUDA route: ", name, "'s ", pname,
                  " must be a contiguous ", c10::toString(want), " tensor on ", q.device(), ", got ", c10::toString(t.scalar_type()),
                  " on ", t.device());
      pointers.push_back(dry != nullptr ? 0 : reinterpret_cast<CUdeviceptr>(t.data_ptr()));
      args.push_back(&pointers.back());
    }
    // Triton 3.6 appends two scratch pointers (global and profile); the embedded kernels need neither.
    pointers.push_back(0);
    args.push_back(&pointers.back());
    pointers.push_back(0);
    args.push_back(&pointers.back());

    const int64_t block = keys ? e.block_n : e.block_m;
    const int64_t blocks = ((keys ? s_k() : s_q()) + block - 1) / block;
    const int64_t programs = b() * heads;
    TORCH_CHECK(blocks <= INT32_MAX && programs <= 65535, "the fused CUDA route: a grid of ", blocks, " × ", programs,
                " programs exceeds CUDA's limits (B × heads ≤ 65535)");
    if (dry != nullptr) {
      std::string key;
      for (const auto& [n, value] : e.key) key += (key.empty() ? "\"" : ", \"") + n + "\": " + std::to_string(value);
      dry->push_back("{\"kernel\": \"" + name + "\", \"key\": {" + key + "}, \"grid\": [" + std::to_string(blocks) + ", " +
                     std::to_string(programs) + "], \"ints\": {" + ints_json + "}, \"tensors\": {" + tensors_json + "}}");
      return;
    }
    const auto& d = working_driver();
    const c10::DeviceGuard device_guard(q.device());
    const CUdevice device = current_context(d, q.device().index());
    const CUfunction f = function_of(d, index, device);
    const auto stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
    d.check(d.launch_kernel(f, static_cast<unsigned>(blocks), static_cast<unsigned>(programs), 1, 32 * e.num_warps, 1, 1, e.shared,
                            static_cast<CUstream>(stream.native_handle()), args.data(), nullptr),
            "launching " + name);
  }

  at::Tensor stat(bool keys) const { return at::zeros({b(), h(), keys ? s_k() : s_q()}, stats()); }
};

// `sampling`: BAM's, or none; `prior`: a_j broadcastable to (B, H, 1, S_k) with a KL term.
// `dry_arch`: 0 for a call that launches; else a dry run's compute capability (any device, no driver).
Call make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kpad, double scale, int64_t sweeps,
               bool causal, const Sampling& sampling, const at::Tensor& prior, int dry_arch = 0) {
  TORCH_CHECK((q.is_cuda() || dry_arch > 0) && k.device() == q.device() && v.device() == q.device(),
              "the fused CUDA route runs on one CUDA device, got ", q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "the fused CUDA route takes (B, H, S, d) tensors");
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              "the fused CUDA route takes bfloat16 or float16 q, k and v of one dtype, got ", c10::toString(q.scalar_type()), ", ",
              c10::toString(k.scalar_type()), ", ", c10::toString(v.scalar_type()));
  TORCH_CHECK(sweeps == 0 || sweeps == 1, "the fused CUDA route runs 0 or 1 sweeps (softmax, DNAS), got ", sweeps);
  TORCH_CHECK(!(causal && sweeps > 0), "a causal mask with a column sweep would let later queries change earlier ones' weights");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(3) == q.size(3) && v.size(1) == k.size(1) &&
                  v.size(2) == k.size(2) && k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
              "the fused CUDA route: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(), " do not fit together");
  Call c;
  c.q = q.contiguous();
  c.k = k.contiguous();
  c.v = v.contiguous();
  c.sweeps = sweeps;
  c.causal = causal;
  int device_arch = dry_arch;
  if (dry_arch == 0) {
    const auto& d = working_driver();
    const c10::DeviceGuard device_guard(q.device());
    device_arch = compute_capability(d, current_context(d, q.device().index()));
  }
  // A cubin runs on its own architecture and on later minor versions of the same major one (sm_80's
  // on sm_86 and sm_89): the newest such, then the smallest head dimension that holds d and d_v.
  const int64_t widest = std::max(q.size(3), v.size(3));
  {
    std::lock_guard<std::mutex> hold(registry().lock);
    for (const auto& e : registry().entries) {
      if (e.arch / 10 == device_arch / 10 && e.arch <= device_arch && e.arch > c.arch) c.arch = e.arch;
    }
    for (const auto& e : registry().entries) {
      if (e.arch == c.arch && e.dtype == q.scalar_type() && e.head_dim >= widest && (c.head_dim == 0 || e.head_dim < c.head_dim)) {
        c.head_dim = e.head_dim;
      }
    }
  }
  TORCH_CHECK(c.head_dim > 0, "the fused CUDA route has no embedded kernel for this GPU (sm_", device_arch, "), ",
              c10::toString(q.scalar_type()), " and head dimension ", widest);
  if (kpad.defined()) {
    TORCH_CHECK(kpad.dim() == 2 && kpad.size(0) == q.size(0) && kpad.size(1) == k.size(2), "the key padding mask must be (B, S_k) = (",
                q.size(0), ", ", k.size(2), "), got ", kpad.sizes());
    c.kpad = kpad.to(q.device(), at::kByte).contiguous();
  }
  c.scale = at::tensor({scale, sampling.scale}, at::TensorOptions().dtype(at::kFloat)).to(q.device());
  c.noise = sampling.noise;
  c.kl = sampling.kl;
  TORCH_CHECK(c.noise >= 0 && c.noise <= 2 && (c.kl == 0 || c.kl == c.noise), "the fused CUDA route draws Weibull (1) or Lognormal (2) "
              "noise with its own KL form, got noise ", c.noise, " and KL ", c.kl);
  TORCH_CHECK(c.noise == 0 || !causal, "the fused CUDA route has no causal BAM kernels");
  // Entry positions past 2^32 take the hash's wide form (WIDE), which the embedded set leaves out.
  TORCH_CHECK(c.noise == 0 || q.size(0) * q.size(1) * q.size(2) * k.size(2) <= (int64_t{1} << 32),
              "the fused CUDA route draws BAM's noise for at most 2^32 score entries");
  c.seed_words = at::tensor({static_cast<int64_t>(sampling.seed & 0xFFFFFFFFu), static_cast<int64_t>(sampling.seed >> 32)},
                            at::TensorOptions().dtype(at::kLong))
                     .to(q.device());
  if (c.kl != 0) {
    TORCH_CHECK(prior.defined() && prior.is_floating_point() && prior.dim() <= 4, "a KL term needs the prior's per-key values, "
                "a floating-point tensor broadcastable to (B, H, 1, S_k)");
    auto own = prior.detach().to(q.device(), at::kFloat);
    while (own.dim() < 4) own = own.unsqueeze(0);
    TORCH_CHECK(own.size(2) == 1, "the prior has shape ", prior.sizes(), ": one value per key, (B, H, 1, S_k), not per query");
    c.prior = own.expand({q.size(0), q.size(1), 1, k.size(2)}).squeeze(2).contiguous();
  }
  const auto qs = c.q.strides(), ks = c.k.strides(), vs = c.v.strides();
  const int64_t b = c.b(), h = c.h(), s_q = c.s_q(), s_k = c.s_k(), dv = v.size(3);
  c.ints = {{"stride_qb", qs[0]}, {"stride_qh", qs[1]}, {"stride_qs", qs[2]}, {"stride_kb", ks[0]}, {"stride_kh", ks[1]},
            {"stride_ks", ks[2]}, {"stride_vb", vs[0]}, {"stride_vh", vs[1]}, {"stride_vs", vs[2]},
            // outputs, gradients and statistics are contiguous, shaped as what they belong to
            {"stride_ob", h * s_q * dv}, {"stride_oh", s_q * dv}, {"stride_os", dv}, {"stride_dob", h * s_q * dv},
            {"stride_doh", s_q * dv}, {"stride_dos", dv}, {"stride_dqb", qs[0]}, {"stride_dqh", qs[1]}, {"stride_dqs", qs[2]},
            {"stride_dkb", ks[0]}, {"stride_dkh", ks[1]}, {"stride_dks", ks[2]}, {"stride_dvb", vs[0]}, {"stride_dvh", vs[1]},
            {"stride_dvs", vs[2]}, {"stride_cb", h * s_k}, {"stride_ch", s_k}, {"stride_rb", h * s_q}, {"stride_rh", s_q},
            {"stride_t", b * h * s_k}, {"stride_tr", b * h * s_q}, {"stride_qpad", 0}, {"stride_kpad", kpad.defined() ? s_k : 0},
            {"stride_mb", 0}, {"stride_mh", 0}, {"stride_mm", 0}, {"stride_mn", 0}, {"stride_bb", 0}, {"stride_bh", 0},
            {"stride_bm", 0}, {"stride_bn", 0}, {"stride_ab", 0}, {"stride_ah", 0}, {"stride_am", 0}, {"stride_an", 0},
            {"stride_pb", c.kl != 0 ? h * s_k : 0}, {"stride_ph", c.kl != 0 ? s_k : 0}, {"stride_pn", c.kl != 0 ? 1 : 0},
            {"H", h}, {"H_KV", c.h_kv()}, {"GROUP", h / c.h_kv()}, {"S_Q", s_q}, {"S_K", s_k}, {"D", q.size(3)}, {"DV", dv}};
  // Every offset a kernel forms is a 32-bit product of these.
  for (const auto& t : {c.q, c.k, c.v}) {
    TORCH_CHECK(t.numel() <= INT32_MAX, "the fused CUDA route indexes with 32-bit integers: a tensor of ", t.numel(),
                " elements is too large");
  }
  TORCH_CHECK(b * h * s_q * dv <= INT32_MAX, "the fused CUDA route indexes with 32-bit integers: the output is too large");
  return c;
}

// The masks a pass reads, by name.
std::map<std::string, at::Tensor> with_masks(const Call& c, std::map<std::string, at::Tensor> tensors) {
  tensors["Q"] = c.q;
  tensors["K"] = c.k;
  tensors["V"] = c.v;
  tensors["SCALE"] = c.scale;
  if (c.kpad.defined()) tensors["KPAD"] = c.kpad;
  if (c.noise != 0) tensors["DRAWS"] = c.seed_words;
  if (c.kl != 0) tensors["PRIOR"] = c.prior;
  return tensors;
}

// (out, c, r, rb, ks, trow): the output, the column and row statistics (c zero for softmax), and
// with a KL term the row pass's per-row statistics of it (RB, KS, TROW; undefined without).
std::vector<at::Tensor> fused_forward(const Call& call) {
  auto out = at::empty({call.b(), call.h(), call.s_q(), call.v.size(3)}, call.q.options());
  auto c = call.stat(true), r = call.stat(false);
  if (call.sweeps > 0) call.launch("_column_pass", true, call.h(), {}, with_masks(call, {{"C", c}}));
  std::map<std::string, at::Tensor> row = {{"C", c}, {"O", out}, {"R", r}, {"O2", out}, {"R2", r}};
  at::Tensor rb, ks, trow;
  if (call.kl != 0) {
    rb = call.stat(false), ks = call.stat(false), trow = call.stat(false);
    row.insert({{"RB", rb}, {"KS", ks}, {"TROW", trow}});
  }
  call.launch("_row_pass", false, call.h(), {{"HYBRID", 0}}, with_masks(call, row));
  return {out, c, r, rb, ks, trow};
}

// (dq, dk, dv, da) by recomputation; `forward` is fused_forward's result, `grad_part` the
// gradient in the KL part (B, H) (undefined: none; the passes then take zeros, which add nothing).
// da (B, H, S_k) is the gradient in the prior's values, with a KL term.
std::vector<at::Tensor> fused_backward(const Call& call, const std::vector<at::Tensor>& forward, const at::Tensor& grad_out,
                                       const at::Tensor& grad_part) {
  const auto &out = forward[0], &c = forward[1], &r = forward[2];
  const auto grad = grad_out.defined() ? grad_out.to(call.q.scalar_type()).contiguous() : at::zeros_like(out);
  const auto delta = (grad.to(at::kFloat) * out.to(at::kFloat)).sum(-1).contiguous();  // D_i = Σ_d dO_id O_id
  auto dq = at::empty_like(call.q), dk = at::empty_like(call.k), dv = at::empty_like(call.v);
  auto g = call.stat(true);
  std::map<std::string, at::Tensor> key = {{"C", c},   {"R", r},       {"DO", grad}, {"DELTA", delta},
                                           {"DK", dk}, {"DV_OUT", dv}, {"G", g},     {"MASS", g}};
  std::map<std::string, at::Tensor> query = {{"C", c}, {"R", r}, {"DO", grad}, {"DELTA", delta}, {"G", g}, {"DQ", dq}};
  at::Tensor da;
  if (call.kl != 0) {
    const auto dkl = grad_part.defined() ? grad_part.to(at::kFloat).contiguous() : at::zeros({call.b(), call.h()}, call.stats());
    da = at::zeros({call.b(), call.h(), call.s_k()}, call.stats());
    for (auto* pass : {&key, &query}) pass->insert({{"RB", forward[3]}, {"KS", forward[4]}, {"DKL", dkl}, {"DA", da}});
  }
  call.launch("_key_pass", true, call.h_kv(), {{"GRADS", 1}}, with_masks(call, key));
  call.launch("_query_pass", false, call.h(), {}, with_masks(call, query));
  return {dq, dk, dv, da};
}

struct FusedAttention : torch::autograd::Function<FusedAttention> {
  // (output, the KL part T (B, H): zeros without a KL term), differentiable in q, k, v and the prior.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               std::optional<at::Tensor> kpad, std::optional<at::Tensor> prior, double scale, int64_t sweeps, bool causal,
                               int64_t noise, int64_t kl, double noise_scale, int64_t seed) {
    const Sampling sampling{noise, kl, noise_scale, static_cast<uint64_t>(seed)};
    const auto call = make_call(q, k, v, kpad.value_or(at::Tensor()), scale, sweeps, causal, sampling, prior.value_or(at::Tensor()));
    auto result = fused_forward(call);
    const auto part = kl != 0 ? result[5].sum(-1) : at::zeros({call.b(), call.h()}, call.stats());
    ctx->save_for_backward({call.q, call.k, call.v, result[0], result[1], result[2], result[3], result[4]});
    probattn::tiled::keep_optional(ctx, "kpad", call.kpad);
    probattn::tiled::keep_optional(ctx, "prior", prior.value_or(at::Tensor()));
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["sweeps"] = sweeps;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["noise"] = noise;
    ctx->saved_data["kl"] = kl;
    ctx->saved_data["noise_scale"] = noise_scale;
    ctx->saved_data["seed"] = seed;
    if (kl == 0) ctx->mark_non_differentiable({part});
    return {result[0], part};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto prior = probattn::tiled::kept_optional(ctx, "prior");
    const Sampling sampling{ctx->saved_data["noise"].toInt(), ctx->saved_data["kl"].toInt(), ctx->saved_data["noise_scale"].toDouble(),
                            static_cast<uint64_t>(ctx->saved_data["seed"].toInt())};
    const auto call = make_call(saved[0], saved[1], saved[2], probattn::tiled::kept_optional(ctx, "kpad"),
                                ctx->saved_data["scale"].toDouble(), ctx->saved_data["sweeps"].toInt(),
                                ctx->saved_data["causal"].toBool(), sampling, prior);
    const std::vector<at::Tensor> forward = {saved[3], saved[4], saved[5], saved[6], saved[7]};
    auto d = fused_backward(call, forward, grads[0], sampling.kl != 0 ? grads[1] : at::Tensor());
    at::Tensor dprior;
    if (prior.defined() && d[3].defined()) dprior = d[3].unsqueeze(2).sum_to_size(prior.sizes()).to(prior.scalar_type());
    variable_list out(12);  // one per input of forward: q, k, v, kpad, prior, then the settings
    out[0] = d[0];
    out[1] = d[1];
    out[2] = d[2];
    out[4] = dprior;
    return out;
  }
};

}  // namespace

extern "C" {

char* pa_fused_register(const char* kernel, int32_t arch, const char* dtype, int64_t head_dim, const char* key, const char* params,
                        uint32_t num_warps, uint32_t shared_bytes, int64_t block_m, int64_t block_n, const char* symbol,
                        const uint8_t* cubin, size_t cubin_len) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{kernel, "kernel"}, {dtype, "dtype"}, {key, "key"},
                                 {params, "params"}, {symbol, "symbol"}, {cubin, "cubin"}}) {
      probattn::require(pointer, "pa_fused_register", name);
    }
    TORCH_CHECK(cubin_len > 4, "pa_fused_register: an empty cubin for ", kernel);
    Entry e;
    e.kernel = kernel;
    e.arch = arch;
    e.dtype = dtype_named(dtype);
    e.head_dim = head_dim;
    for (const auto& [n, value] : pairs(key, '=')) e.key[n] = std::stoll(value);
    e.params = pairs(params, ':');
    e.num_warps = num_warps;
    e.shared = shared_bytes;
    e.block_m = block_m;
    e.block_n = block_n;
    e.symbol = symbol;
    e.image = cubin;  // the embedded bytes live as long as the program
    std::lock_guard<std::mutex> hold(registry().lock);
    registry().entries.push_back(std::move(e));
  });
}

char* pa_fused_cuda_status(int64_t device_index, int32_t* arch, char** why) {
  return probattn::guard([&] {
    probattn::require(arch, "pa_fused_cuda_status", "arch");
    probattn::require(why, "pa_fused_cuda_status", "why");
    *arch = 0;
    *why = nullptr;
    const auto& d = driver();
    if (!d.missing.empty()) {
      *why = probattn::copy_string(d.missing);
      return;
    }
    CUdevice device = 0;
    d.check(d.device_get(&device, static_cast<int>(device_index)), "cuDeviceGet");
    *arch = compute_capability(d, device);
  });
}

char* pa_fused_cuda_dry_run(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* key_padding,
                            const pa_tensor* prior, double scale, int64_t sweeps, int32_t causal, int32_t noise, int32_t kl,
                            double noise_scale, uint64_t seed, int32_t arch, char** json) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {json, "json"}}) {
      probattn::require(pointer, "pa_fused_cuda_dry_run", name);
    }
    TORCH_CHECK(arch > 0, "pa_fused_cuda_dry_run: a compute capability, such as 90, got ", arch);
    const probattn::tiled::NoAutocast no_autocast;
    const at::NoGradGuard no_grad;
    const Sampling sampling{noise, kl, noise_scale, seed};
    auto call = make_call(*q, *k, *v, key_padding != nullptr ? *key_padding : at::Tensor(), scale, sweeps, causal != 0, sampling,
                          prior != nullptr ? *prior : at::Tensor(), arch);
    std::vector<std::string> launches;
    call.dry = &launches;
    const auto forward = fused_forward(call);
    fused_backward(call, forward, at::ones_like(forward[0]), kl != 0 ? at::ones({call.b(), call.h()}, call.stats()) : at::Tensor());
    std::string text = "[";
    for (size_t i = 0; i < launches.size(); ++i) text += (i > 0 ? ",\n " : "") + launches[i];
    *json = probattn::copy_string(text + "]");
  });
}

char* pa_fused_cuda_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* key_padding,
                              const pa_tensor* prior, double scale, int64_t sweeps, int32_t causal, int32_t noise, int32_t kl,
                              double noise_scale, uint64_t seed, pa_tensor** out, pa_tensor** kl_part) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {kl_part, "kl_part"}}) {
      probattn::require(pointer, "pa_fused_cuda_attention", name);
    }
    const probattn::tiled::NoAutocast no_autocast;
    auto some = [](const pa_tensor* t) { return t != nullptr ? std::optional<at::Tensor>(*t) : std::nullopt; };
    auto result = FusedAttention::apply(*q, *k, *v, some(key_padding), some(prior), scale, sweeps, causal != 0, int64_t{noise}, int64_t{kl},
                                        noise_scale, static_cast<int64_t>(seed));
    // Both handles exist before either is handed out: an allocation that fails leaks none.
    auto o = std::make_unique<at::Tensor>(result[0]);
    auto p = std::make_unique<at::Tensor>(result[1]);
    *out = o.release();
    *kl_part = p.release();
  });
}

}  // extern "C"
