// probattn's C++ layer: what libtorch's C++ API has and tch's C API does not reach.
//
// Every function is `extern "C"` and catches every C++ exception (csrc/guard.h): those returning
// `char*` return NULL on success and an error message on failure, never NULL then (free it with
// pa_string_free); the `_free` functions swallow what a destructor throws. Nothing thrown inside
// libtorch crosses into Rust, where unwinding through a foreign frame would abort the process.
// A NULL where a function needs a pointer is an error naming the argument, not a crash.
// Tensors are tch's `C_tensor`, i.e. `at::Tensor*`: inputs are borrowed, every `at::Tensor*`
// handed out is new and owned by the caller (tch's `Tensor::from_ptr` takes it).
// The only callers are in probattn-sys/src/: every `unsafe` block that crosses into this layer is there.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
namespace at { class Tensor; }
typedef at::Tensor pa_tensor;
extern "C" {
#else
typedef struct pa_tensor pa_tensor;
#endif

typedef struct pa_tensors pa_tensors;  // a list of (name, tensor)
typedef struct pa_pt2 pa_pt2;          // a loaded AOTInductor package

void pa_string_free(char* s);

// Drops every later libtorch warning whose message starts with `prefix`, on the calling thread
// (c10's warning handler is per thread): a filter in front of the thread's handler, which still
// gets every other warning. The prefixes are shared: a thread that calls this with any prefix
// filters all of them.
char* pa_silence_warning(const char* prefix);

// The CPU's default generator (what torch.manual_seed seeds): its state as a new uint8 tensor
// (torch.get_rng_state), and setting a state back (torch.set_rng_state).
char* pa_cpu_rng_state(pa_tensor** out);
char* pa_set_cpu_rng_state(const pa_tensor* state);

// ---- lists of named tensors
size_t pa_tensors_len(const pa_tensors* list);
const char* pa_tensors_name(const pa_tensors* list, size_t i);  // borrowed, "" when unnamed
pa_tensor* pa_tensors_get(const pa_tensors* list, size_t i);    // new handle, owned by the caller; NULL out of range or memory
void pa_tensors_free(pa_tensors* list);

// ---- AOTInductor packages (.pt2)
// The package's metadata (AOTI_DEVICE_KEY, user metadata) as a JSON object, read without loading
// the compiled model.
char* pa_pt2_metadata(const char* path, const char* model_name, char** json);
// device_index: -1 for the CPU, else the CUDA device the package runs on.
char* pa_pt2_load(const char* path, const char* model_name, int64_t device_index, pa_pt2** out);
char* pa_pt2_run(pa_pt2* package, const pa_tensor* const* inputs, size_t n, pa_tensors** outputs);
// The package's weights and buffers by their original (state_dict) names.
char* pa_pt2_constants(pa_pt2* package, pa_tensors** out);
void pa_pt2_free(pa_pt2* package);

// ---- TorchScript
// torch::jit::Module::named_buffers() of the module saved at `path`, loaded on the CPU.
char* pa_jit_named_buffers(const char* path, pa_tensors** out);

// ---- mixed precision (autocast.cpp): libtorch's autocast on the calling thread
#define PA_AUTOCAST_BF16 1
#define PA_AUTOCAST_F16 2
typedef struct pa_autocast_state {
  int32_t enabled;  // 0 or 1
  int32_t dtype;    // PA_AUTOCAST_BF16 or PA_AUTOCAST_F16
} pa_autocast_state;
// cuda: 0 the CPU's autocast, 1 CUDA's. Enter turns it on in `dtype` and writes what was there
// before into `previous`; exit restores it (and clears the cast cache when the outermost region
// ends). Regions nest as torch.autocast's do.
char* pa_autocast_enter(int32_t cuda, int32_t dtype, pa_autocast_state* previous);
char* pa_autocast_exit(int32_t cuda, const pa_autocast_state* previous);
char* pa_autocast_state_of(int32_t cuda, pa_autocast_state* state);
// Switches autocast on or off without entering a region (no nesting, no cache): what a call
// that runs its own precision does around itself.
char* pa_autocast_set_enabled(int32_t cuda, int32_t enabled);
// libtorch's process-wide switch for TF32 in CUDA's float32 matrix products (PyTorch's
// torch.backends.cuda.matmul.allow_tf32): its value before into `previous`; then, for `allow` 0 or
// 1, set to it (-1 only asks). The fused CUDA route takes float32 only while it is on.
char* pa_allow_tf32(int32_t allow, int32_t* previous);

// ---- memory-efficient attention (tiled.cpp)
typedef struct pa_tiled_spec {
  int64_t tile;        // queries per tile, >= 1
  int64_t sweeps;      // column/row normalizations before the last row softmax: 0 softmax, 1 DNAS, N Sinkhorn-N
  int32_t noise;       // BAM sampling: 0 none, 1 Weibull ((1/k) log(-log(1 - eps)), eps ~ U(0, 1)), 2 Lognormal (sigma eps)
  double noise_scale;  // 1/k (Weibull) or sigma (Lognormal)
  uint64_t seed;       // the counter-based draws' key, when no noise tensor is given
  int32_t kl;          // the KL's score-dependent part: 0 none, 1 sum a_j log pi_ij, 2 sum (log pi_ij - a_j)^2
  int32_t fused_cpu;   // 1: softmax and DNAS without noise, and noise over a softmax base, take libtorch's fused CPU kernel
                       // where it applies (CPU, no mask or a per-key one); 0: always the tiles; 2: the fused kernel or an error
} pa_tiled_spec;
// The layout probattn-sys/src/lib.rs mirrors (`TiledSpec`, which asserts the same at compile time).
#ifdef __cplusplus
static_assert(sizeof(pa_tiled_spec) == 48, "pa_tiled_spec's size changed: update TiledSpec in probattn-sys/src/lib.rs");
static_assert(offsetof(pa_tiled_spec, tile) == 0 && offsetof(pa_tiled_spec, sweeps) == 8 && offsetof(pa_tiled_spec, noise) == 16 &&
                  offsetof(pa_tiled_spec, noise_scale) == 24 && offsetof(pa_tiled_spec, seed) == 32 &&
                  offsetof(pa_tiled_spec, kl) == 40 && offsetof(pa_tiled_spec, fused_cpu) == 44,
              "pa_tiled_spec's fields moved: update TiledSpec in probattn-sys/src/lib.rs");
#else
_Static_assert(sizeof(pa_tiled_spec) == 48, "pa_tiled_spec's size changed: update TiledSpec in probattn-sys/src/lib.rs");
#endif
// Attention of heads-first q (B, H, S_q, d), k (B, H_kv, S_k, d), v (B, H_kv, S_k, d_v), H_kv = H or
// a divisor of it (grouped-query attention: query head h reads key/value head h / (H / H_kv)),
// under `excluded` (bool, broadcastable to (B, H, S_q, S_k), true = excluded; NULL: none) and the
// additive mask `bias` (floating, in the statistics' dtype, rank 4, broadcastable to the scores,
// added to them; NULL: none), tiled over blocks of `spec->tile` queries, differentiable in q, k, v,
// `bias` and `prior`. `noise`: eps broadcastable to
// (B, H, S_q, S_k) (NULL: counter-based draws keyed by spec->seed); `prior`: a_j broadcastable to
// (B, H, 1, S_k) (NULL unless spec->kl); `hybrid_logit`: HNAS's gate logits (H,) with spec->sweeps 1,
// the base's weights then being u·DNAS's + (1 - u)·softmax's, u = sigmoid(logit), differentiable in
// them (NULL: no mix; the tiles only). Outputs: the attention output (B, H, S_q, d_v), the weight
// each key received (B, H, S_k), the KL's part per (b, h) (zeros without a KL term), and, when
// `route_taken` is not NULL, the route that ran: 0 the tiles, 1 the fused CPU kernel, 2 its BAM form
// (csrc/tiled.h's tiled_route, the one place that decides). With spec->fused_cpu 2 (required) and
// the tiles' route, nothing runs and out, received_mass and kl_part are left as they were.
char* pa_tiled_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* excluded, const pa_tensor* bias,
                         const pa_tensor* noise, const pa_tensor* prior, const pa_tensor* hybrid_logit, const pa_tiled_spec* spec,
                         pa_tensor** out, pa_tensor** received_mass, pa_tensor** kl_part, int32_t* route_taken);
