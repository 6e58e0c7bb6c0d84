#include "gguf_blob.h"

#include <ATen/ATen.h>

#include <array>
#include <cstring>

#include "../cpu/engine/huge_pages.h"
#include "../cpu/formats/gguf_types.h"
#include "../cpu/formats/int_layout.h"
#include "../cpu/formats/pack_int.h"
#include "../cpu/formats/packed_header.h"
#include "checks.h"
#include "mapped_file.h"

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

at::Tensor map_gguf_experts(const std::vector<std::string>& files, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                            int64_t intermediate) {
  TORCH_CHECK_VALUE(files.size() == 3 && offsets.size() == 3, "need 3 files and 3 offsets (gate, up, down)");
  const cpu::PackedShape shape = gguf_shape(types, experts, hidden, intermediate);
  // Matrix sizes from the canonical layout (validates the types against H and I).
  const cpu::PackedLayout canonical = translate_errors([&] { return cpu::packed_layout(shape); });
  std::vector<FileRange> ranges;
  for (int m = 0; m < 3; ++m) {
    TORCH_CHECK_VALUE(offsets[m] >= 0, kNames[m], ": negative file offset ", offsets[m]);
    ranges.push_back(FileRange{files[m], static_cast<uint64_t>(offsets[m]),
                               static_cast<uint64_t>(experts) * canonical.matrix_expert_bytes[m]});
  }
  FileMapping mapping(ranges, cpu::kPackedHeaderBytes);  // the first page holds the header
  const uint64_t matrix_offsets[3] = {mapping.start(0), mapping.start(1), mapping.start(2)};
  const cpu::PackedLayout layout =
      translate_errors([&] { return cpu::gguf_layout(shape, matrix_offsets, mapping.total_bytes()); });
  cpu::write_packed_header(layout, mapping.base());
  return mapping.release(0, mapping.total_bytes());
}

namespace {

// gate, up, down as contiguous uint8 CPU tensors of exactly `layout`'s GGUF matrix bytes
// for `experts` experts (ValueError / TypeError naming the tensor otherwise).
std::array<at::Tensor, 3> checked_matrices(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                           const cpu::PackedLayout& layout, int64_t experts) {
  const at::Tensor* sources[3] = {&gate, &up, &down};
  const char* names[3] = {"gate", "up", "down"};
  std::array<at::Tensor, 3> out;
  for (int m = 0; m < 3; ++m) {
    const at::Tensor& t = *sources[m];
    check_dtype(t, names[m], {at::kByte});
    TORCH_CHECK_VALUE(t.device().is_cpu(), names[m], " must be on the CPU");
    const int64_t bytes = experts * static_cast<int64_t>(layout.matrix_expert_bytes[m]);
    TORCH_CHECK_VALUE(t.numel() == bytes, names[m], " has ", t.numel(), " bytes; ", experts,
                      " experts of its type and shape need ", bytes);
    out[m] = t.contiguous();
  }
  return out;
}

}  // namespace

at::Tensor gguf_experts_from_blocks(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                    const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                                    int64_t intermediate) {
  const cpu::PackedShape shape = gguf_shape(types, experts, hidden, intermediate);
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  const std::array<at::Tensor, 3> matrices = checked_matrices(gate, up, down, layout, experts);
  at::Tensor packed = at::zeros({static_cast<int64_t>(layout.total_bytes)}, at::TensorOptions().dtype(at::kByte));
  for (int m = 0; m < 3; ++m)
    std::memcpy(packed.data_ptr<uint8_t>() + layout.matrix_offset[m], matrices[m].const_data_ptr<uint8_t>(),
                static_cast<size_t>(matrices[m].numel()));
  cpu::write_packed_header(layout, packed.data_ptr<uint8_t>());
  return packed;
}

at::Tensor mxfp4_experts_from_blocks(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                                     int64_t experts, int64_t hidden, int64_t intermediate) {
  // The GGUF shape checks E, H, I and the row lengths (multiples of 32).
  const int64_t mxfp4 = static_cast<int64_t>(cpu::GgmlType::kMxfp4);
  const cpu::PackedShape gguf = gguf_shape({mxfp4, mxfp4, mxfp4}, experts, hidden, intermediate);
  const cpu::PackedLayout blocks = translate_errors([&] { return cpu::packed_layout(gguf); });
  const std::array<at::Tensor, 3> matrices = checked_matrices(gate, up, down, blocks, experts);
  cpu::PackedShape shape = gguf;
  shape.format = cpu::PackedFormat::kMxfp4;
  shape.group_size = cpu::int_layout::kMxfp4Group;
  shape.gguf_types[0] = shape.gguf_types[1] = shape.gguf_types[2] = 0;
  const cpu::PackedLayout layout = translate_errors([&] { return cpu::packed_layout(shape); });
  const uint8_t* data[3] = {matrices[0].const_data_ptr<uint8_t>(), matrices[1].const_data_ptr<uint8_t>(),
                            matrices[2].const_data_ptr<uint8_t>()};
  at::Tensor packed = at::empty({static_cast<int64_t>(layout.total_bytes)}, at::TensorOptions().dtype(at::kByte));
  cpu::advise_huge_pages(packed.data_ptr(), static_cast<size_t>(packed.numel()));
  translate_errors([&] { cpu::pack_mxfp4_blocks(data, layout, packed.data_ptr<uint8_t>()); });
  return packed;
}

}  // namespace kt::ops
