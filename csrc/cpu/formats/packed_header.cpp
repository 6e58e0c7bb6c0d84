#include "packed_header.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <stdexcept>
#include <string>

#include "bf16_layout.h"
#include "fp8_layout.h"
#include "gguf_types.h"
#include "int_layout.h"

namespace kt::cpu {
namespace {

// Byte offsets of the header fields (little-endian).
struct Field {
  static constexpr size_t kMagic = 0, kVersion = 8, kFormat = 12, kExperts = 16, kHidden = 20,
                          kIntermediate = 24, kGroupSize = 28, kNumaParts = 32,
                          kGateUpOffset = 40, kGateUpExpertBytes = 48, kDownOffset = 56,
                          kDownExpertBytes = 64, kTotalBytes = 72, kGgufTypes = 80,
                          kMatrixOffsets = 96, kMatrixExpertBytes = 120, kGluFlags = 144,
                          kSwigluLimit = 148, kSwigluAlpha = 152, kBiasOffset = 160, kWeightFlags = 168,
                          kChecksum = 248;
  static constexpr uint32_t kHasBiases = 1;     // kGluFlags bit
  static constexpr uint32_t kIntegerZeros = 1;  // kWeightFlags bit (int4_asym)

};

template <typename T>
void put(uint8_t* blob, size_t offset, T value) {
  std::memcpy(blob + offset, &value, sizeof(T));
}

template <typename T>
T get(const uint8_t* blob, size_t offset) {
  T value;
  std::memcpy(&value, blob + offset, sizeof(T));
  return value;
}

// FNV-1a over the header bytes before the checksum.
uint64_t header_checksum(const uint8_t* blob) {
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < Field::kChecksum; ++i) hash = (hash ^ blob[i]) * 1099511628211ull;
  return hash;
}

const char* gguf_matrix_name(int m) { return m == 0 ? "gate_proj" : m == 1 ? "up_proj" : "down_proj"; }

[[noreturn]] void corrupt(const std::string& why) {
  throw std::invalid_argument("packed experts: " + why);
}

// "32, 64 or 128": int_layout::kGroupSizes for the messages.
std::string group_size_choices() {
  std::string choices;
  const size_t count = std::size(int_layout::kGroupSizes);
  for (size_t i = 0; i < count; ++i)
    choices += (i == 0 ? "" : i + 1 == count ? " or " : ", ") + std::to_string(int_layout::kGroupSizes[i]);
  return choices;
}

// int4 formats: a group size of int_layout::kGroupSizes dividing H and I (mxfp4: 32). int8: no group
// (0); its int32 sums need H, I <= int_layout::kInt8MaxK (|sum| <= 255 * 127 * 65536 < 2^31).
void check_int_shape(const PackedShape& shape) {
  if (shape.format == PackedFormat::kInt8) {
    if (shape.group_size != 0)
      throw std::invalid_argument("format int8 is per output channel; group_size must be 0, got " +
                                  std::to_string(shape.group_size));
    if (shape.hidden_size > int_layout::kInt8MaxK || shape.intermediate_size > int_layout::kInt8MaxK)
      throw std::invalid_argument("format int8 needs H and I <= " + std::to_string(int_layout::kInt8MaxK) +
                                  " (int32 accumulation)");
    return;
  }
  const uint32_t g = shape.group_size;
  if (shape.format == PackedFormat::kMxfp4) {
    if (g != int_layout::kMxfp4Group)
      throw std::invalid_argument("format mxfp4 has one exponent per 32 weights; group_size must be 32, got " +
                                  std::to_string(g));
  } else if (std::find(std::begin(int_layout::kGroupSizes), std::end(int_layout::kGroupSizes), g) ==
             std::end(int_layout::kGroupSizes)) {
    throw std::invalid_argument("int4 formats need group_size " + group_size_choices() + ", got " +
                                std::to_string(g));
  }
  if (shape.hidden_size % g != 0 || shape.intermediate_size % g != 0)
    throw std::invalid_argument(std::string(shape.format == PackedFormat::kMxfp4 ? "format mxfp4" : "int4 formats") +
                                ": group_size " + std::to_string(g) +
                                " must divide hidden_size H = " + std::to_string(shape.hidden_size) +
                                " and intermediate_size I = " +
                                std::to_string(shape.intermediate_size));
}

// The activation's two numbers: finite and >= 0 (0: off).
void check_glu(const GluSpec& glu) {
  const auto ok = [](float v) { return v >= 0.0f && v <= 3.0e38f; };  // false for NaN, inf
  if (!ok(glu.swiglu_limit) || !ok(glu.swiglu_alpha))
    throw std::invalid_argument("swiglu_limit and swiglu_alpha must be finite and >= 0 (0: off), got limit " +
                                std::to_string(glu.swiglu_limit) + ", alpha " + std::to_string(glu.swiglu_alpha));
}

uint64_t round_up64(uint64_t v) { return (v + 63) / 64 * 64; }

// E, H, I >= 1 and < 2^31, one NUMA part, a valid GluSpec. Every size, count and offset
// a layout derives from E, H and I is at most the blob's
// bytes, which are below this bound for every format (at most 4 bytes per weight (F32)
// plus 64 per row and per 16 k of scales, biases included). Checked once, in 128-bit
// arithmetic, before any of them is computed, so none of the products below can wrap:
// a header from a file can name any E, H, I < 2^31.
constexpr unsigned __int128 kMaxBlobBytes = uint64_t{1} << 60;
void check_shape(const PackedShape& shape) {
  if (shape.num_experts == 0 || shape.hidden_size == 0 || shape.intermediate_size == 0)
    throw std::invalid_argument("packed experts need E, H and I >= 1, got E=" +
                                std::to_string(shape.num_experts) + " H=" +
                                std::to_string(shape.hidden_size) + " I=" +
                                std::to_string(shape.intermediate_size));
  constexpr uint32_t kMaxDim = 0x7fffffffu;
  if (shape.num_experts > kMaxDim || shape.hidden_size > kMaxDim || shape.intermediate_size > kMaxDim)
    throw std::invalid_argument("packed experts need E, H and I below 2^31");
  if (shape.numa_parts != 1)
    throw std::invalid_argument("numa_parts other than 1 is not supported yet, got " +
                                std::to_string(shape.numa_parts));
  check_glu(shape.glu);
  using Wide = unsigned __int128;
  const Wide E = shape.num_experts, H = shape.hidden_size, I = shape.intermediate_size;
  const Wide rows = 2 * (I + 16) + (H + 16), k = (H > I ? H : I) + 256;
  const Wide bound = E * rows * (k * 8 + 64);
  if (bound > kMaxBlobBytes)
    throw std::invalid_argument("packed experts of E=" + std::to_string(shape.num_experts) + ", H=" +
                                std::to_string(shape.hidden_size) + ", I=" + std::to_string(shape.intermediate_size) +
                                " would exceed 2^60 bytes; the header or the shape is wrong");
}

}  // namespace

