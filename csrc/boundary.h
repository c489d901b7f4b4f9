// What every translation unit of the C++ layer shares: the exception boundary and the list type.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "probattn.h"

struct pa_tensors {
  std::vector<std::pair<std::string, at::Tensor>> items;
};

namespace probattn {

inline char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// Runs `body`; returns NULL, or the exception's message (libtorch's without its C++ backtrace).
template <typename F>
char* guard(F&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return copy_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return copy_string(e.what());
  } catch (...) {
    return copy_string("an unknown C++ exception");
  }
}

}  // namespace probattn
