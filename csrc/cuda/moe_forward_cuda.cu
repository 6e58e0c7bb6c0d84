// CUDA key of kt::moe_forward: the experts stay in host memory and run on the CPU, in
// stream order. On the current stream: copy the inputs (and live_tokens) into pinned
// staging, cudaLaunchHostFunc the CPU experts, copy the result back. Nothing blocks the
// Python thread; under CUDA graph capture the same three steps are recorded, with the
// staging reserved ahead (kt_ops.cuda.reserve_cuda_graph_buffers) and the host function's
// arguments owned by the graph (a CUDA user object: freed when the graph and every
// executable instance of it are destroyed).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <memory>

#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/kernel_table.h"
#include "../ops/mapped_file.h"
#include "../ops/moe_call.h"
#include "host_calls.h"
#include "staging.h"

namespace kt::cuda {
namespace {

struct HostCall {
  cpu::MoeArgs args;  // activations point into the staging
  int64_t hidden_bytes = 0;  // one output row
  bool has_live = false;
  bool live_int64 = false;
  bool owned_by_graph = false;
  const Staging* staging = nullptr;
};

std::atomic<int64_t> graph_owned_calls{0};

// Destructor of a captured call's user object; CUDA runs it once the graph and its
// executable instances are gone (no CUDA API here).
void CUDART_CB delete_host_call(void* data) {
  delete static_cast<HostCall*>(data);
  graph_owned_calls.fetch_sub(1);
}

// Hands `call` to the graph being captured on `stream`: it lives as long as the graph.
void give_to_graph(std::unique_ptr<HostCall> call, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id, &graph));
  TORCH_CHECK(status == cudaStreamCaptureStatusActive && graph != nullptr,
              "kt::moe_forward: the stream stopped capturing during the call");
  cudaUserObject_t object = nullptr;
  C10_CUDA_CHECK(cudaUserObjectCreate(&object, call.get(), delete_host_call, 1, cudaUserObjectNoDestructorSync));
  call.release();  // the user object owns it now
  graph_owned_calls.fetch_add(1);
  const cudaError_t retained = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (retained != cudaSuccess) cudaUserObjectRelease(object, 1);  // deletes the call
  C10_CUDA_CHECK(retained);
}

// Runs on CUDA's host-function thread: no CUDA API here, and nothing may throw.
void CUDART_CB run_experts(void* data) {
  HostCall* call = static_cast<HostCall*>(data);
  cpu::MoeArgs args = call->args;
  std::string error;
  if (call->has_live) {
    const int64_t live = call->live_int64 ? *call->staging->live
                                          : *reinterpret_cast<const int32_t*>(call->staging->live);
    args.tokens = ops::clamp_live_tokens(live, args.tokens, &error);
  }
  if (error.empty()) error = ops::changed_mapped_file(args.packed);
  if (error.empty())
    error = ops::find_bad_expert_id(args.topk_ids, args.topk_ids_int64, args.tokens, args.top_k,
                                    args.layout.shape.num_experts);
  if (!error.empty()) args.tokens = 0;
  try {
    if (args.tokens > 0) cpu::moe_kernel(args.layout.shape.format, cpu::active_cpu_variant()).forward(args);
  } catch (const std::exception& e) {
    error = e.what();
    args.tokens = 0;
  }
  const int64_t rows = call->args.tokens;
  if (args.tokens < rows)  // rows not computed (padding past live_tokens, or an error) are zero
    std::memset(static_cast<char*>(args.output) + args.tokens * call->hidden_bytes, 0,
                (rows - args.tokens) * call->hidden_bytes);
  if (!error.empty()) record_host_error("kt::moe_forward (CUDA host function): " + error);
  if (!call->owned_by_graph) delete call;
}

void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " with hidden_states; got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (call .contiguous())");
}

void copy_async(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (bytes > 0) C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream));
}

at::Tensor moe_forward_cuda(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& live_tokens) {
  const std::string pending = take_host_error();
  TORCH_CHECK(pending.empty(), "an earlier call failed on the stream: ", pending);
  cpu::MoeArgs args = ops::check_moe_call(hidden_states, topk_ids, topk_weights, packed);
  ops::check_live_tokens(live_tokens);
  const at::Device device = hidden_states.device();
  check_device(hidden_states, "hidden_states", device);
  check_device(topk_ids, "topk_ids", device);
  check_device(topk_weights, "topk_weights", device);
  if (live_tokens.has_value()) check_device(*live_tokens, "live_tokens", device);

  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  at::Tensor output = at::empty_like(hidden_states);
  const int64_t tokens = args.tokens, hidden = hidden_states.size(1), top_k = args.top_k;
  if (tokens == 0) return output;

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  Staging* staging = capturing ? graph_staging(device.index(), tokens, hidden, top_k)
                               : eager_staging(device.index(), stream, tokens, hidden, top_k);
  TORCH_CHECK_VALUE(staging != nullptr, "kt::moe_forward is being captured in a CUDA graph with ", tokens,
                    " tokens, hidden size ", hidden, ", top-k ", top_k, ", but no pinned buffers were "
                    "reserved for that batch size: call kt_ops.cuda.reserve_cuda_graph_buffers([", tokens,
                    ", ...], hidden_size=", hidden, ", top_k=", top_k, ") (or HybridMoE.set_capture_batch_sizes) "
                    "before capture");

  auto call = std::make_unique<HostCall>();
  call->args = args;
  call->args.hidden = staging->hidden;
  call->args.topk_ids = staging->ids;
  call->args.topk_weights = staging->weights;
  call->args.output = staging->output;
  call->hidden_bytes = hidden * hidden_states.element_size();
  call->has_live = live_tokens.has_value();
  call->live_int64 = call->has_live && live_tokens->scalar_type() == at::kLong;
  call->owned_by_graph = capturing;
  call->staging = staging;

  copy_async(staging->hidden, hidden_states.const_data_ptr(), hidden_states.nbytes(), cudaMemcpyDeviceToHost, stream);
  copy_async(staging->ids, topk_ids.const_data_ptr(), topk_ids.nbytes(), cudaMemcpyDeviceToHost, stream);
  copy_async(staging->weights, topk_weights.const_data_ptr(), topk_weights.nbytes(), cudaMemcpyDeviceToHost, stream);
  if (call->has_live)
    copy_async(staging->live, live_tokens->const_data_ptr(), live_tokens->nbytes(), cudaMemcpyDeviceToHost, stream);
  HostCall* raw = call.get();
  if (capturing) give_to_graph(std::move(call), stream);  // before the node that uses it
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream, run_experts, raw));
  call.release();  // eager: the host function deletes it (captured: already moved)
  copy_async(output.data_ptr(), staging->output, output.nbytes(), cudaMemcpyHostToDevice, stream);
  return output;
}

}  // namespace

int64_t captured_host_calls() { return graph_owned_calls.load(); }

TORCH_LIBRARY_IMPL(kt, CUDA, m) { m.impl("moe_forward", &moe_forward_cuda); }

}  // namespace kt::cuda