uint64_t glu_bias_bytes(const PackedShape& shape) {
  if (!shape.glu.biases) return 0;
  const uint64_t I16 = (uint64_t{shape.intermediate_size} + 15) / 16 * 16,
                 H16 = (uint64_t{shape.hidden_size} + 15) / 16 * 16;
  return uint64_t{shape.num_experts} * (2 * I16 + H16) * sizeof(float);
}

PackedLayout packed_layout(const PackedShape& shape) {
  check_shape(shape);
  if (shape.format == PackedFormat::kGguf) {
    // Canonical placement: gate, up, down one after the other, each 64-byte aligned.
    uint64_t offsets[3], at = kPackedHeaderBytes;
    const uint64_t E = shape.num_experts, H = shape.hidden_size, I = shape.intermediate_size;
    const uint64_t rows[3] = {I, I, H}, cols[3] = {H, H, I};
    for (int m = 0; m < 3; ++m) {
      offsets[m] = at;
      at += round_up64(E * rows[m] * ggml_row_bytes(shape.gguf_types[m], cols[m], gguf_matrix_name(m)));
    }
    const uint64_t bias_offset = shape.glu.biases ? at : 0;
    return gguf_layout(shape, offsets, at + glu_bias_bytes(shape), bias_offset);
  }
  if (shape.integer_zeros && shape.format != PackedFormat::kInt4Asym)
    throw std::invalid_argument("integer zero points are a flag of format int4_asym only");
  PackedLayout layout;
  layout.shape = shape;
  switch (shape.format) {
    case PackedFormat::kBf16: {
      const bf16_layout::Dims dims(shape.hidden_size, shape.intermediate_size);
      layout.gate_up_expert_bytes = dims.gate_up_expert_bytes();
      layout.down_expert_bytes = dims.down_expert_bytes();
      break;
    }
    case PackedFormat::kInt8:
    case PackedFormat::kInt4:
    case PackedFormat::kInt4Asym:
    case PackedFormat::kMxfp4: {
      check_int_shape(shape);
      const int_layout::Dims dims(shape);
      layout.gate_up_expert_bytes = dims.gate_up.expert_bytes();
      layout.down_expert_bytes = dims.down.expert_bytes();
      break;
    }
    case PackedFormat::kFp8:
    case PackedFormat::kFp8PerChannel:
    case PackedFormat::kMxfp8: {
      const fp8_layout::Dims dims(shape);
      layout.gate_up_expert_bytes = dims.gate_up.expert_bytes();
      layout.down_expert_bytes = dims.down.expert_bytes();
      break;
    }
    default:
      throw std::invalid_argument("unknown packed format id " +
                                  std::to_string(static_cast<uint32_t>(shape.format)));
  }
  if ((shape.format == PackedFormat::kBf16 || fp8_layout::is_fp8(shape.format)) && shape.group_size != 0)
    throw std::invalid_argument("formats bf16, fp8, fp8_perchannel and mxfp8 take no group_size (the fp8 formats' "
                                "groups are fixed); group_size must be 0, got " +
                                std::to_string(shape.group_size));
  layout.gate_up_offset = kPackedHeaderBytes;
  layout.down_offset = layout.gate_up_offset + shape.num_experts * layout.gate_up_expert_bytes;
  layout.total_bytes = layout.down_offset + shape.num_experts * layout.down_expert_bytes;
  if (shape.glu.biases) {
    layout.bias_offset = round_up64(layout.total_bytes);
    layout.total_bytes = layout.bias_offset + glu_bias_bytes(shape);
  }
  return layout;
}