// Softmax attention of bfloat16 or float16 q, k, v (B, H, S, d) computed in float32 (scores,
// weights, value mix), differentiable in q, k, v, keeping the inputs rather than float32 copies of
// them for the backward pass. `allowed`: bool, broadcastable to (B, H, S_q, S_k), true = taking
// part (NULL: every key); a query with no allowed key gets zeros. `scale` multiplies q·kᵀ. The
// output has v's dtype.
char* pa_widened_softmax(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* allowed, double scale,
                         pa_tensor** out);
// a · b (matmul's broadcasting) with a in bfloat16 or float16 widened to b's dtype, differentiable
// in a and b, keeping a rather than its widened copy for the backward pass. The output has b's
// dtype.
char* pa_widened_matmul(const pa_tensor* a, const pa_tensor* b, pa_tensor** out);
// The counter-based draws of the tiled path for a whole (B, H, S_q, S_k) = shape[0..4] score
// tensor, in the eager path's convention (eps ~ U(0, 1) for noise 1, N(0, 1) for noise 2), with
// the dtype and device of `like`, rows (queries) [start, start + len). `aten_ops`: computed with
// ATen's integer ops, as on CUDA, instead of the CPU's loop (the same bits; for tests).
char* pa_counter_noise(const pa_tensor* like, const int64_t* shape, int32_t noise, uint64_t seed, int64_t start, int64_t len,
                       int32_t aten_ops, pa_tensor** out);

