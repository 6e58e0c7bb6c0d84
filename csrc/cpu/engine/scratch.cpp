#include "scratch.h"

#include <cstdlib>
#include <memory>
#include <new>

#include "huge_pages.h"

namespace kt::cpu {
namespace {

struct Free {
  void operator()(uint8_t* p) const { std::free(p); }
};

uint8_t* allocate(size_t bytes) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// A thread's grow-only buffer: reallocated (the old one freed first) when a request
// exceeds it, to `grown` bytes.
struct Retained {
  std::unique_ptr<uint8_t, Free> buffer;
  size_t capacity = 0;

  uint8_t* at_least(size_t bytes, size_t grown) {
    if (bytes > capacity) {
      buffer.reset();
      capacity = 0;
      buffer.reset(allocate(grown));
      capacity = grown;
    }
    return buffer.get();
  }
};

Retained& retained() {
  thread_local Retained r;
  return r;
}

Retained& retained_buffer(ThreadBuffer which) {
  thread_local Retained r[static_cast<int>(ThreadBuffer::kCount)];
  return r[static_cast<int>(which)];
}

}  // namespace

ScratchLease::ScratchLease(size_t bytes) {
  const size_t rounded = (bytes + (bytes >> 2) + 4095) / 4096 * 4096;  // 25% headroom
  if (bytes > kRetainedScratchBytes) {
    data_ = allocate((bytes + 4095) / 4096 * 4096);
    advise_huge_pages(data_, bytes);
    owned_ = true;
    return;
  }
  data_ = retained().at_least(bytes, rounded);
}

ScratchLease::~ScratchLease() {
  if (owned_) std::free(data_);
}

uint8_t* thread_buffer(ThreadBuffer which, size_t bytes) {
  return retained_buffer(which).at_least(bytes, (bytes + 63) / 64 * 64);
}

}  // namespace kt::cpu
