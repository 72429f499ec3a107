// binding.cpp: the torch-facing side of the kernel layer.
//
// Python builds a ScoreParams / PushState image once per shape (cpindex/kernels/structs.py mirrors
// launch.h and checks every offset against params_layout() at load); each call only patches the
// pointers that change (queries, cache, block table, lengths) and launches. Peer memory
// allocation and IPC handles live here too: on ROCm torch's allocator cannot give the uncached
// (fine-grained) memory that cross-GPU flags need, so one small path serves both vendors.
#include <torch/extension.h>
#include <pybind11/stl.h>  // instances(): a list of tuples

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "launch.h"

namespace {

// Every refusal here builds its message from strings and raises it as one C string. With torch
// 2.11 (CUDA 13 wheels) and g++ 13, a TORCH_CHECK message that streams a number (an integer, a
// size list) crashed the process (SIGSEGV) instead of raising; the scalar type alone did not.
[[noreturn]] void fail(const std::string& msg) { TORCH_CHECK(false, msg.c_str()); }
#define CP_CHECK(cond, msg) \
  do {                      \
    if (!(cond)) fail(msg); \
  } while (0)
std::string num(int64_t v) { return std::to_string(v); }
std::string dims(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
std::string dev(const torch::Tensor& t) { return t.device().str(); }
std::string dtype(const torch::Tensor& t) { return c10::toString(t.scalar_type()); }

#define CP_CHECK_RT(expr)                                                                   \
  do {                                                                                      \
    auto _e = (expr);                                                                       \
    CP_CHECK(_e == cudaSuccess, std::string(#expr " failed: ") + cudaGetErrorString(_e) +   \
                                    " at " __FILE__ ":" + num(__LINE__));                   \
  } while (0)

// The instance the launcher chose (cpindex/kernels/variants.py) must be one this module holds.
void check_instance(const char* what, int64_t format, int64_t tiles, bool wgmma, int64_t split) {
  CP_CHECK(cpindex::score_has_instance((int)format, (int)tiles, wgmma, (int)split),
           std::string(what) + ": no instance (format " + num(format) + ", tiles " + num(tiles) +
               ", wgmma " + num(wgmma) + ", split " + num(split) +
               ") in this module (kernels/variants.py, instances())");
}

// Every instance this module holds, (format, tiles, wgmma, split): build.py checks that it is
// variants.instances()' list.
std::vector<std::tuple<int64_t, int64_t, bool, int64_t>> instances() {
  std::vector<std::tuple<int64_t, int64_t, bool, int64_t>> out;
  for (int f = 0; f < 4; ++f)
    for (int t = 1; t <= 8; ++t)
      for (int w = 0; w < 2; ++w)
        for (int s = 0; s <= cpindex::kWarpsPerCta; ++s)
          if (cpindex::score_has_instance(f, t, w, s)) out.emplace_back(f, t, w, s);
  return out;
}

using cpindex::FingerprintParams;
using cpindex::PushState;
using cpindex::ScoreParams;

void score(const torch::Tensor& q, const torch::Tensor& kv, const c10::optional<torch::Tensor>& ks,
           const torch::Tensor& block_table, const torch::Tensor& seq_lens,
           const torch::Tensor& params_image, const c10::optional<torch::Tensor>& push_image,
           int64_t format, int64_t tiles, bool wgmma, int64_t split, int64_t grid, int64_t tag) {
  // Validation happened once, in Python (cpindex/validation.py); these are cheap invariants.
  CP_CHECK(params_image.numel() == (int64_t)sizeof(ScoreParams), "ScoreParams image size");
  check_instance("score", format, tiles, wgmma, split);
  ScoreParams p;
  std::memcpy(&p, params_image.data_ptr(), sizeof p);
  // kv/ks arrive as views (cpindex.kernels.launcher.cache_parts): bf16/fp8 [pages, 128, 128];
  // nvfp4 values [pages, 128, 64] and scales [pages, 128, 8] of any of its three layouts.
  p.kv = static_cast<const uint8_t*>(kv.data_ptr());
  p.kv_page_stride = kv.stride(0) * kv.element_size();
  p.kv_token_stride = kv.stride(1) * kv.element_size();
  p.num_pages = kv.size(0);
  if (ks.has_value()) {
    p.ks = static_cast<const uint8_t*>(ks->data_ptr());
    p.ks_page_stride = ks->stride(0) * ks->element_size();
    p.ks_token_stride = ks->stride(1) * ks->element_size();
  } else {
    p.ks = nullptr;
    p.ks_page_stride = p.ks_token_stride = 0;
  }
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_row_stride = block_table.stride(0);
  p.bt_cols = block_table.size(1);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.tag = static_cast<uint64_t>(tag);  // the caller's tag (-1: none); a graph replays it

  const c10::cuda::CUDAGuard guard(q.device());
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  // A launch can block (full launch queue). Holding the GIL then would stall the other ranks'
  // threads of a one-process world, whose launches this rank's kernel may be waiting for.
  py::gil_scoped_release no_gil;
  int rc;
  if (push_image.has_value()) {
    CP_CHECK(push_image->numel() == (int64_t)sizeof(PushState), "PushState image size");
    PushState ps;
    std::memcpy(&ps, push_image->data_ptr(), sizeof ps);
    ps.q_src = static_cast<const uint8_t*>(q.data_ptr());
    ps.q_bytes = q.numel() * q.element_size();
    rc = cpindex::launch_score(p, &ps, (int)format, (int)tiles, wgmma, (int)split, (int)grid,
                                stream);
  } else {
    p.q = static_cast<const uint8_t*>(q.data_ptr());
    rc = cpindex::launch_score(p, nullptr, (int)format, (int)tiles, wgmma, (int)split, (int)grid,
                                stream);
  }
  CP_CHECK(rc == 0, std::string("cpindex score kernel launch failed: ") +
                          cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

// The collective transport's merge (launch.h, launch_merge): the image of the local select call
// whose candidates the all-to-all delivered, launched on the current stream of `device`.
void merge(const torch::Tensor& params_image, int64_t device) {
  CP_CHECK(params_image.numel() == (int64_t)sizeof(ScoreParams), "ScoreParams image size");
  ScoreParams p;
  std::memcpy(&p, params_image.data_ptr(), sizeof p);
  CP_CHECK(p.topk > 0 && p.cand != nullptr, "merge: the image of a select call");
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  py::gil_scoped_release no_gil;  // as in score
  const int rc = cpindex::launch_merge(p, stream);
  CP_CHECK(rc == 0, std::string("cpindex merge kernel launch failed: ") +
                          cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

// The plan fingerprint (launch.h, launch_plan_fingerprint; cpindex.fingerprint validates
// and falls back to torch ops for other layouts): block_table int32 [requests, cols] with
// contiguous rows, seq_lens int32 [requests] contiguous, out int64 [1], one GPU; launched on
// its current stream.
void plan_fingerprint(const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                      int64_t init_blocks, int64_t local_blocks, const torch::Tensor& out) {
  CP_CHECK(block_table.is_cuda() && block_table.dim() == 2 &&
               block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1,
           "plan_fingerprint: block_table must be an int32 [requests, cols] GPU tensor with "
           "contiguous rows");
  const int64_t requests = block_table.size(0);
  CP_CHECK(seq_lens.device() == block_table.device() && seq_lens.dim() == 1 &&
               seq_lens.size(0) == requests && seq_lens.scalar_type() == torch::kInt32 &&
               seq_lens.is_contiguous(),
           "plan_fingerprint: seq_lens must be a contiguous int32 [" + num(requests) +
               "] tensor on " + dev(block_table));
  CP_CHECK(out.device() == block_table.device() && out.numel() == 1 &&
               out.scalar_type() == torch::kInt64,
           "plan_fingerprint: out must be an int64 [1] tensor on " + dev(block_table));
  FingerprintParams f;
  f.block_table = block_table.data_ptr<int32_t>();
  f.bt_row_stride = block_table.stride(0);
  f.cols = block_table.size(1);
  f.seq_lens = seq_lens.data_ptr<int32_t>();
  f.requests = requests;
  f.init_blocks = init_blocks;
  f.local_blocks = local_blocks;
  f.out = out.data_ptr<int64_t>();
  const c10::cuda::CUDAGuard guard(block_table.device());
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  py::gil_scoped_release no_gil;  // as in score
  const int rc = cpindex::launch_plan_fingerprint(f, stream);
  CP_CHECK(rc == 0, std::string("cpindex plan_fingerprint launch failed: ") +
                          cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

// The fused key writer (launch.h, WriteParams): keys [tokens, 128] float32/bfloat16/float16 with
// contiguous rows, slots int64 [tokens], kv the bf16/fp8 cache [pages, 128, 128] or the nvfp4
// values view [pages, 128, 64] with ks its scales view [pages, 128, 8] (uint8 or e4m3), format 0
// bf16, 1 fp8, 2 nvfp4; err_ptr / err_host_ptr the device and host-mapped addresses of an
// ErrorWord. Launches on the current stream: no sync, graph-capturable. The Python caller
// (cpindex.formats.write_keys) validates for the user; these checks keep memory safe.
void write_keys(const torch::Tensor& keys, const torch::Tensor& slots, const torch::Tensor& kv,
                const c10::optional<torch::Tensor>& ks, int64_t format, int64_t err_ptr,
                int64_t err_host_ptr) {
  CP_CHECK(keys.is_cuda() && keys.dim() == 2 && keys.size(1) == cpindex::kHeadDim &&
               keys.stride(1) == 1,
           "write_keys: keys must be a [tokens, 128] GPU tensor with contiguous rows, got " +
               dims(keys.sizes()) + " with strides " + dims(keys.strides()) + " on " + dev(keys));
  int key_dtype = -1;
  switch (keys.scalar_type()) {
    case at::kFloat: key_dtype = 0; break;
    case at::kBFloat16: key_dtype = 1; break;
    case at::kHalf: key_dtype = 2; break;
    default: break;
  }
  CP_CHECK(key_dtype >= 0, "write_keys: keys must be float32, bfloat16 or float16, got " + dtype(keys));
  CP_CHECK(slots.device() == keys.device() && slots.scalar_type() == at::kLong &&
               slots.dim() == 1 && slots.size(0) == keys.size(0) && slots.is_contiguous(),
           "write_keys: slots must be a contiguous int64 [" + num(keys.size(0)) + "] tensor on " +
               dev(keys) + ", got " + dtype(slots) + " " + dims(slots.sizes()) + " on " + dev(slots));
  CP_CHECK(format == cpindex::kBF16 || format == cpindex::kFP8 || format == cpindex::kNVFP4,
           "write_keys: format must be 0 (bf16), 1 (fp8) or 2 (nvfp4), got " + num(format));
  const bool fp4 = format == cpindex::kNVFP4;
  const auto byte_dtype = [](const torch::Tensor& t) {
    return t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e4m3fn;
  };
  const bool kv_dtype_ok = format == cpindex::kBF16 ? kv.scalar_type() == at::kBFloat16
                           : fp4                    ? kv.scalar_type() == at::kByte
                                                    : byte_dtype(kv);
  CP_CHECK(kv.device() == keys.device() && kv_dtype_ok && kv.dim() == 3 &&
               kv.size(1) == cpindex::kPageTokens && kv.size(2) == (fp4 ? 64 : 128) &&
               kv.stride(2) == 1,
           std::string("write_keys: kv must be ") +
               (format == cpindex::kBF16 ? "a bfloat16 [pages, 128, 128] cache"
                : fp4                    ? "the nvfp4 values view, uint8 [pages, 128, 64]"
                                         : "a float8_e4m3fn or uint8 [pages, 128, 128] cache") +
               " on " + dev(keys) + " with contiguous rows, got " + dtype(kv) + " " +
               dims(kv.sizes()) + " with strides " + dims(kv.strides()) + " on " + dev(kv));
  if (fp4) {
    CP_CHECK(ks.has_value() && ks->device() == keys.device() && byte_dtype(*ks) &&
                 ks->dim() == 3 && ks->size(0) == kv.size(0) &&
                 ks->size(1) == cpindex::kPageTokens && ks->size(2) == 8 && ks->stride(2) == 1,
             "write_keys: nvfp4 needs ks, the scales view uint8 or float8_e4m3fn [" +
                 num(kv.size(0)) + ", 128, 8] on " + dev(keys) + " with contiguous rows");
  } else {
    CP_CHECK(!ks.has_value(), "write_keys: ks is for nvfp4 only (format " + num(format) + ")");
  }
  CP_CHECK(err_ptr != 0, "write_keys: err_ptr must be an ErrorWord's device address");
  if (keys.size(0) == 0) return;

  cpindex::WriteParams w{};
  w.keys = static_cast<const uint8_t*>(keys.data_ptr());
  w.key_row_stride = keys.stride(0) * keys.element_size();
  w.key_dtype = key_dtype;
  w.format = (int)format;
  w.slots = slots.data_ptr<int64_t>();
  w.tokens = keys.size(0);
  w.kv = static_cast<uint8_t*>(kv.data_ptr());
  w.kv_page_stride = kv.stride(0) * kv.element_size();
  w.kv_token_stride = kv.stride(1) * kv.element_size();
  w.num_pages = kv.size(0);
  if (fp4) {
    w.ks = static_cast<uint8_t*>(ks->data_ptr());
    w.ks_page_stride = ks->stride(0);
    w.ks_token_stride = ks->stride(1);
  }
  w.err = reinterpret_cast<cpindex::ErrorWord*>(err_ptr);
  w.err_host = reinterpret_cast<cpindex::ErrorWord*>(err_host_ptr);
  w.rank = 0;  // the writer is not part of a collective call

  const c10::cuda::CUDAGuard guard(keys.device());
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  py::gil_scoped_release no_gil;  // as in score: a blocked launch must not stall other ranks
  const int rc = cpindex::launch_write_keys(w, stream);
  CP_CHECK(rc == 0, std::string("cpindex write_keys kernel launch failed: ") +
                          cudaGetErrorString(static_cast<cudaError_t>(rc)));
}

int64_t occupancy(int64_t format, int64_t tiles, bool wgmma, int64_t split) {
  check_instance("occupancy", format, tiles, wgmma, split);
  int ctas = 0;
  CP_CHECK_RT(static_cast<cudaError_t>(
      cpindex::score_occupancy((int)format, (int)tiles, wgmma, (int)split, &ctas)));
  return ctas;
}

// Device ticks of the kernel's timeout clock per second (globaltimer ns on CUDA, the constant
// wall clock on ROCm).
double clock_ticks_per_second(int64_t device) {
#ifdef USE_ROCM
  int khz = 0;
  CP_CHECK_RT(hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, (int)device));
  return 1e3 * khz;
#else
  (void)device;
  return 1e9;
#endif
}

// ---- peer memory --------------------------------------------------------------------------------
int64_t peer_malloc(int64_t bytes, int64_t device) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  void* ptr = nullptr;
#ifdef USE_ROCM
  // Uncached (fine-grained) so peers' stores and flags are seen without cache maintenance.
  CP_CHECK_RT(hipExtMallocWithFlags(&ptr, (size_t)bytes, hipDeviceMallocUncached));
#else
  CP_CHECK_RT(cudaMalloc(&ptr, (size_t)bytes));
#endif
  CP_CHECK_RT(cudaMemset(ptr, 0, (size_t)bytes));
  CP_CHECK_RT(cudaDeviceSynchronize());
  return reinterpret_cast<int64_t>(ptr);
}

void peer_free(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  CP_CHECK_RT(cudaFree(reinterpret_cast<void*>(ptr)));
}

py::bytes ipc_handle(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  cudaIpcMemHandle_t h;
  CP_CHECK_RT(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)));
  return py::bytes(reinterpret_cast<const char*>(&h), sizeof h);
}

int64_t ipc_open(const std::string& handle, int64_t device) {
  CP_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t), "bad IPC handle size");
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof h);
  void* ptr = nullptr;
  CP_CHECK_RT(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close(int64_t ptr, int64_t device) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  CP_CHECK_RT(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)));
}

bool can_access_peer(int64_t device, int64_t peer) {
  int ok = 0;
  CP_CHECK_RT(cudaDeviceCanAccessPeer(&ok, (int)device, (int)peer));
  return ok != 0;
}

// Device address of pinned host memory (error words the host polls without a sync).
int64_t host_device_pointer(int64_t host_ptr) {
  void* dev = nullptr;
  CP_CHECK_RT(cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(host_ptr), 0));
  return reinterpret_cast<int64_t>(dev);
}

