// What every translation unit of the C++ layer shares: the exception boundary (guard.h) and the
// list type.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "guard.h"
#include "probattn.h"

struct pa_tensors {
  std::vector<std::pair<std::string, at::Tensor>> items;
};
