// Data-parallel training through PyTorch's own c10d: a TCPStore for the rendezvous, Gloo (CPU)
// or NCCL (CUDA, when built with it) for the collectives, and DDP's gradient engine, the
// c10d::Reducer (buckets; each bucket all-reduced as soon as backward has filled it).
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#ifdef PROBATTN_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#ifdef PROBATTN_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "boundary.h"

struct pa_dist {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
  // Whether a backend takes CPU tensors (Gloo does; NCCL alone does not).
  bool cpu = false;
};

struct pa_reducer {
  std::unique_ptr<c10d::Reducer> reducer;
};

namespace {

std::vector<at::Tensor> borrow(const pa_tensor* const* tensors, size_t n) {
  std::vector<at::Tensor> out;
  if (n == 0) return out;
  probattn::require(tensors, "a collective", "tensors");
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    probattn::require(tensors[i], "a collective", "tensors[i]");
    out.push_back(*tensors[i]);
  }
  return out;
}

// Waits for a collective, under the group's timeout; a dead peer or a timeout arrives as an
// exception, which the boundary turns into a message.
void wait(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  TORCH_CHECK(work->wait(timeout), "the collective did not complete");
}

// The collectives of the training loop on CPU tensors (a length, a tokenizer's bytes) need a
// backend that takes them: said by name rather than as c10d's "No backend type associated".
void check_devices(const pa_dist* dist, const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK(dist->cpu || !t.device().is_cpu(),
                "a collective on a CPU tensor under NCCL alone: this build has no Gloo to carry CPU tensors beside NCCL "
                "(install Debian's libgloo-dev or set PROBATTN_GLOO_INCLUDE, then rebuild), or use --dist-backend gloo");
  }
}

#ifdef PROBATTN_GLOO
std::shared_ptr<::gloo::transport::Device> gloo_device() {
  // As torch.distributed: GLOO_SOCKET_IFNAME names the interface, else the host name's address
  // (loopback when it does not resolve).
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname != '\0') {
    std::string first(ifname);
    first = first.substr(0, first.find(','));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                                     std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(gloo_device());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, world_size,
                                                     options);
}
#endif

}  // namespace

extern "C" {

int32_t pa_dist_has_gloo(void) {
#ifdef PROBATTN_GLOO
  return 1;
#else
  return 0;
#endif
}

int32_t pa_dist_has_nccl(void) {
#ifdef PROBATTN_NCCL
  return 1;
#else
  return 0;
#endif
}

char* pa_dist_join(const char* backend, const char* host, int32_t port, int32_t is_server, const char* prefix, int32_t rank,
                   int32_t world_size, int64_t timeout_ms, pa_dist** out) {
  return probattn::guard([&] {
    probattn::require(backend, "pa_dist_join", "backend");
    probattn::require(host, "pa_dist_join", "host");
    probattn::require(prefix, "pa_dist_join", "prefix");
    probattn::require(out, "pa_dist_join", "out");
    TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rank ", rank, " is not in 0..", world_size);
    TORCH_CHECK(port > 0 && port < 65536, "port ", port, " is not a TCP port");
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(port);
    options.isServer = is_server != 0;
    options.numWorkers = std::nullopt;
    options.waitWorkers = false;
    options.timeout = timeout;
    auto dist = std::make_unique<pa_dist>();
    dist->timeout = timeout;
    c10::intrusive_ptr<c10d::Store> tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
    dist->store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    dist->group = c10::make_intrusive<c10d::ProcessGroup>(dist->store, rank, world_size);
    std::string name(backend);
    if (name == "gloo") {
#ifdef PROBATTN_GLOO
      auto gloo = make_gloo(dist->store, rank, world_size, timeout);
      dist->backend = gloo;
      dist->cpu = true;
      dist->group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      dist->group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
      dist->group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#else
      TORCH_CHECK(false,
                  "this build of probattn has no Gloo: its build found no gloo headers (install Debian's libgloo-dev, "
                  "or set PROBATTN_GLOO_INCLUDE, then rebuild)");
#endif
    } else if (name == "nccl") {
#ifdef PROBATTN_NCCL
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", dist->store), rank, world_size, nccl_options);
      dist->backend = nccl;
      dist->group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      dist->group->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#ifdef PROBATTN_GLOO
      // NCCL moves CUDA tensors only: CPU tensors go through Gloo on the same store, as
      // torch.distributed's "cpu:gloo,cuda:nccl" backend does.
      dist->group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                              make_gloo(dist->store, rank, world_size, timeout));
      dist->cpu = true;
#endif
#else
      TORCH_CHECK(false,
                  "this build of probattn has no NCCL: its build found no complete CUDA headers (run ./download_libtorch.sh, "
                  "which completes the wheel's, or set PROBATTN_CUDA_INCLUDE, then rebuild); --dist-backend gloo works on CUDA "
                  "tensors too");
#endif
    } else {
      TORCH_CHECK(false, "unknown backend '", name, "' (gloo or nccl)");
    }
    *out = dist.release();
  });
}