py::dict params_layout() {
  py::dict d;
#define CP_FIELD(S, f) d[#S "." #f] = (int64_t)offsetof(S, f)
  CP_FIELD(ScoreParams, kv); CP_FIELD(ScoreParams, ks); CP_FIELD(ScoreParams, num_pages);
  CP_FIELD(ScoreParams, kv_token_stride); CP_FIELD(ScoreParams, fp4_lut);
  CP_FIELD(ScoreParams, requests); CP_FIELD(ScoreParams, query_len);
  CP_FIELD(ScoreParams, q); CP_FIELD(ScoreParams, q_heads_per_src);
  CP_FIELD(ScoreParams, q_src_magic); CP_FIELD(ScoreParams, heads_magic);
  CP_FIELD(ScoreParams, block_table); CP_FIELD(ScoreParams, bt_cols); CP_FIELD(ScoreParams, seq_lens);
  CP_FIELD(ScoreParams, scale); CP_FIELD(ScoreParams, dst);
  CP_FIELD(ScoreParams, dst_copies); CP_FIELD(ScoreParams, out_row_stride);
  CP_FIELD(ScoreParams, err); CP_FIELD(ScoreParams, err_host);
  CP_FIELD(PushState, calls); CP_FIELD(PushState, peer_q_slot); CP_FIELD(PushState, peer_q_flag);
  CP_FIELD(PushState, peer_s_flag); CP_FIELD(PushState, q_src); CP_FIELD(PushState, q_bytes);
  CP_FIELD(PushState, peer_q_ident); CP_FIELD(PushState, q_idents); CP_FIELD(ScoreParams, ident);
  CP_FIELD(PushState, barrier); CP_FIELD(ScoreParams, topk); CP_FIELD(ScoreParams, cand_dst);
  CP_FIELD(ScoreParams, cand); CP_FIELD(ScoreParams, ids_out); CP_FIELD(ScoreParams, scores_out);
  CP_FIELD(PushState, timeout_ticks); CP_FIELD(PushState, peer_q_tag);
  CP_FIELD(PushState, peer_fp); CP_FIELD(PushState, q_tags); CP_FIELD(PushState, fps);
  CP_FIELD(PushState, fp_acc); CP_FIELD(ScoreParams, tag); CP_FIELD(ScoreParams, agree);
  CP_FIELD(ScoreParams, poison_count); CP_FIELD(ScoreParams, poison);
  CP_FIELD(ScoreParams, trailer); CP_FIELD(ScoreParams, local_state);
#undef CP_FIELD
  d["sizeof.ScoreParams"] = (int64_t)sizeof(ScoreParams);
  d["sizeof.PushState"] = (int64_t)sizeof(PushState);
  d["sizeof.ErrorWord"] = (int64_t)sizeof(cpindex::ErrorWord);
  return d;
}

