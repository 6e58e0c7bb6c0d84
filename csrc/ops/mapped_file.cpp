#include "mapped_file.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <system_error>

namespace kt::ops {
namespace {

// A file held open by a registered mapping, with what fstat said when it was mapped.
struct HeldFile {
  std::string path;
  int fd = -1;
  struct stat loaded {};
};

struct Registered {
  uintptr_t end = 0;
  std::vector<HeldFile> files;
};

std::mutex registry_mutex;
std::map<uintptr_t, Registered> registry;  // keyed by the mapping's first byte
std::atomic<int> registered_count{0};

bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
         a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec;
}

std::string describe_change(const HeldFile& file, const struct stat& now) {
  std::ostringstream out;
  out << "weight file '" << file.path << "' changed on disk after it was memory-mapped (";
  if (now.st_size != file.loaded.st_size) {
    out << "size " << file.loaded.st_size << " -> " << now.st_size << " bytes";
  } else {
    out << "modified in place, same size";
  }
  out << "): the packed experts mapped from it are no longer the weights that were loaded and validated."
         " Load the file again, or load it with copy=True to keep a private copy in RAM";
  return out.str();
}

uint64_t page_bytes() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

uint64_t round_up(uint64_t n, uint64_t page) { return (n + page - 1) / page * page; }

}  // namespace

FileMapping::FileMapping(const std::vector<FileRange>& ranges, uint64_t lead_bytes) {
  const uint64_t page = page_bytes();
  constexpr uint64_t kMaxBytes = uint64_t{1} << 60;
  TORCH_CHECK_VALUE(lead_bytes <= kMaxBytes, "lead_bytes ", lead_bytes, " is too large");
  std::vector<uint64_t> file_of(ranges.size());
  std::vector<struct stat> stats;
  try {
    // Open each file once and check its ranges before reserving any address space.
    for (size_t i = 0; i < ranges.size(); ++i) {
      const FileRange& r = ranges[i];
      size_t f = 0;
      while (f < paths_.size() && paths_[f] != r.path) ++f;
      if (f == paths_.size()) {
        const int fd = open(r.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
          const int error = errno;
          throw std::system_error(error, std::generic_category(), "cannot open weight file " + r.path);
        }
        fds_.push_back(fd);
        paths_.push_back(r.path);
        stats.emplace_back();
        if (fstat(fd, &stats.back()) != 0) {
          const int error = errno;
          throw std::system_error(error, std::generic_category(), "cannot stat weight file " + r.path);
        }
      }
      file_of[i] = f;
      const uint64_t size = static_cast<uint64_t>(stats[f].st_size);
      TORCH_CHECK_VALUE(r.bytes <= kMaxBytes && r.offset <= size && r.bytes <= size - r.offset,
                        "weight file ", r.path, " is truncated: it has ", size, " bytes but bytes [", r.offset,
                        ", ", r.offset, " + ", r.bytes, ") are needed");
    }
    total_ = round_up(lead_bytes, page);
    for (const FileRange& r : ranges) {
      const uint64_t delta = r.offset % page;
      starts_.push_back(total_ + delta);
      total_ += round_up(delta + r.bytes, page);
      TORCH_CHECK_VALUE(total_ <= kMaxBytes, "the mapping would exceed 2^60 bytes");
    }
    if (total_ == 0) total_ = page;  // mmap refuses an empty mapping
    void* reserved = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(reserved != MAP_FAILED, "mmap of ", total_, " bytes failed: ", std::strerror(errno));
    base_ = static_cast<uint8_t*>(reserved);
    for (size_t i = 0; i < ranges.size(); ++i) {
      const FileRange& r = ranges[i];
      if (r.bytes == 0) continue;
      const uint64_t delta = r.offset % page;
      void* placed = mmap(base_ + starts_[i] - delta, round_up(delta + r.bytes, page), PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_FIXED, fds_[file_of[i]], static_cast<off_t>(r.offset - delta));
      TORCH_CHECK(placed != MAP_FAILED, "mmap of ", r.path, " failed: ", std::strerror(errno));
    }
  } catch (...) {
    if (base_ != nullptr) munmap(base_, total_);
    for (int fd : fds_) close(fd);
    throw;
  }
  // Identity of each file as mapped (kept in the same order as fds_).
  loaded_ = std::move(stats);
}

FileMapping::~FileMapping() {
  if (base_ != nullptr) munmap(base_, total_);
  for (int fd : fds_) close(fd);
}

at::Tensor FileMapping::release(uint64_t begin, uint64_t bytes) {
  TORCH_CHECK(base_ != nullptr, "FileMapping::release called twice");
  TORCH_CHECK(begin <= total_ && bytes <= total_ - begin, "range outside the mapping");
  Registered entry;
  entry.end = reinterpret_cast<uintptr_t>(base_) + total_;
  for (size_t f = 0; f < fds_.size(); ++f) entry.files.push_back(HeldFile{paths_[f], fds_[f], loaded_[f]});
  const uintptr_t key = reinterpret_cast<uintptr_t>(base_);
  void* const base = base_;
  const uint64_t total = total_;
  {
    const std::lock_guard<std::mutex> lock(registry_mutex);
    registry[key] = std::move(entry);
    registered_count.fetch_add(1, std::memory_order_release);
  }
  base_ = nullptr;
  fds_.clear();
  auto release_mapping = [key, base, total](void*) {
    Registered gone;
    {
      const std::lock_guard<std::mutex> lock(registry_mutex);
      auto it = registry.find(key);
      if (it != registry.end()) {
        gone = std::move(it->second);
        registry.erase(it);
        registered_count.fetch_sub(1, std::memory_order_release);
      }
    }
    for (const HeldFile& file : gone.files) close(file.fd);
    munmap(base, total);
  };
  try {
    return at::from_blob(static_cast<uint8_t*>(base) + begin, {static_cast<int64_t>(bytes)}, release_mapping,
                         at::TensorOptions().dtype(at::kByte));
  } catch (...) {
    release_mapping(nullptr);
    throw;
  }
}

at::Tensor map_file(const std::string& path, int64_t offset, int64_t bytes) {
  TORCH_CHECK_VALUE(offset >= 0 && bytes >= 0, "offset and bytes must be >= 0; got ", offset, " and ", bytes);
  FileMapping mapping({FileRange{path, static_cast<uint64_t>(offset), static_cast<uint64_t>(bytes)}}, 0);
  return mapping.release(mapping.start(0), static_cast<uint64_t>(bytes));
}

std::string changed_mapped_file(const void* data) noexcept {
  if (registered_count.load(std::memory_order_acquire) == 0) return {};
  try {
    const uintptr_t p = reinterpret_cast<uintptr_t>(data);
    const std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.upper_bound(p);
    if (it == registry.begin()) return {};
    --it;
    if (p >= it->second.end) return {};
    for (const HeldFile& file : it->second.files) {
      struct stat now {};
      if (fstat(file.fd, &now) != 0) {
        return "cannot stat weight file '" + file.path + "': " + std::strerror(errno);
      }
      if (!same_file(file.loaded, now)) return describe_change(file, now);
    }
    return {};
  } catch (const std::exception& e) {
    return std::string("checking the mapped weight files failed: ") + e.what();
  }
}

void check_mapped_file(const void* data) {
  const std::string changed = changed_mapped_file(data);
  TORCH_CHECK(changed.empty(), changed);
}

}  // namespace kt::ops
