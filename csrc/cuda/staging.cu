#include "staging.h"

#include <cuda_runtime_api.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace kt::cuda {
namespace {

using Shape = std::tuple<int, int64_t, int64_t, int64_t>;  // device, tokens, hidden, top_k

struct PinnedStaging : Staging {
  PinnedStaging(int device, int64_t t, int64_t h, int64_t k) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    tokens = t, hidden_size = h, top_k = k;
    C10_CUDA_CHECK(cudaHostAlloc(&hidden, bytes_of(t * h), cudaHostAllocPortable));
    C10_CUDA_CHECK(cudaHostAlloc(&ids, bytes_of(t * k), cudaHostAllocPortable));
    C10_CUDA_CHECK(cudaHostAlloc(&weights, bytes_of(t * k), cudaHostAllocPortable));
    C10_CUDA_CHECK(cudaHostAlloc(&output, bytes_of(t * h), cudaHostAllocPortable));
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&live), sizeof(int64_t), cudaHostAllocPortable));
  }
  ~PinnedStaging() {  // process exit: the buffers outlive every captured graph
    for (void* p : {hidden, ids, weights, output, static_cast<void*>(live)})
      if (p != nullptr) cudaFreeHost(p);
  }
  static size_t bytes_of(int64_t elements) { return static_cast<size_t>(elements > 0 ? elements : 1) * 8; }
  int64_t total_bytes() const {
    return static_cast<int64_t>(2 * bytes_of(tokens * hidden_size) + 2 * bytes_of(tokens * top_k) + sizeof(int64_t));
  }
};

struct Registry {
  std::mutex mutex;
  std::map<Shape, std::unique_ptr<PinnedStaging>> graph;
  std::map<std::pair<uintptr_t, Shape>, std::unique_ptr<PinnedStaging>> eager;
  std::string host_error;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: host functions may run at exit
  return *r;
}

}  // namespace

Staging* graph_staging(int device, int64_t tokens, int64_t hidden, int64_t top_k) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.graph.find(Shape{device, tokens, hidden, top_k});
  return it == r.graph.end() ? nullptr : it->second.get();
}

void reserve_graph_staging(int device, int64_t tokens, int64_t hidden, int64_t top_k) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& slot = r.graph[Shape{device, tokens, hidden, top_k}];
  if (!slot) slot = std::make_unique<PinnedStaging>(device, tokens, hidden, top_k);
}

Staging* eager_staging(int device, const void* stream, int64_t tokens, int64_t hidden, int64_t top_k) {
  int64_t capacity = 16;  // power-of-two buckets: a stream holds at most ~log2(T) sets
  while (capacity < tokens) capacity *= 2;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto& slot = r.eager[{reinterpret_cast<uintptr_t>(stream), Shape{device, capacity, hidden, top_k}}];
  if (!slot) slot = std::make_unique<PinnedStaging>(device, capacity, hidden, top_k);
  return slot.get();
}

int64_t staging_bytes() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  int64_t total = 0;
  for (auto& [shape, s] : r.graph) total += s->total_bytes();
  for (auto& [key, s] : r.eager) total += s->total_bytes();
  return total;
}

void record_host_error(const std::string& message) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.host_error.empty()) r.host_error = message;
}

std::string take_host_error() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::string message;
  message.swap(r.host_error);
  return message;
}

}  // namespace kt::cuda
