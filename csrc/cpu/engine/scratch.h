// Per-thread grow-only scratch memory, so a call allocates (and page-faults) only when
// it needs more than any earlier call on that thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kt::cpu {

// 64-byte aligned, at least `bytes` long, valid until the next call on this thread.
uint8_t* thread_scratch(size_t bytes);

// Carves consecutive 64-byte aligned sub-buffers out of one allocation.
class ScratchLayout {
 public:
  // Reserves `count` elements of T and returns their offset.
  template <typename T>
  size_t add(size_t count) {
    const size_t offset = total_;
    total_ += (count * sizeof(T) + 63) / 64 * 64;
    return offset;
  }
  size_t bytes() const { return total_; }

 private:
  size_t total_ = 0;
};

}  // namespace kt::cpu
