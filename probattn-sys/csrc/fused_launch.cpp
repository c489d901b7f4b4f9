// The fused CUDA route's launcher (csrc/fused_launch.h): the CUDA driver, opened at run time and
// never linked, so that a machine without a GPU builds and runs as before and a call here says
// what is missing; the embedded cubins, each loaded into a context once; and one launch, its
// parameters filled by name from the manifest's list, in its order, and checked against their
// declared types, so a kernel whose signature changes fails here by name instead of reading the
// wrong bytes.

#include "fused_launch.h"

#include <dlfcn.h>

#include <cstdint>

#include <mutex>
#include <set>
#include <tuple>

#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "boundary.h"
#include "probattn.h"

namespace probattn::fused {
namespace {

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
  // The multiple each parameter was compiled to assume (1: none): 16 for aot.ALIGNED's, the
  // integers' values and the pointers' addresses in bytes.
  std::map<std::string, int64_t> divisible;
  unsigned num_warps = 4, shared = 0;
  int64_t block_m = 64, block_n = 64;
  std::string symbol;
  const void* image = nullptr;
};

struct Registry {
  std::mutex lock;
  std::vector<Entry> entries;
  std::map<std::pair<size_t, CUcontext>, CUfunction> loaded;  // (entry, context) → function
  // (kernel, arch, dtype, head dimension, a launch's constexprs) → entry, as `find` found it.
  std::map<std::tuple<std::string, int, int, int64_t, std::map<std::string, int64_t>>, size_t> found;
};

Registry& registry() {
  static Registry r;
  return r;
}

at::ScalarType dtype_named(const std::string& name) {
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float32") return at::kFloat;
  TORCH_CHECK(false, "the fused CUDA route: an embedded kernel's dtype is ", name, ", not bfloat16, float16 or float32");
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
  // Every launch asks: the search over the entries runs once per kind of launch.
  auto key = std::make_tuple(name, arch, static_cast<int>(dtype), head_dim, constexprs);
  if (const auto it = r.found.find(key); it != r.found.end()) {
    *index = it->second;
    return r.entries[it->second];
  }
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
      r.found.emplace(std::move(key), i);
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
// BAM's draws and KL term, BAM's mixture over HNAS, HNAS's shares of dO, DNAS's queries' column
// mean without a backward): a two-element tensor of the declared type.
const std::set<std::string> kUnused = {"QPAD", "KPAD", "MASK", "BLOCKS", "BIAS",  "DRAWS", "PRIOR", "RB",    "KS", "TROW",
                                       "DKL",  "DA",   "RD",   "RS",     "LOGU", "RHO_D", "RHO_S", "GU", "SHARES", "QBAR"};
// The masks a kernel reads through strides of its own (stride-0 views of what they broadcast).
const std::set<std::string> kStrided = {"MASK", "BLOCKS", "BIAS"};

// Whether a launch may leave out the tensor `pname`: one of kUnused, or the key pass's DQ where
// its specialization adds nothing to it (ATOMIC_DQ 0).
bool may_leave_out(const Launch& l, const std::string& pname) {
  if (kUnused.count(pname) > 0) return true;
  const auto atomic = l.constexprs.find("ATOMIC_DQ");
  return pname == "DQ" && l.name == "_key_pass" && atomic != l.constexprs.end() && atomic->second == 0;
}

}  // namespace

const std::string& driver_missing() { return driver().missing; }

int device_capability(int64_t index) {
  const auto& d = working_driver();
  CUdevice device = 0;
  d.check(d.device_get(&device, static_cast<int>(index)), "cuDeviceGet");
  return compute_capability(d, device);
}

int device_shared_optin(int64_t index) {
  const auto& d = working_driver();
  CUdevice device = 0;
  d.check(d.device_get(&device, static_cast<int>(index)), "cuDeviceGet");
  int optin = 0;
  d.check(d.device_get_attribute(&optin, kSharedOptin, device), "cuDeviceGetAttribute(shared memory)");
  return optin;
}

void register_kernel(const char* kernel, int arch, const char* dtype, int64_t head_dim, const char* key, const char* params,
                     unsigned num_warps, unsigned shared_bytes, int64_t block_m, int64_t block_n, const char* symbol,
                     const void* image) {
  Entry e;
  e.kernel = kernel;
  e.arch = arch;
  e.dtype = dtype_named(dtype);
  e.head_dim = head_dim;
  for (const auto& [n, value] : pairs(key, '=')) e.key[n] = std::stoll(value);
  // "name:type" or "name:type/16" (compiled assuming a multiple of 16).
  for (auto [n, type] : pairs(params, ':')) {
    const auto slash = type.find('/');
    if (slash != std::string::npos) {
      e.divisible[n] = std::stoll(type.substr(slash + 1));
      type = type.substr(0, slash);
    }
    e.params.emplace_back(n, type);
  }
  e.num_warps = num_warps;
  e.shared = shared_bytes;
  e.block_m = block_m;
  e.block_n = block_n;
  e.symbol = symbol;
  e.image = image;
  std::lock_guard<std::mutex> hold(registry().lock);
  registry().entries.push_back(std::move(e));
}

std::pair<int, int64_t> choose(int device_arch, at::ScalarType dtype, int64_t widest) {
  std::lock_guard<std::mutex> hold(registry().lock);
  int arch = 0;
  int64_t head_dim = 0;
  for (const auto& e : registry().entries) {
    if (e.arch / 10 == device_arch / 10 && e.arch <= device_arch && e.arch > arch) arch = e.arch;
  }
  for (const auto& e : registry().entries) {
    if (e.arch == arch && e.dtype == dtype && e.head_dim >= widest && (head_dim == 0 || e.head_dim < head_dim)) head_dim = e.head_dim;
  }
  return {arch, head_dim};
}

std::pair<int64_t, int64_t> blocks_of(int arch, at::ScalarType dtype, int64_t head_dim) {
  std::lock_guard<std::mutex> hold(registry().lock);
  // The kernels that read a block map (HAS_MASK) share one setting; the others may have their own.
  for (const auto& e : registry().entries) {
    const auto masked = e.key.find("HAS_MASK");
    if (e.arch == arch && e.dtype == dtype && e.head_dim == head_dim && masked != e.key.end() && masked->second != 0) {
      return {e.block_m, e.block_n};
    }
  }
  return {0, 0};
}

void launch(const Launch& l, const at::Device& device, std::map<at::ScalarType, at::Tensor>& unused, std::vector<std::string>* dry) {
  const auto& name = l.name;
  std::lock_guard<std::mutex> hold(registry().lock);
  size_t index = 0;
  const auto& e = find(name, l.arch, l.dtype, l.head_dim, l.constexprs, &index);
  std::string ints_json, tensors_json;
  // The per-key statistics' rows hold whole blocks of keys (stride_ch, a multiple of
  // fused_cuda.cpp's kKeyBlock), which the passes that loop over key blocks read a block at a
  // time without a bound: a wider key block would read past a row.
  if (const auto row = l.ints->find("stride_ch"); row != l.ints->end()) {
    TORCH_CHECK(e.block_n > 0 && row->second % e.block_n == 0, "the fused CUDA route: ", name, " is compiled for key blocks of ",
                e.block_n, ", which do not divide the per-key statistics' rows of ", row->second, " entries");
  }

  std::vector<CUdeviceptr> pointers;
  std::vector<int32_t> integers;
  pointers.reserve(e.params.size() + 2);
  integers.reserve(e.params.size());
  std::vector<void*> args;
  for (const auto& [pname, type] : e.params) {
    if (type == "i32") {
      const auto it = l.ints->find(pname);
      TORCH_CHECK(it != l.ints->end(), "the fused CUDA route: ", name, " takes the integer ", pname, ", which the launcher does not set");
      TORCH_CHECK(it->second >= INT32_MIN && it->second <= INT32_MAX, "the fused CUDA route: ", pname, " = ", it->second,
                  " does not fit the kernels' 32-bit integers");
      if (const auto div = e.divisible.find(pname); div != e.divisible.end()) {
        TORCH_CHECK(it->second % div->second == 0, "the fused CUDA route: ", name, " is compiled for a ", pname, " that is a multiple of ",
                    div->second, ", got ", it->second);
      }
      integers.push_back(static_cast<int32_t>(it->second));
      args.push_back(&integers.back());
      if (dry != nullptr) ints_json += (ints_json.empty() ? "\"" : ", \"") + pname + "\": " + std::to_string(it->second);
      continue;
    }
    const auto want = declared_type(type);
    at::Tensor t;
    if (const auto it = l.tensors.find(pname); it != l.tensors.end()) {
      t = it->second;
      if (dry != nullptr) {
        std::string shape;
        for (const auto n : t.sizes()) shape += (shape.empty() ? "" : ", ") + std::to_string(n);
        tensors_json += (tensors_json.empty() ? "\"" : ", \"") + pname + "\": [[" + shape + "], \"" + dtype_name(t.scalar_type()) + "\"]";
      }
    } else {
      TORCH_CHECK(may_leave_out(l, pname), "the fused CUDA route: ", name, " takes the tensor ", pname,
                  ", which the launcher does not pass");
      auto& slot = unused[want];
      if (!slot.defined()) slot = at::zeros({2}, at::TensorOptions().device(device).dtype(want));
      t = slot;
    }
    const bool strided = kStrided.count(pname) > 0;  // read through strides the launch passes
    TORCH_CHECK(t.scalar_type() == want && t.device() == device && (strided || t.is_contiguous()), "the fused CUDA route: ", name, "'s ",
                pname, " must be a ", strided ? "" : "contiguous ", c10::toString(want), " tensor on ", device, ", got ",
                c10::toString(t.scalar_type()), " on ", t.device());
    if (const auto div = e.divisible.find(pname); div != e.divisible.end()) {
      TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % div->second == 0, "the fused CUDA route: ", name,
                  " is compiled for a ", pname, " aligned to ", div->second, " bytes, got ", t.data_ptr());
    }
    pointers.push_back(dry != nullptr ? 0 : reinterpret_cast<CUdeviceptr>(t.data_ptr()));
    args.push_back(&pointers.back());
  }
  // Triton 3.6 appends two scratch pointers (global and profile); the embedded kernels need neither.
  pointers.push_back(0);
  args.push_back(&pointers.back());
  pointers.push_back(0);
  args.push_back(&pointers.back());

