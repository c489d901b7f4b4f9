// The boundary's own functions: strings and lists handed to Rust, and TorchScript buffers.

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "boundary.h"

namespace {

// The silenced prefixes, shared by every thread.
std::mutex g_prefixes_mutex;
std::vector<std::string>& silenced_prefixes() {
  static auto* prefixes = new std::vector<std::string>();  // never freed: read by handlers until exit
  return *prefixes;
}

// libtorch's warnings pass through this filter: those that start with a silenced prefix are
// dropped, every other one goes to the handler that was installed before it on the same thread
// (by default, stderr). c10 keeps its warning handler per thread (a thread_local in
// c10/util/Exception.cpp), so the filter is installed on each thread that asks for it, in front
// of that thread's own handler; the prefixes are shared.
class SilencingHandler : public c10::WarningHandler {
 public:
  explicit SilencingHandler(c10::WarningHandler* next) : next_(next) {}

  void process(const c10::Warning& warning) override {
    {
      std::lock_guard<std::mutex> lock(g_prefixes_mutex);
      for (const auto& prefix : silenced_prefixes()) {
        if (warning.msg().rfind(prefix, 0) == 0) {
          return;
        }
      }
    }
    next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

// Installs the filter on the calling thread, once. Never freed: libtorch keeps the pointer in
// the thread's slot until the thread ends (a few bytes per thread that silenced a warning).
void install_on_this_thread() {
  thread_local SilencingHandler* handler = nullptr;
  if (handler == nullptr) {
    handler = new SilencingHandler(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::set_warning_handler(handler);
  }
}

}  // namespace

extern "C" {

char* pa_silence_warning(const char* prefix) {
  return probattn::guard([&] {
    probattn::require(prefix, "pa_silence_warning", "prefix");
    {
      std::lock_guard<std::mutex> lock(g_prefixes_mutex);
      silenced_prefixes().emplace_back(prefix);
    }
    install_on_this_thread();
  });
}

char* pa_cpu_rng_state(pa_tensor** out) {
  return probattn::guard([&] {
    probattn::require(out, "pa_cpu_rng_state", "out");
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    *out = new at::Tensor(generator.get_state());
  });
}

char* pa_set_cpu_rng_state(const pa_tensor* state) {
  return probattn::guard([&] {
    probattn::require(state, "pa_set_cpu_rng_state", "state");
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(*state);
  });
}

void pa_string_free(char* s) {
  if (s != probattn::kNoMemoryForMessage) std::free(s);
}

size_t pa_tensors_len(const pa_tensors* list) {
  return list != nullptr ? list->items.size() : 0;
}

const char* pa_tensors_name(const pa_tensors* list, size_t i) {
  return list != nullptr && i < list->items.size() ? list->items[i].first.c_str() : nullptr;
}

pa_tensor* pa_tensors_get(const pa_tensors* list, size_t i) {
  if (list == nullptr || i >= list->items.size()) return nullptr;
  return new (std::nothrow) at::Tensor(list->items[i].second);
}

void pa_tensors_free(pa_tensors* list) {
  probattn::guard_release([&] { delete list; });
}

char* pa_jit_named_buffers(const char* path, pa_tensors** out) {
  return probattn::guard([&] {
    probattn::require(path, "pa_jit_named_buffers", "path");
    probattn::require(out, "pa_jit_named_buffers", "out");
    torch::jit::Module module = torch::jit::load(path, c10::Device(c10::kCPU));
    auto list = std::make_unique<pa_tensors>();
    for (const auto& buffer : module.named_buffers(/*recurse=*/true)) {
      list->items.emplace_back(buffer.name, buffer.value);
    }
    *out = list.release();
  });
}

}  // extern "C"
