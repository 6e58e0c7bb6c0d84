// CUDA keys of kt::moe_forward and kt::moe_forward_parts: the experts stay in host memory
// and run on the CPU, in stream order (a layer's parts at once, each on its NUMA node's
// threads, as the CPU key of kt::moe_forward_parts). On the current stream: copy the
// inputs (and live_tokens) into pinned staging, cudaLaunchHostFunc the CPU experts, copy
// the result back. Nothing blocks the Python thread; under CUDA graph capture the same
// three steps are recorded, with the staging reserved ahead
// (kt_ops.cuda.reserve_cuda_graph_buffers) and the host function's arguments owned by the
// graph (a CUDA user object: freed when the graph and every executable instance of it are
// destroyed).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/kernel_table.h"
#include "../ops/mapped_file.h"
#include "../ops/moe_call.h"
#include "host_calls.h"
#include "staging.h"

namespace kt::cuda {
namespace {

struct HostCall {
  const char* op = "kt::moe_forward";
  cpu::MoeArgs args;  // activations point into the staging
  std::vector<cpu::MoePart> parts;  // kt::moe_forward_parts: its parts (args' blob unused); else empty
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
              call->op, ": the stream stopped capturing during the call");
  cudaUserObject_t object = nullptr;
  C10_CUDA_CHECK(cudaUserObjectCreate(&object, call.get(), delete_host_call, 1, cudaUserObjectNoDestructorSync));
  call.release();  // the user object owns it now
  graph_owned_calls.fetch_add(1);
  const cudaError_t retained = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (retained != cudaSuccess) cudaUserObjectRelease(object, 1);  // deletes the call
  C10_CUDA_CHECK(retained);
}

// Scratch of the parts' fp32 outputs a host-function thread keeps between calls (larger
// calls allocate theirs and free it after).
constexpr size_t kKeptPartialsBytes = size_t{64} << 20;

// kt::moe_forward_parts' CPU work: every part at once, their fp32 outputs [parts, T, H]
// summed in part order (cpu/kernels/moe_parts.h). May throw (allocation, a NUMA node the
// engine lacks).
void run_parts(const cpu::MoeArgs& args, const std::vector<cpu::MoePart>& parts) {
  const size_t floats = parts.size() * static_cast<size_t>(args.tokens) *
                        static_cast<size_t>(parts.front().layout.shape.hidden_size);
  thread_local std::vector<float> kept;
  std::vector<float> once;
  std::vector<float>& partials = floats * sizeof(float) <= kKeptPartialsBytes ? kept : once;
  if (partials.size() < floats) partials.resize(floats);
  cpu::moe_forward_parts(args, parts, partials.data(), cpu::active_cpu_variant());
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
  for (const cpu::MoePart& part : call->parts)
    if (error.empty()) error = ops::changed_mapped_file(part.packed);
  if (error.empty())
    error = ops::find_bad_expert_id(args.topk_ids, args.topk_ids_int64, args.tokens, args.top_k,
                                    args.layout.shape.num_experts);
  if (!error.empty()) args.tokens = 0;
  try {
    if (args.tokens > 0 && call->parts.empty())
      cpu::moe_kernel(args.layout.shape.format, cpu::active_cpu_variant()).forward(args);
    else if (args.tokens > 0)
      run_parts(args, call->parts);
  } catch (const std::exception& e) {
    error = e.what();
    args.tokens = 0;
  }
  const int64_t rows = call->args.tokens;
  if (args.tokens < rows)  // rows not computed (padding past live_tokens, or an error) are zero
    std::memset(static_cast<char*>(args.output) + args.tokens * call->hidden_bytes, 0,
                (rows - args.tokens) * call->hidden_bytes);
  if (!error.empty()) record_host_error(std::string(call->op) + " (CUDA host function): " + error);
  if (!call->owned_by_graph) delete call;
}

void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " with hidden_states; got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (call .contiguous())");
}

void copy_async(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  if (bytes > 0) C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream));
}

// Queues `call` (its kernel arguments checked, no data pointers yet) on the current stream
// of hidden_states' device: the inputs copied into pinned staging, the host function, the
// output copied back. Returns the output (hidden_states' shape and dtype).
at::Tensor enqueue(std::unique_ptr<HostCall> call, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                   const at::Tensor& topk_weights, const c10::optional<at::Tensor>& live_tokens) {
  const at::Device device = hidden_states.device();
  check_device(hidden_states, "hidden_states", device);
  check_device(topk_ids, "topk_ids", device);
  check_device(topk_weights, "topk_weights", device);
  if (live_tokens.has_value()) check_device(*live_tokens, "live_tokens", device);

  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  at::Tensor output = at::empty_like(hidden_states);
  const int64_t tokens = call->args.tokens, hidden = hidden_states.size(1), top_k = call->args.top_k;
  if (tokens == 0) return output;

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  Staging* staging = capturing ? graph_staging(device.index(), tokens, hidden, top_k)
                               : eager_staging(device.index(), stream, tokens, hidden, top_k);
  TORCH_CHECK_VALUE(staging != nullptr, call->op, " is being captured in a CUDA graph with ", tokens,
                    " tokens, hidden size ", hidden, ", top-k ", top_k, ", but no pinned buffers were "
                    "reserved for that batch size: call kt_ops.cuda.reserve_cuda_graph_buffers([", tokens,
                    ", ...], hidden_size=", hidden, ", top_k=", top_k, ") (or HybridMoE.set_capture_batch_sizes) "
                    "before capture");

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

void check_no_pending_error() {
  const std::string pending = take_host_error();
  TORCH_CHECK(pending.empty(), "an earlier call failed on the stream: ", pending);
}

at::Tensor moe_forward_cuda(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& live_tokens) {
  check_no_pending_error();
  auto call = std::make_unique<HostCall>();
  call->args = ops::check_moe_call(hidden_states, topk_ids, topk_weights, packed);
  ops::check_live_tokens(live_tokens);
  return enqueue(std::move(call), hidden_states, topk_ids, topk_weights, live_tokens);
}

at::Tensor moe_forward_parts_cuda(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                  const at::Tensor& topk_weights, at::TensorList parts, at::IntArrayRef nodes) {
  check_no_pending_error();
  auto call = std::make_unique<HostCall>();
  call->op = "kt::moe_forward_parts";
  call->parts = ops::check_moe_parts(hidden_states, topk_ids, topk_weights, parts, nodes, &call->args);
  return enqueue(std::move(call), hidden_states, topk_ids, topk_weights, c10::nullopt);
}

}  // namespace

int64_t captured_host_calls() { return graph_owned_calls.load(); }

TORCH_LIBRARY_IMPL(kt, CUDA, m) {
  m.impl("moe_forward", &moe_forward_cuda);
  m.impl("moe_forward_parts", &moe_forward_parts_cuda);
}

}  // namespace kt::cuda
