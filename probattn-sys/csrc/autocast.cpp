// Mixed precision: libtorch's autocast state for one device type on the calling thread (autocast
// is thread-local, as in PyTorch). tch's C API reaches only CUDA's on/off switch; the CPU's, the
// lower-precision dtype, the nesting count and the cast cache are here; so is the process-wide
// switch that lets float32 matrix products run in TF32 on CUDA.

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

#include "guard.h"
#include "probattn.h"

namespace {

at::DeviceType device_type(int32_t cuda) { return cuda != 0 ? at::kCUDA : at::kCPU; }

at::ScalarType lower_dtype(int32_t dtype) {
  switch (dtype) {
    case PA_AUTOCAST_BF16:
      return at::kBFloat16;
    case PA_AUTOCAST_F16:
      return at::kHalf;
    default:
      TORCH_CHECK(false, "unknown autocast dtype code ", dtype);
  }
}

int32_t dtype_code(at::ScalarType t) { return t == at::kHalf ? PA_AUTOCAST_F16 : PA_AUTOCAST_BF16; }

}  // namespace

extern "C" {

char* pa_autocast_enter(int32_t cuda, int32_t dtype, pa_autocast_state* previous) {
  return probattn::guard([&] {
    probattn::require(previous, "pa_autocast_enter", "previous");
    const auto type = device_type(cuda);
    const auto lower = lower_dtype(dtype);
    previous->enabled = at::autocast::is_autocast_enabled(type) ? 1 : 0;
    previous->dtype = dtype_code(at::autocast::get_autocast_dtype(type));
    at::autocast::set_autocast_dtype(type, lower);
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::increment_nesting();
  });
}

char* pa_autocast_exit(int32_t cuda, const pa_autocast_state* previous) {
  return probattn::guard([&] {
    probattn::require(previous, "pa_autocast_exit", "previous");
    const auto type = device_type(cuda);
    // The outermost region drops the cached lower-precision copies of the weights, as
    // torch.autocast does on exit: the next step's weights are new values.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type, previous->enabled != 0);
    at::autocast::set_autocast_dtype(type, lower_dtype(previous->dtype));
  });
}

char* pa_autocast_set_enabled(int32_t cuda, int32_t enabled) {
  return probattn::guard([&] { at::autocast::set_autocast_enabled(device_type(cuda), enabled != 0); });
}

char* pa_autocast_state_of(int32_t cuda, pa_autocast_state* state) {
  return probattn::guard([&] {
    probattn::require(state, "pa_autocast_state_of", "state");
    const auto type = device_type(cuda);
    state->enabled = at::autocast::is_autocast_enabled(type) ? 1 : 0;
    state->dtype = dtype_code(at::autocast::get_autocast_dtype(type));
  });
}

char* pa_allow_tf32(int32_t allow, int32_t* previous) {
  return probattn::guard([&] {
    probattn::require(previous, "pa_allow_tf32", "previous");
    TORCH_CHECK(allow >= -1 && allow <= 1, "pa_allow_tf32: -1 (ask), 0 or 1, got ", allow);
    auto& context = at::globalContext();
    *previous = context.allowTF32CuBLAS() ? 1 : 0;
    if (allow >= 0) context.setAllowTF32CuBLAS(allow != 0);
  });
}

char* pa_deterministic_algorithms(int32_t set, int32_t* previous) {
  return probattn::guard([&] {
    probattn::require(previous, "pa_deterministic_algorithms", "previous");
    TORCH_CHECK(set >= -1 && set <= 1, "pa_deterministic_algorithms: -1 (ask), 0 or 1, got ", set);
    auto& context = at::globalContext();
    *previous = context.deterministicAlgorithms() ? 1 : 0;
    if (set >= 0) context.setDeterministicAlgorithms(set != 0, context.deterministicAlgorithmsWarnOnly());
  });
}

}  // extern "C"
