// The fused CUDA route's launcher (csrc/fused_launch.cpp): the CUDA driver opened at run time, the
// embedded kernels as the Rust side registers them, and one kernel launch on libtorch's current
// stream with its parameters filled by name. csrc/fused_cuda.cpp decides what to launch.
// Internal to the C++ layer: the Rust side sees csrc/probattn.h only.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace probattn::fused {

// Why the CUDA driver cannot be used on this machine ("" when it can).
const std::string& driver_missing();

// The compute capability of CUDA device `index` (90 for sm_90); the device's primary context is
// made current on this thread. Throws, naming the driver's error, when the driver cannot say.
int device_capability(int64_t index);
// The shared memory one block may opt into on CUDA device `index`, in bytes.
int device_shared_optin(int64_t index);

// One embedded kernel, handed over by the Rust side (probattn-kernels' manifest): `key` "A=1,B=0"
// the constexprs it was specialized on, `params` "x:*bf16,y:i32" its run-time parameters in
// launch order; `image` the cubin, which must outlive the program.
void register_kernel(const char* kernel, int arch, const char* dtype, int64_t head_dim, const char* key, const char* params,
                     unsigned num_warps, unsigned shared_bytes, int64_t block_m, int64_t block_n, const char* symbol,
                     const void* image);

// The embedded architecture and head dimension a call takes on compute capability `device_arch`
// for `dtype` and head dimensions up to `widest`: a cubin runs on its own architecture and on later
// minor versions of the same major one (sm_80's on sm_86 and sm_89), so the newest such, then the
// smallest head dimension that holds `widest`. {0, 0} when none fits.
std::pair<int, int64_t> choose(int device_arch, at::ScalarType dtype, int64_t widest);

// The query and key blocks (block_m, block_n) the embedded cubins of (arch, dtype, head_dim) that
// read a block map (HAS_MASK) were compiled with, one setting for all of them: what a block map of
// a boolean pattern is formed over. {0, 0} when none. (Other kernels may have settings of their
// own, from the tuning table; each launch's grid follows its own cubin's blocks.)
std::pair<int64_t, int64_t> blocks_of(int arch, at::ScalarType dtype, int64_t head_dim);

// One launch: the kernel `name` of (arch, dtype, head_dim) whose constexprs are `constexprs`, over
// a grid of (blocks of `length` by the kernel's block size along keys or queries, `programs`),
// its pointer parameters from `tensors` by name, its integers from `ints`. Pointers are to
// contiguous tensors, but for the masks read through strides given as integers (MASK, BLOCKS,
// BIAS: stride-0 views of what they broadcast).
struct Launch {
  std::string name;
  int arch = 0;
  at::ScalarType dtype = at::kBFloat16;
  int64_t head_dim = 0;
  std::map<std::string, int64_t> constexprs;
  std::map<std::string, at::Tensor> tensors;
  const std::map<std::string, int64_t>* ints = nullptr;
  bool keys = false;  // blocks of keys (block_n) or of queries (block_m)
  int64_t length = 0;
  int64_t programs = 0;
};

// Runs `l` on `device` (libtorch's current stream), or, with `dry`, appends its description as
// JSON there instead: {kernel, key, grid, ints, tensors}, as plans.py's `_launch_record` writes it.
// Pointer parameters for features the call does not use take a small tensor from `unused`.
void launch(const Launch& l, const at::Device& device, std::map<at::ScalarType, at::Tensor>& unused, std::vector<std::string>* dry);

}  // namespace probattn::fused