PackedLayout gguf_layout(const PackedShape& shape, const uint64_t offsets[3], uint64_t total_bytes,
                         uint64_t bias_offset) {
  if (shape.group_size != 0)
    throw std::invalid_argument("format gguf has no groups; group_size must be 0, got " +
                                std::to_string(shape.group_size));
  check_shape(shape);
  const uint64_t bias_bytes = glu_bias_bytes(shape);
  if (shape.glu.biases ? (bias_offset < kPackedHeaderBytes || bias_offset % 4 != 0 || bias_offset > total_bytes ||
                          bias_bytes > total_bytes - bias_offset)
                       : bias_offset != 0)
    throw std::invalid_argument("packed experts: gguf biases at offset " + std::to_string(bias_offset) + " (" +
                                std::to_string(bias_bytes) + " bytes) lie outside the " +
                                std::to_string(total_bytes) + "-byte blob");
  PackedLayout layout;
  layout.shape = shape;
  const uint64_t E = shape.num_experts, H = shape.hidden_size, I = shape.intermediate_size;
  const uint64_t rows[3] = {I, I, H}, cols[3] = {H, H, I};
  for (int m = 0; m < 3; ++m) {
    const uint64_t bytes = rows[m] * ggml_row_bytes(shape.gguf_types[m], cols[m], gguf_matrix_name(m));
    if (offsets[m] < kPackedHeaderBytes || offsets[m] > total_bytes || E * bytes > total_bytes - offsets[m])
      throw std::invalid_argument(std::string("packed experts: gguf ") + gguf_matrix_name(m) +
                                  " at offset " + std::to_string(offsets[m]) + " (" +
                                  std::to_string(E * bytes) + " bytes) lies outside the " +
                                  std::to_string(total_bytes) + "-byte blob");
    if (bias_bytes != 0 && bias_offset < offsets[m] + E * bytes && offsets[m] < bias_offset + bias_bytes)
      throw std::invalid_argument(std::string("packed experts: gguf biases overlap ") + gguf_matrix_name(m));
    layout.matrix_offset[m] = offsets[m];
    layout.matrix_expert_bytes[m] = bytes;
  }
  layout.bias_offset = bias_offset;
  layout.gate_up_offset = offsets[kGgufGate];
  layout.gate_up_expert_bytes = layout.matrix_expert_bytes[kGgufGate];
  layout.down_offset = offsets[kGgufDown];
  layout.down_expert_bytes = layout.matrix_expert_bytes[kGgufDown];
  layout.total_bytes = total_bytes;
  return layout;
}

