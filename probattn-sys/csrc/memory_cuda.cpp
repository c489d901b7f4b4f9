// CUDA memory statistics: the caching allocator's device stats, the numbers behind
// torch.cuda.memory_allocated() / max_memory_allocated() / memory_reserved(). Reached through
// c10's device-generic allocator interface, so no CUDA header is needed to build this: on a
// machine without CUDA the calls fail with a message, at run time.

#include <ATen/Context.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "boundary.h"

namespace {

c10::DeviceIndex checked(int64_t device) {
  // Throws (caught at the boundary) when this libtorch has no CUDA at all.
  auto count = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount();
  if (device < 0 || device >= count) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(count) +
                             " CUDA device(s) visible)");
  }
  // The caching allocator is set up by CUDA's lazy initialization (the first CUDA tensor does it):
  // before that its statistics fail with "Invalid device argument". Asking first is fine.
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return static_cast<c10::DeviceIndex>(device);
}

}  // namespace

extern "C" {

char* pa_cuda_memory_stats(int64_t device, int64_t* allocated, int64_t* allocated_peak, int64_t* reserved, int64_t* reserved_peak) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{allocated, "allocated"}, {allocated_peak, "allocated_peak"},
                                 {reserved, "reserved"}, {reserved_peak, "reserved_peak"}}) {
      probattn::require(pointer, "pa_cuda_memory_stats", name);
    }
    auto index = checked(device);
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(index);
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = stats.allocated_bytes[all].current;
    *allocated_peak = stats.allocated_bytes[all].peak;
    *reserved = stats.reserved_bytes[all].current;
    *reserved_peak = stats.reserved_bytes[all].peak;
  });
}

char* pa_cuda_memory_reset_peak(int64_t device) {
  return probattn::guard([&] {
    auto index = checked(device);
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(index);
  });
}

}  // extern "C"