// ---- the fused CUDA route (fused_cuda.cpp, fused_launch.cpp): the embedded Triton kernels through the CUDA driver API
// Registers one embedded cubin (probattn-kernels' manifest entry): its kernel's name, compute
// capability (90 for sm_90), dtype ("bfloat16", "float16", "float32"), head dimension, the
// constexprs it was specialized on ("SWEEPS=1,CAUSAL=0,..."), its parameters in launch order
// ("Q:*bf16,S_Q:i32,..."), warps, dynamic shared memory, blocks and symbol. `cubin` must outlive the process's launches
// (the embedded bytes do).
char* pa_fused_register(const char* kernel, int32_t arch, const char* dtype, int64_t head_dim, const char* key, const char* params,
                        uint32_t num_warps, uint32_t shared_bytes, int64_t block_m, int64_t block_n, const char* symbol,
                        const uint8_t* cubin, size_t cubin_len);
// Whether the driver can launch on CUDA device `device_index`: its compute capability in `arch`
// (e.g. 90) and the shared memory one block may opt into in `shared_optin` (bytes), or, when the
// driver library is missing or sees no GPU, both 0 and the reason in `why` (a new string; NULL
// when usable).
char* pa_fused_cuda_status(int64_t device_index, int32_t* arch, int32_t* shared_optin, char** why);
// What a fused call computes besides its inputs. Scores `scale`·q·kᵀ; `sweeps` 0 (softmax), 1
// (DNAS) or N ≥ 2 (Sinkhorn-N); `hybrid` (with one sweep): HNAS, u·DNAS + (1 − u)·softmax per
// head with the gate u = sigmoid(hybrid_logit); `causal`
// (softmax only, top-left). BAM's sampling over the plan when `noise` is 1 (Weibull) or 2
// (Lognormal): the counter-based draws keyed by `seed`, the noise term's scale `noise_scale` (1/k
// or sigma), and with `kl` (equal to `noise`; 0: none) the KL term's score-dependent part against
// the prior. `mass`: also the received mass Σ_i p_ij, one key pass per branch after the forward
// (deterministic plans only).
typedef struct {
  double scale;
  int64_t sweeps;
  int32_t hybrid, causal, noise, kl, mass;
  double noise_scale;
  uint64_t seed;
} pa_fused_spec;
// Attention of bfloat16, float16 or float32 (this one while TF32 is allowed: pa_allow_tf32)
// q (B, H, S_q, d), k (B, H_kv, S_k, d), v (B, H_kv, S_k, d_v) on one CUDA device by the embedded
// kernels, as `spec` says; `key_padding` bool (B, S_k) and `query_padding` bool (B, S_q), true = excluded (NULL: none); `pattern` bool broadcastable to
// (B, H, S_q, S_k), true = takes part, and `bias` a floating-point additive mask broadcastable to
// the same, -inf excluding its entries (NULL: none; no gradient reaches it); `prior` a_j
// broadcastable to (B, H, 1, S_k) with a KL term (NULL: none); `hybrid_logit` HNAS's gate logits
// (H,) with `hybrid` (NULL otherwise).
// Outputs: the attention output (q's dtype; HNAS's mixture), the KL part (B, H) (zeros without a
// KL term), and with `mass` the received mass (1, B, H, S_k) float32 (HNAS's mixed as its weights
// are; empty without `mass`); differentiable in q, k, v, `prior` and `hybrid_logit` (the mass is
// not).
char* pa_fused_cuda_attention(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* key_padding,
                              const pa_tensor* query_padding, const pa_tensor* pattern, const pa_tensor* bias, const pa_tensor* prior,
                              const pa_tensor* hybrid_logit, const pa_fused_spec* spec, pa_tensor** out, pa_tensor** kl_part,
                              pa_tensor** mass);
