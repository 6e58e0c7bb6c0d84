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

// Per-thread buffers that a job's micro-kernels write and read back within one job: the
// gate/up tile of the BF16, FP8 and INT formats, FP8 prefill's decoded lines and the
// unpacked B tiles of a block of int4 groups of 32 on AMX (quant_gemm_amx.h). On the
// heap, allocated on a thread's first use: as `thread_local` arrays they sat in the
// library's static TLS block, which every thread entering kt_ops (engine workers, torch's
// intra-op threads, callers) gets allocated and zeroed in full (3.26 MB per thread).
enum class ThreadBuffer { kGateUpTile, kFp8Lines, kTileWeights, kCount };

// This thread's buffer `which`, 64-byte aligned, at least `bytes` long (grow-only, kept
// until the thread exits). Valid until the thread asks for the same buffer with more
// bytes. Throws std::bad_alloc (the engine hands a job's exception to the caller).
uint8_t* thread_buffer(ThreadBuffer which, size_t bytes);

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
