// Memory-mapped weight files and the check that they are still the files that were
// loaded. A blob mapped from a file reads the file's pages on every call; if the file
// shrinks after loading, touching a page past its new end raises SIGBUS, and if it is
// overwritten in place the kernels silently read the new bytes. Every mapping made here
// keeps its files' descriptors open with their identity (device, inode, size, mtime) at
// load time, and `changed_mapped_file` compares them with one fstat per file before a
// call uses the blob. A file truncated *during* a call is not caught (no mmap reader
// can catch that without a signal handler); replacing a file by rename is harmless (the
// held inode stays intact) and is not reported.
#pragma once

#include <ATen/core/Tensor.h>
#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kt::ops {

// One file range to map: bytes [offset, offset + bytes) of `path`.
struct FileRange {
  std::string path;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// A private (copy-on-write, PROT_READ | PROT_WRITE) mapping: `lead_bytes` of anonymous
// zeros (rounded up to a page; e.g. room for a header) followed by each range on its own
// pages. The constructor opens each file once, checks it holds its range (ValueError
// naming the file when it is too short or the range overflows) and maps it; RuntimeError
// when a file cannot be opened or mapped. Until `release` the object owns the mapping
// and the descriptors (freed by the destructor).
class FileMapping {
 public:
  FileMapping(const std::vector<FileRange>& ranges, uint64_t lead_bytes);
  ~FileMapping();
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t total_bytes() const { return total_; }
  // Where range i's first byte lies, in bytes from base().
  uint64_t start(size_t i) const { return starts_[i]; }

  // uint8 [bytes] at base() + begin, owning the whole mapping and the descriptors:
  // registered for `changed_mapped_file` until the tensor's storage is freed.
  at::Tensor release(uint64_t begin, uint64_t bytes);

 private:
  uint8_t* base_ = nullptr;
  uint64_t total_ = 0;
  std::vector<uint64_t> starts_;
  std::vector<std::string> paths_;
  std::vector<int> fds_;
  std::vector<struct stat> loaded_;  // each file's fstat when it was mapped
};

// uint8 [bytes]: bytes [offset, offset + bytes) of `path`, mapped copy-on-write (any
// offset) and registered.
at::Tensor map_file(const std::string& path, int64_t offset, int64_t bytes);

// Empty when `data` is not inside a registered mapping or when every file of its
// mapping still has the size, inode and modification time it had when mapped; else a
// message naming the file and what changed. Cheap when nothing is mapped (one atomic
// load), one fstat per file of the mapping otherwise. Never throws.
std::string changed_mapped_file(const void* data) noexcept;

// Throws RuntimeError with `changed_mapped_file`'s message when it is not empty.
void check_mapped_file(const void* data);

}  // namespace kt::ops
