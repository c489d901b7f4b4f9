// Memory statistics libtorch keeps and tch does not expose.
//
// CPU: libtorch keeps no byte counts for CPU tensors, so this installs an allocator of its own in
// c10's CPU slot: the default allocator's own calls (c10::alloc_cpu / free_cpu, 64-byte aligned)
// with the size written in a 64-byte header before each block, counted on allocation and on
// free. It counts exactly the bytes held by tensor storages allocated after it was installed
// (oneDNN's scratch space and glibc's own caches are not tensors, and not counted). The same
// file is also built as a shared library (libprobattn_memory.so) that Python loads with ctypes,
// so PyTorch's side of `probattn bench` is measured by the same counter.

#include <atomic>
#include <cstring>
#include <mutex>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include "guard.h"
#include "probattn.h"

namespace {

constexpr size_t kHeader = 64;  // c10's CPU alignment: the data stays 64-byte aligned

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};
std::mutex g_install;

void count(int64_t delta) {
  int64_t now = g_current.fetch_add(delta) + delta;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void release(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  count(-static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
  c10::free_cpu(base);
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &release, cpu};
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    count(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &release, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator g_allocator;

}  // namespace

extern "C" {

char* pa_cpu_memory_track(void) {
  return probattn::guard([] {
    std::lock_guard<std::mutex> lock(g_install);
    if (!g_installed.load()) {
      // Above the default allocator's priority (0), so it takes the slot.
      c10::SetAllocator(c10::DeviceType::CPU, &g_allocator, /*priority=*/100);
      g_installed = true;
    }
  });
}

char* pa_cpu_memory_stats(int64_t* current, int64_t* peak, int64_t* tracking) {
  return probattn::guard([&] {
    for (auto [pointer, name] : {std::pair<const void*, const char*>{current, "current"}, {peak, "peak"}, {tracking, "tracking"}}) {
      probattn::require(pointer, "pa_cpu_memory_stats", name);
    }
    *current = g_current.load();
    *peak = g_peak.load();
    *tracking = g_installed.load() && c10::GetCPUAllocator() == &g_allocator;
  });
}

char* pa_cpu_memory_reset_peak(void) {
  g_peak.store(g_current.load());
  return nullptr;
}

}  // extern "C"
