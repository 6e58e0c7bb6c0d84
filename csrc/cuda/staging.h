// Pinned host staging buffers for the CUDA key of kt::moe_forward, and the sticky error
// of its host functions. No CUDA kernels: the buffers are cudaHostAlloc'd once per
// (device, tokens, hidden, top_k) and never reallocated, so a captured CUDA graph keeps
// valid pointers; host functions call no CUDA API. This header needs no CUDA headers
// (python_module.cpp, compiled by the host compiler, includes it).
#pragma once

#include <cstdint>
#include <string>

namespace kt::cuda {

// One call's host memory, sized for fp32 activations and int64 ids (every dtype fits).
struct Staging {
  void* hidden = nullptr;   // [tokens, hidden]
  void* ids = nullptr;      // [tokens, top_k]
  void* weights = nullptr;  // [tokens, top_k]
  void* output = nullptr;   // [tokens, hidden]
  int64_t* live = nullptr;  // the live batch size, staged from the device
  int64_t tokens = 0, hidden_size = 0, top_k = 0;  // capacity
};

// Buffers for graph capture: reserved ahead (reserve_graph_staging), shared by every
// captured call of that shape (graphs replay in stream order). Null if not reserved.
Staging* graph_staging(int device, int64_t tokens, int64_t hidden, int64_t top_k);
void reserve_graph_staging(int device, int64_t tokens, int64_t hidden, int64_t top_k);

// Buffers for eager calls: one set per stream and power-of-two token bucket (>= tokens),
// allocated on first use and reused: stream order keeps successive calls apart.
Staging* eager_staging(int device, const void* stream, int64_t tokens, int64_t hidden, int64_t top_k);

// Bytes of pinned memory held by all staging buffers.
int64_t staging_bytes();

// Host functions cannot throw: they record the first failure here and the next
// kt::moe_forward on CUDA (or kt_ops.cuda.raise_pending_error) raises it.
void record_host_error(const std::string& message);
std::string take_host_error();

}  // namespace kt::cuda