// Streams for the one-process world, created back to back: the driver hands out hardware work
// queues (CUDA_DEVICE_MAX_CONNECTIONS, default 8) round-robin in creation order, so W <= 8
// streams made in a row get W different queues. Two ranks on one queue would deadlock: a push
// kernel waits for its peer's, which sits in the queue behind this rank's next work.
int64_t stream_create() {
  cudaStream_t s;
  CP_CHECK_RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return reinterpret_cast<int64_t>(s);
}

void stream_destroy(int64_t s) { CP_CHECK_RT(cudaStreamDestroy(reinterpret_cast<cudaStream_t>(s))); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cpindex fused block-scoring kernel (see cpindex/kernels/launch.h)";
  m.def("score", &score);
  m.def("formats", [] { return (int64_t)CP_FORMATS; });  // the CacheFormat bits built here
  m.def("merge", &merge);
  m.def("plan_fingerprint", &plan_fingerprint);
  m.def("write_keys", &write_keys);
  m.def("occupancy", &occupancy);
  m.def("instances", &instances);
  m.def("clock_ticks_per_second", &clock_ticks_per_second);
  m.def("peer_malloc", &peer_malloc);
  m.def("peer_free", &peer_free);
  m.def("ipc_handle", &ipc_handle);
  m.def("ipc_open", &ipc_open);
  m.def("ipc_close", &ipc_close);
  m.def("can_access_peer", &can_access_peer);
  m.def("host_device_pointer", &host_device_pointer);
  m.def("params_layout", &params_layout);
  m.def("stream_create", &stream_create);
  m.def("stream_destroy", &stream_destroy);
}
