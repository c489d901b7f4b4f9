// The boundary's own functions: strings and lists handed to Rust, and TorchScript buffers.

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include <new>

#include "boundary.h"

extern "C" {

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