char* pa_dist_broadcast(pa_dist* dist, const pa_tensor* const* tensors, size_t n, int32_t root) {
  return probattn::guard([&] {
    probattn::require(dist, "pa_dist_broadcast", "dist");
    auto all = borrow(tensors, n);
    check_devices(dist, all);
    for (auto tensor : all) {
      std::vector<at::Tensor> one{tensor};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      options.timeout = dist->timeout;
      wait(dist->group->broadcast(one, options), dist->timeout);
    }
  });
}

char* pa_dist_all_reduce(pa_dist* dist, const pa_tensor* const* tensors, size_t n, int32_t op) {
  return probattn::guard([&] {
    probattn::require(dist, "pa_dist_all_reduce", "dist");
    c10d::AllreduceOptions options;
    options.timeout = dist->timeout;
    options.reduceOp = op == 1 ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    auto all = borrow(tensors, n);
    check_devices(dist, all);
    for (auto tensor : all) {
      std::vector<at::Tensor> one{tensor};
      wait(dist->group->allreduce(one, options), dist->timeout);
    }
  });
}

char* pa_dist_all_gather(pa_dist* dist, const pa_tensor* tensor, pa_tensors** out) {
  return probattn::guard([&] {
    probattn::require(dist, "pa_dist_all_gather", "dist");
    probattn::require(tensor, "pa_dist_all_gather", "tensor");
    probattn::require(out, "pa_dist_all_gather", "out");
    std::vector<at::Tensor> input{*tensor};
    check_devices(dist, input);
    std::vector<std::vector<at::Tensor>> output(1);
    for (int i = 0; i < dist->group->getSize(); ++i) output[0].push_back(at::empty_like(*tensor));
    c10d::AllgatherOptions options;
    options.timeout = dist->timeout;
    wait(dist->group->allgather(output, input, options), dist->timeout);
    auto list = std::make_unique<pa_tensors>();
    for (auto& t : output[0]) list->items.emplace_back("", t);
    *out = list.release();
  });
}

char* pa_dist_barrier(pa_dist* dist) {
  return probattn::guard([&] {
    probattn::require(dist, "pa_dist_barrier", "dist");
    c10d::BarrierOptions options;
    options.timeout = dist->timeout;
    wait(dist->group->barrier(options), dist->timeout);
  });
}

void pa_dist_free(pa_dist* dist) {
  probattn::guard_release([&] { delete dist; });
}

char* pa_reducer_new(pa_dist* dist, const pa_tensor* const* params, size_t n, int64_t bucket_bytes, int32_t find_unused,
                     pa_reducer** out) {
  return probattn::guard([&] {
    probattn::require(dist, "pa_reducer_new", "dist");
    probattn::require(out, "pa_reducer_new", "out");
    std::vector<at::Tensor> tensors = borrow(params, n);
    TORCH_CHECK(!tensors.empty(), "no parameters to synchronise");
    // As DistributedDataParallel: buckets in reverse parameter order (the order in which backward
    // produces the gradients), a small first bucket so the first all-reduce starts early.
    std::vector<int64_t> reversed(n);
    for (size_t i = 0; i < n; ++i) reversed[i] = static_cast<int64_t>(n - 1 - i);
    const int64_t first_bucket = 1024 * 1024;
    std::vector<size_t> limits{static_cast<size_t>(first_bucket), static_cast<size_t>(bucket_bytes)};
    auto [buckets, per_bucket_limits] =
        c10d::compute_bucket_assignment_by_size(tensors, limits, std::vector<bool>(n, false), reversed);
    std::reverse(buckets.begin(), buckets.end());
    std::vector<int64_t> caps(per_bucket_limits.rbegin(), per_bucket_limits.rend());
    std::unordered_map<size_t, std::string> names;
    auto reducer = std::make_unique<pa_reducer>();
    reducer->reducer = std::make_unique<c10d::Reducer>(tensors, buckets, dist->group, std::vector<bool>(n, false), bucket_bytes,
                                                       find_unused != 0, /*gradient_as_bucket_view=*/false, names, first_bucket,
                                                       /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false, caps);
    *out = reducer.release();
  });
}

char* pa_reducer_prepare(pa_reducer* reducer, const pa_tensor* const* outputs, size_t n) {
  return probattn::guard([&] {
    probattn::require(reducer, "pa_reducer_prepare", "reducer");
    // What DistributedDataParallel.forward does around the module's forward; rebuild_buckets
    // (a collective, once) regroups the buckets in the order the first backward produced them.
    reducer->reducer->rebuild_buckets();
    reducer->reducer->prepare_for_forward();
    reducer->reducer->prepare_for_backward(borrow(outputs, n));
  });
}

void pa_reducer_free(pa_reducer* reducer) {
  // ~Reducer may throw (noexcept(false)); nothing may cross into Rust.
  probattn::guard_release([&] { delete reducer; });
}

}  // extern "C"