  const int64_t block = l.keys ? e.block_n : e.block_m;
  const int64_t blocks = (l.length + block - 1) / block;
  const int64_t programs = l.programs;
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
  const c10::DeviceGuard device_guard(device);
  const CUdevice cu_device = current_context(d, device.index());
  const CUfunction f = function_of(d, index, cu_device);
  const auto stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  d.check(d.launch_kernel(f, static_cast<unsigned>(blocks), static_cast<unsigned>(programs), 1, 32 * e.num_warps, 1, 1, e.shared,
                          static_cast<CUstream>(stream.native_handle()), args.data(), nullptr),
          "launching " + name);
}

}  // namespace probattn::fused

// The registration of the embedded kernels and the driver's status, for the Rust side
// (csrc/probattn.h).
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
    // the embedded bytes live as long as the program
    probattn::fused::register_kernel(kernel, arch, dtype, head_dim, key, params, num_warps, shared_bytes, block_m, block_n, symbol,
                                     cubin);
  });
}

char* pa_fused_cuda_status(int64_t device_index, int32_t* arch, int32_t* shared_optin, char** why) {
  return probattn::guard([&] {
    probattn::require(arch, "pa_fused_cuda_status", "arch");
    probattn::require(shared_optin, "pa_fused_cuda_status", "shared_optin");
    probattn::require(why, "pa_fused_cuda_status", "why");
    *arch = 0;
    *shared_optin = 0;
    *why = nullptr;
    if (const auto& missing = probattn::fused::driver_missing(); !missing.empty()) {
      *why = probattn::copy_string(missing);
      return;
    }
    *arch = probattn::fused::device_capability(device_index);
    *shared_optin = probattn::fused::device_shared_optin(device_index);
  });
}

}  // extern "C"