void write_packed_header(const PackedLayout& layout, uint8_t* blob) {
  std::memset(blob, 0, kPackedHeaderBytes);
  std::memcpy(blob + Field::kMagic, kPackedMagic, sizeof(kPackedMagic));
  put<uint32_t>(blob, Field::kVersion, layout.shape.glu.is_default() ? kPackedVersion : kPackedGluVersion);
  put<uint32_t>(blob, Field::kFormat, static_cast<uint32_t>(layout.shape.format));
  put<uint32_t>(blob, Field::kExperts, layout.shape.num_experts);
  put<uint32_t>(blob, Field::kHidden, layout.shape.hidden_size);
  put<uint32_t>(blob, Field::kIntermediate, layout.shape.intermediate_size);
  put<uint32_t>(blob, Field::kGroupSize, layout.shape.group_size);
  put<uint32_t>(blob, Field::kNumaParts, layout.shape.numa_parts);
  put<uint64_t>(blob, Field::kGateUpOffset, layout.gate_up_offset);
  put<uint64_t>(blob, Field::kGateUpExpertBytes, layout.gate_up_expert_bytes);
  put<uint64_t>(blob, Field::kDownOffset, layout.down_offset);
  put<uint64_t>(blob, Field::kDownExpertBytes, layout.down_expert_bytes);
  put<uint64_t>(blob, Field::kTotalBytes, layout.total_bytes);
  for (int m = 0; m < 3; ++m) {
    put<uint32_t>(blob, Field::kGgufTypes + 4 * m, layout.shape.gguf_types[m]);
    put<uint64_t>(blob, Field::kMatrixOffsets + 8 * m, layout.matrix_offset[m]);
    put<uint64_t>(blob, Field::kMatrixExpertBytes + 8 * m, layout.matrix_expert_bytes[m]);
  }
  put<uint32_t>(blob, Field::kGluFlags, layout.shape.glu.biases ? Field::kHasBiases : 0);
  put<float>(blob, Field::kSwigluLimit, layout.shape.glu.swiglu_limit);
  put<float>(blob, Field::kSwigluAlpha, layout.shape.glu.swiglu_alpha);
  put<uint64_t>(blob, Field::kBiasOffset, layout.bias_offset);
  put<uint32_t>(blob, Field::kWeightFlags, layout.shape.integer_zeros ? Field::kIntegerZeros : 0);
  put<uint64_t>(blob, Field::kChecksum, header_checksum(blob));
}

