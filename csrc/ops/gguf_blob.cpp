#include "gguf_blob.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "../cpu/formats/packed_header.h"
#include "checks.h"

namespace kt::ops {
namespace {

constexpr const char* kNames[3] = {"gate (ffn_gate_exps)", "up (ffn_up_exps)", "down (ffn_down_exps)"};

}  // namespace

cpu::PackedShape gguf_shape(const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                            int64_t intermediate) {
  TORCH_CHECK_VALUE(types.size() == 3, "need 3 ggml type ids (gate, up, down), got ", types.size());
  constexpr int64_t kMaxDim = int64_t{1} << 31;
  TORCH_CHECK_VALUE(experts > 0 && hidden > 0 && intermediate > 0 && experts < kMaxDim &&
                        hidden < kMaxDim && intermediate < kMaxDim,
                    "experts, hidden and intermediate must be in [1, 2^31); got ", experts, ", ", hidden,
                    ", ", intermediate);
  cpu::PackedShape shape;
  shape.format = cpu::PackedFormat::kGguf;
  shape.num_experts = static_cast<uint32_t>(experts);
  shape.hidden_size = static_cast<uint32_t>(hidden);
  shape.intermediate_size = static_cast<uint32_t>(intermediate);
  for (int m = 0; m < 3; ++m) {
    TORCH_CHECK_VALUE(types[m] >= 0 && types[m] < 1024, "ggml type id ", types[m], " is out of range");
    shape.gguf_types[m] = static_cast<uint32_t>(types[m]);
  }
  return shape;
}

namespace {

// The reserved address range of a mapped blob; unmapping it releases every mapping in it.
struct Mapping {
  void* base = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, bytes);
  }
};

}  // namespace

at::Tensor map_gguf_experts(const std::vector<std::string>& files, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                            int64_t intermediate) {
  TORCH_CHECK_VALUE(files.size() == 3 && offsets.size() == 3, "need 3 files and 3 offsets (gate, up, down)");
  const cpu::PackedShape shape = gguf_shape(types, experts, hidden, intermediate);
  // Matrix sizes from the canonical layout (validates the types against H and I).
  const cpu::PackedLayout canonical = translate_errors([&] { return cpu::packed_layout(shape); });
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t span[3], delta[3], total = page;  // the first page holds the header
  for (int m = 0; m < 3; ++m) {
    TORCH_CHECK_VALUE(offsets[m] >= 0, kNames[m], ": negative file offset ", offsets[m]);
    const uint64_t bytes = experts * canonical.matrix_expert_bytes[m];
    delta[m] = static_cast<uint64_t>(offsets[m]) % page;
    span[m] = (delta[m] + bytes + page - 1) / page * page;
    total += span[m];
  }
  Mapping mapping;
  mapping.bytes = total;
  mapping.base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mapping.base != MAP_FAILED, "mmap of ", total, " bytes failed: ", std::strerror(errno));
  uint8_t* base = static_cast<uint8_t*>(mapping.base);
  uint64_t matrix_offsets[3], at = page;
  for (int m = 0; m < 3; ++m) {
    const uint64_t bytes = experts * canonical.matrix_expert_bytes[m];
    const int fd = open(files[m].c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      throw std::system_error(error, std::generic_category(), "cannot open GGUF file " + files[m]);
    }
    struct stat info;
    const bool stat_ok = fstat(fd, &info) == 0;
    const uint64_t file_bytes = stat_ok ? static_cast<uint64_t>(info.st_size) : 0;
    if (!stat_ok || static_cast<uint64_t>(offsets[m]) + bytes > file_bytes) {
      close(fd);
      TORCH_CHECK_VALUE(false, "GGUF file ", files[m], " is truncated: ", kNames[m], " needs bytes [",
                        offsets[m], ", ", offsets[m] + bytes, ") but the file has ", file_bytes, " bytes");
    }
    void* placed = mmap(base + at, span[m], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
                        static_cast<off_t>(offsets[m] - delta[m]));
    const int error = errno;
    close(fd);
    TORCH_CHECK(placed != MAP_FAILED, "mmap of ", files[m], " failed: ", std::strerror(error));
    matrix_offsets[m] = at + delta[m];
    at += span[m];
  }
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::gguf_layout(shape, matrix_offsets, total); });
  cpu::write_packed_header(layout, base);
  void* owned = mapping.base;
  const size_t owned_bytes = mapping.bytes;
  mapping.base = MAP_FAILED;  // the tensor's deleter unmaps from here on
  return at::from_blob(
      owned, {static_cast<int64_t>(total)}, [owned_bytes](void* p) { munmap(p, owned_bytes); },
      at::TensorOptions().dtype(at::kByte));
}

at::Tensor gguf_experts_from_blocks(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                    const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                                    int64_t intermediate) {
  const cpu::PackedShape shape = gguf_shape(types, experts, hidden, intermediate);
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  at::Tensor packed = at::zeros({static_cast<int64_t>(layout.total_bytes)}, at::TensorOptions().dtype(at::kByte));
  const at::Tensor* sources[3] = {&gate, &up, &down};
  const char* names[3] = {"gate", "up", "down"};
  for (int m = 0; m < 3; ++m) {
    const at::Tensor& t = *sources[m];
    check_dtype(t, names[m], {at::kByte});
    TORCH_CHECK_VALUE(t.device().is_cpu(), names[m], " must be on the CPU");
    const int64_t bytes = experts * static_cast<int64_t>(layout.matrix_expert_bytes[m]);
    TORCH_CHECK_VALUE(t.numel() == bytes, names[m], " has ", t.numel(), " bytes; ", experts,
                      " experts of its type and shape need ", bytes);
    std::memcpy(packed.data_ptr<uint8_t>() + layout.matrix_offset[m], t.contiguous().const_data_ptr<uint8_t>(),
                static_cast<size_t>(bytes));
  }
  cpu::write_packed_header(layout, packed.data_ptr<uint8_t>());
  return packed;
}

}  // namespace kt::ops