// What pa_fused_cuda_attention would launch, forward (and the mass) then backward (with gradients of ones), for a
// GPU of compute capability `arch`, on tensors of any device, without the driver: a JSON array of
// {kernel, key (its constexprs), grid, ints (every integer argument), tensors (each real tensor
// argument's [shape, dtype])} in launch order (a new string). The tests compare it with plans.py's
// own launches of the same call.
char* pa_fused_cuda_dry_run(const pa_tensor* q, const pa_tensor* k, const pa_tensor* v, const pa_tensor* key_padding,
                            const pa_tensor* query_padding, const pa_tensor* pattern, const pa_tensor* bias, const pa_tensor* prior,
                            const pa_tensor* hybrid_logit, const pa_fused_spec* spec, int32_t arch, char** json);

// The KL part's terms that are sums over the logits, which the fused route forms from sums over
// the sequence (fused_cuda.cpp's LinearKl), for a test against the same terms over the whole score
// matrix: q (B, H, S_q, d), k (B, H_kv, S_k, d), prior a_j (B, H, S_k) (its dtype is the sums'),
// the paddings (B, S) nonzero where padded, the causal mask, the score scale, the part (kl 1
// Weibull, 2 Lognormal, which refuses the causal mask), the row pass's RB (B, H, S_q) and the
// gradient dkl (B, H) in the part. `terms`: five new tensors, KS and TROW (B, H, S_q), QBAR (B, H,
// S_k, d) in q's dtype, dA (B, H, S_k) and the dQ term (B, H, S_q, d).
char* pa_fused_linear_kl_terms(const pa_tensor* q, const pa_tensor* k, const pa_tensor* prior, const pa_tensor* query_padding,
                               const pa_tensor* key_padding, int32_t causal, double scale, int32_t kl, const pa_tensor* rb,
                               const pa_tensor* dkl, pa_tensor** terms);

// ---- memory statistics
// CPU: a counting allocator for libtorch's CPU tensors (installed once, on the first call; tensors
// allocated before it are not counted). Bytes held by live tensors, and the most since the last reset.
char* pa_cpu_memory_track(void);
char* pa_cpu_memory_stats(int64_t* current, int64_t* peak, int64_t* tracking);
char* pa_cpu_memory_reset_peak(void);
// CUDA: the caching allocator's device statistics (allocated and reserved bytes, current and peak).
char* pa_cuda_memory_stats(int64_t device, int64_t* allocated, int64_t* allocated_peak, int64_t* reserved, int64_t* reserved_peak);
char* pa_cuda_memory_reset_peak(int64_t device);

// ---- distributed training (distributed.cpp): c10d's process group and DDP's Reducer
typedef struct pa_dist pa_dist;        // a joined process group (TCPStore, Gloo or NCCL)
typedef struct pa_reducer pa_reducer;  // a c10d::Reducer over a model's parameters
int32_t pa_dist_has_gloo(void);        // 1 when built with gloo's headers
int32_t pa_dist_has_nccl(void);        // 1 when built with NCCL's and CUDA's headers
// Joins `world_size` ranks through the TCPStore at host:port (hosted here when is_server), its keys
// under `prefix`, with backend "gloo" or "nccl"; every collective waits at most timeout_ms.
char* pa_dist_join(const char* backend, const char* host, int32_t port, int32_t is_server, const char* prefix, int32_t rank,
                   int32_t world_size, int64_t timeout_ms, pa_dist** out);
char* pa_dist_broadcast(pa_dist* dist, const pa_tensor* const* tensors, size_t n, int32_t root);  // in place
char* pa_dist_all_reduce(pa_dist* dist, const pa_tensor* const* tensors, size_t n, int32_t op);  // in place; op 0 sum, 1 max
char* pa_dist_all_gather(pa_dist* dist, const pa_tensor* tensor, pa_tensors** out);             // every rank's, in rank order
char* pa_dist_barrier(pa_dist* dist);
void pa_dist_free(pa_dist* dist);
// DDP's bucketing over `params` (buckets of bucket_bytes; find_unused: look for parameters without a
// gradient each step); pa_reducer_prepare before each backward, with the tensors backward starts from.
char* pa_reducer_new(pa_dist* dist, const pa_tensor* const* params, size_t n, int64_t bucket_bytes, int32_t find_unused,
                     pa_reducer** out);
char* pa_reducer_prepare(pa_reducer* reducer, const pa_tensor* const* outputs, size_t n);
void pa_reducer_free(pa_reducer* reducer);

#ifdef __cplusplus
}
#endif
