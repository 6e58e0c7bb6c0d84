#include "packed_blob.h"

#include <array>
#include <cstdint>
#include <cstring>

#include "checks.h"
#include "mapped_file.h"

namespace kt::ops {
namespace {

// The last headers this thread read, direct-mapped by address. read_packed_header is a
// function of the header's bytes and the blob's size alone, so an entry whose saved header
// equals the blob's current one (one memcmp of 256 bytes, ~20 ns) gives the same layout
// without the checksum and the layout checks (~0.5 us: a per-call cost of every operator).
// A header changed in place misses and is read (and rejected) again.
struct HeaderCacheEntry {
  const uint8_t* blob = nullptr;
  size_t bytes = 0;
  std::array<uint8_t, cpu::kPackedHeaderBytes> header{};
  cpu::PackedLayout layout;
};

constexpr size_t kHeaderCacheEntries = 64;  // = 2^(64 - 58): a model's layers, one blob each (more share slots)

cpu::PackedLayout read_header_cached(const uint8_t* blob, size_t bytes) {
  if (bytes < cpu::kPackedHeaderBytes) return cpu::read_packed_header(blob, bytes);  // throws
  thread_local std::array<HeaderCacheEntry, kHeaderCacheEntries> cache;
  // Fibonacci hashing of the address: blobs are often page- or 2 MiB-aligned.
  const uint64_t slot = (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(blob)) * 0x9E3779B97F4A7C15ull) >> 58;
  HeaderCacheEntry& entry = cache[slot];
  if (entry.blob == blob && entry.bytes == bytes &&
      std::memcmp(entry.header.data(), blob, cpu::kPackedHeaderBytes) == 0)
    return entry.layout;
  const cpu::PackedLayout layout = cpu::read_packed_header(blob, bytes);  // throws for a bad blob
  entry.blob = blob;
  entry.bytes = bytes;
  std::memcpy(entry.header.data(), blob, cpu::kPackedHeaderBytes);
  entry.layout = layout;
  return layout;
}

}  // namespace

cpu::PackedLayout read_packed(const at::Tensor& packed, const char* name) {
  check_dtype(packed, name, {at::kByte});
  check_dim(packed, name, 1);
  check_cpu_contiguous(packed, name);
  // Before the header is read: a blob mapped from a file that shrank since would SIGBUS
  // (every operator reads its blob through here).
  check_mapped_file(packed.const_data_ptr());
  return translate_errors([&] {
    return read_header_cached(packed.const_data_ptr<uint8_t>(), static_cast<size_t>(packed.numel()));
  });
}

}  // namespace kt::ops
