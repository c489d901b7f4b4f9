// AOTInductor packages (`torch._inductor.aoti_compile_and_package(torch.export.export(m, args))`):
// libtorch's own loader, torch::inductor::AOTIModelPackageLoader, behind the C boundary.

#include <cstdlib>
#include <memory>
#include <sstream>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "boundary.h"

struct pa_pt2 {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
};

namespace {

std::string json_string(const std::string& s) {
  std::ostringstream out;
  out << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out << buf;
    } else {
      out << c;
    }
  }
  out << '"';
  return out.str();
}

}  // namespace

extern "C" {

char* pa_pt2_metadata(const char* path, const char* model_name, char** json) {
  return probattn::guard([&] {
    probattn::require(path, "pa_pt2_metadata", "path");
    probattn::require(model_name, "pa_pt2_metadata", "model_name");
    probattn::require(json, "pa_pt2_metadata", "json");
    auto metadata = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, model_name);
    std::ostringstream out;
    out << '{';
    bool first = true;
    for (const auto& [key, value] : metadata) {
      out << (first ? "" : ",") << json_string(key) << ':' << json_string(value);
      first = false;
    }
    out << '}';
    *json = probattn::copy_string(out.str());
  });
}

char* pa_pt2_load(const char* path, const char* model_name, int64_t device_index, pa_pt2** out) {
  return probattn::guard([&] {
    probattn::require(path, "pa_pt2_load", "path");
    probattn::require(model_name, "pa_pt2_load", "model_name");
    probattn::require(out, "pa_pt2_load", "out");
    // The compiled model checks each input's dtype, sizes, strides and device against the
    // exported program only when this is set (read once, at its first call); without the check a
    // wrong input is read out of bounds. A user's explicit setting is kept.
    setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", /*overwrite=*/0);
    auto package = std::make_unique<pa_pt2>();
    package->loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        path, model_name, /*run_single_threaded=*/false, /*num_runners=*/1,
        static_cast<c10::DeviceIndex>(device_index));
    *out = package.release();
  });
}

char* pa_pt2_run(pa_pt2* package, const pa_tensor* const* inputs, size_t n, pa_tensors** outputs) {
  return probattn::guard([&] {
    probattn::require(package, "pa_pt2_run", "package");
    probattn::require(outputs, "pa_pt2_run", "outputs");
    if (n > 0) probattn::require(inputs, "pa_pt2_run", "inputs");
    std::vector<at::Tensor> xs;
    xs.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      probattn::require(inputs[i], "pa_pt2_run", "inputs[i]");
      xs.push_back(*inputs[i]);
    }
    auto ys = package->loader->run(xs);
    auto list = std::make_unique<pa_tensors>();
    for (auto& y : ys) list->items.emplace_back("", std::move(y));
    *outputs = list.release();
  });
}

char* pa_pt2_constants(pa_pt2* package, pa_tensors** out) {
  return probattn::guard([&] {
    probattn::require(package, "pa_pt2_constants", "package");
    probattn::require(out, "pa_pt2_constants", "out");
    auto* runner = package->loader->get_runner();
    auto fqns = runner->getConstantNamesToOriginalFQNs();
    auto list = std::make_unique<pa_tensors>();
    for (const auto& [name, tensor] : runner->extract_constants_map(/*use_inactive=*/false)) {
      auto fqn = fqns.find(name);
      list->items.emplace_back(fqn == fqns.end() || fqn->second.empty() ? name : fqn->second, tensor);
    }
    *out = list.release();
  });
}

void pa_pt2_free(pa_pt2* package) {
  probattn::guard_release([&] { delete package; });
}

}  // extern "C"
