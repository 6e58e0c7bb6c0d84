// Per-thread scratch memory for one MoE call. Up to kRetainedScratchBytes it is kept and
// reused (grow-only), so a call allocates and page-faults only when it needs more than
// any earlier call on that thread; a call needing more gets its own buffer, given back
// when the call ends, so one huge prefill does not stay resident for the thread's life.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kt::cpu {

constexpr size_t kRetainedScratchBytes = size_t{256} << 20;

// 64-byte aligned scratch of at least `bytes`, valid while the lease lives (one per
// thread at a time). Throws std::bad_alloc.
class ScratchLease {
 public:
  explicit ScratchLease(size_t bytes);
  ~ScratchLease();
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
  bool owned_ = false;  // a buffer of its own (above kRetainedScratchBytes), freed here
};

// Bytes of scratch this thread keeps between calls (tests).
size_t retained_scratch_bytes();

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
