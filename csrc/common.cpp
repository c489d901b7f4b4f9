// The boundary's own functions: strings and lists handed to Rust, and TorchScript buffers.

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include <c10/util/Exception.h>

#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "boundary.h"

namespace {

// libtorch's warnings pass through this filter: those that start with a silenced prefix are
// dropped, every other one goes to the handler that was installed before (by default, stderr).
class SilencingHandler : public c10::WarningHandler {
 public:
  explicit SilencingHandler(c10::WarningHandler* next) : next_(next) {}

  void silence(std::string prefix) {
    std::lock_guard<std::mutex> lock(mutex_);
    prefixes_.push_back(std::move(prefix));
  }

  void process(const c10::Warning& warning) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& prefix : prefixes_) {
        if (warning.msg().rfind(prefix, 0) == 0) {
          return;
        }
      }
    }
    next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
  std::mutex mutex_;
  std::vector<std::string> prefixes_;
};

// Installed on first use and never freed: libtorch keeps the pointer for the process's life.
SilencingHandler* silencing_handler() {
  static SilencingHandler* handler = [] {
    auto* h = new SilencingHandler(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::set_warning_handler(h);
    return h;
  }();
  return handler;
}

}  // namespace

extern "C" {

char* pa_silence_warning(const char* prefix) {
  return probattn::guard([&] { silencing_handler()->silence(prefix); });
}

void pa_string_free(char* s) {
  std::free(s);
}

size_t pa_tensors_len(const pa_tensors* list) {
  return list->items.size();
}

const char* pa_tensors_name(const pa_tensors* list, size_t i) {
  return i < list->items.size() ? list->items[i].first.c_str() : nullptr;
}

pa_tensor* pa_tensors_get(const pa_tensors* list, size_t i) {
  return i < list->items.size() ? new (std::nothrow) at::Tensor(list->items[i].second) : nullptr;
}

void pa_tensors_free(pa_tensors* list) {
  delete list;
}

char* pa_jit_named_buffers(const char* path, pa_tensors** out) {
  return probattn::guard([&] {
    torch::jit::Module module = torch::jit::load(path, c10::Device(c10::kCPU));
    auto list = std::make_unique<pa_tensors>();
    for (const auto& buffer : module.named_buffers(/*recurse=*/true)) {
      list->items.emplace_back(buffer.name, buffer.value);
    }
    *out = list.release();
  });
}

}  // extern "C"