PackedLayout read_packed_header(const uint8_t* blob, size_t blob_bytes) {
  if (blob_bytes < kPackedHeaderBytes)
    corrupt("blob has " + std::to_string(blob_bytes) + " bytes, less than the " +
            std::to_string(kPackedHeaderBytes) + "-byte header");
  if (std::memcmp(blob, kPackedMagic, sizeof(kPackedMagic)) != 0)
    corrupt("bad magic: this tensor was not made by kt_ops.pack_experts");
  const uint32_t version = get<uint32_t>(blob, Field::kVersion);
  if (version != kPackedVersion && version != kPackedGluVersion)
    corrupt("header version " + std::to_string(version) + ", this build reads versions " +
            std::to_string(kPackedVersion) + " and " + std::to_string(kPackedGluVersion) + "; repack the weights");
  if (get<uint64_t>(blob, Field::kChecksum) != header_checksum(blob))
    corrupt("header checksum mismatch (corrupted header)");
  PackedShape shape;
  shape.format = static_cast<PackedFormat>(get<uint32_t>(blob, Field::kFormat));
  shape.num_experts = get<uint32_t>(blob, Field::kExperts);
  shape.hidden_size = get<uint32_t>(blob, Field::kHidden);
  shape.intermediate_size = get<uint32_t>(blob, Field::kIntermediate);
  shape.group_size = get<uint32_t>(blob, Field::kGroupSize);
  shape.numa_parts = get<uint32_t>(blob, Field::kNumaParts);
  uint64_t offsets[3];
  for (int m = 0; m < 3; ++m) {
    shape.gguf_types[m] = get<uint32_t>(blob, Field::kGgufTypes + 4 * m);
    offsets[m] = get<uint64_t>(blob, Field::kMatrixOffsets + 8 * m);
  }
  const uint32_t glu_flags = get<uint32_t>(blob, Field::kGluFlags);
  if ((glu_flags & ~Field::kHasBiases) != 0) corrupt("unknown activation flags " + std::to_string(glu_flags));
  shape.glu.biases = (glu_flags & Field::kHasBiases) != 0;
  shape.glu.swiglu_limit = get<float>(blob, Field::kSwigluLimit);
  shape.glu.swiglu_alpha = get<float>(blob, Field::kSwigluAlpha);
  const uint64_t bias_offset = get<uint64_t>(blob, Field::kBiasOffset);
  // A build from before the weight flags reads a blob with them as it always did: the flag
  // only lets the kernels take an exact shortcut (PackedShape::integer_zeros).
  const uint32_t weight_flags = get<uint32_t>(blob, Field::kWeightFlags);
  if ((weight_flags & ~Field::kIntegerZeros) != 0) corrupt("unknown weight flags " + std::to_string(weight_flags));
  shape.integer_zeros = (weight_flags & Field::kIntegerZeros) != 0;
  if (shape.integer_zeros && shape.format != PackedFormat::kInt4Asym)
    corrupt("the integer-zero-point flag is set on a format other than int4_asym");
  if ((version == kPackedVersion) != shape.glu.is_default())
    corrupt("header version " + std::to_string(version) + " disagrees with its activation fields");
  const PackedLayout layout =
      shape.format == PackedFormat::kGguf
          ? gguf_layout(shape, offsets, get<uint64_t>(blob, Field::kTotalBytes), bias_offset)
          : packed_layout(shape);
  if (layout.bias_offset != bias_offset) corrupt("header bias offset disagrees with its shape");
  for (int m = 0; m < 3; ++m)
    if (layout.matrix_offset[m] != offsets[m] ||
        layout.matrix_expert_bytes[m] != get<uint64_t>(blob, Field::kMatrixExpertBytes + 8 * m))
      corrupt("header gguf matrix fields disagree with its shape");
  if (layout.gate_up_offset != get<uint64_t>(blob, Field::kGateUpOffset) ||
      layout.gate_up_expert_bytes != get<uint64_t>(blob, Field::kGateUpExpertBytes) ||
      layout.down_offset != get<uint64_t>(blob, Field::kDownOffset) ||
      layout.down_expert_bytes != get<uint64_t>(blob, Field::kDownExpertBytes) ||
      layout.total_bytes != get<uint64_t>(blob, Field::kTotalBytes))
    corrupt("header offsets disagree with its shape (E, H, I, format)");
  if (blob_bytes != layout.total_bytes)
    corrupt("blob has " + std::to_string(blob_bytes) + " bytes, its header says " +
            std::to_string(layout.total_bytes) + " (truncated or padded)");
  return layout;
}

}  // namespace kt::cpu
