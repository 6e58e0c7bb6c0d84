// [NOTE] The packed-experts blob: one uint8 tensor per MoE layer.
//   [0, 256)                  PackedHeader (little-endian, checksummed)
//   [gate_up_offset, ...)     E experts x gate_up_expert_bytes  (kernel-ready blocks)
//   [down_offset, ...)        E experts x down_expert_bytes
//   [bias_offset, ...)        optional expert biases, fp32: gate [E, I16], up [E, I16],
//                             down [E, H16] (I16, H16: I, H rounded up to 16, zero-padded)
// The header also holds the layer's activation (GluSpec): silu(g) * u by default, the
// clamped variant (DeepSeek-V4) or the alpha-SwiGLU (gpt-oss). A blob with a non-default
// activation or biases has header version 2, so a build that predates them refuses it
// instead of computing the plain SwiGLU.
// The gguf format instead holds three matrices (gate, up, down) as GGUF stores them,
// each at its own offset (a memory-mapped blob places them where the file's pages
// land, so their offsets need not be multiples of 64).
// The header makes a blob self-describing: a kernel refuses a blob whose magic,
// version, checksum, format or sizes disagree with the call, instead of computing
// garbage from it. Offsets are multiples of 64 bytes from the blob start.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kt::cpu {

// Weight formats: the id a header stores. Each has one row in the format table
// (../format_table.h: name, methods, packer, kernels ...) and a layout here
// (bf16_layout.h, int_layout.h, fp8_layout.h, gguf_types.h); docs/formats.md describes them.
enum class PackedFormat : uint32_t {
  kBf16 = 1,       // bf16
  kInt8 = 2,       // int8, symmetric per output channel
  kInt4 = 3,       // int4, symmetric per k-group
  kInt4Asym = 4,   // int4 with a per-group minimum (zero point)
  kGguf = 5,       // GGUF blocks, a ggml type per matrix (formats/gguf_types.h)
  kFp8 = 6,        // e4m3 with fp32 scales per 128 x 128 block (fp8_layout.h)
  kFp8PerChannel = 7,  // e4m3 with an fp32 scale per output row
  kMxfp8 = 8,      // e4m3 with a ue8m0 exponent per 32 weights along k (OCP MXFP8)
  kMxfp4 = 9,      // e2m1 codes in the INT4 lines, a bf16 power-of-two scale per 32 k (OCP MXFP4)
};

constexpr char kPackedMagic[8] = {'K', 'T', 'O', 'P', 'S', 'P', 'K', '\0'};
constexpr uint32_t kPackedVersion = 1;      // blobs with the default activation, no biases
constexpr uint32_t kPackedGluVersion = 2;   // with a GluSpec other than the default
constexpr size_t kPackedHeaderBytes = 256;

// The activation between gate/up and down, chosen as kt-kernel chooses it:
//   swiglu_alpha == 0, swiglu_limit == 0: h = silu(g) * u
//   swiglu_alpha == 0, swiglu_limit = L > 0: g = min(g, L), u = clamp(u, -L, L), h = silu(g) * u
//   swiglu_alpha = a > 0: g = min(g, L) and u = clamp(u, -L, L) if L > 0,
//                         h = g * sigmoid(a * g) * (u + 1)        (gpt-oss: a = 1.702, L = 7)
// g and u include the biases (gate_bias, up_bias) when the blob has them; down's bias is
// added to down's output before the routing weight.
struct GluSpec {
  float swiglu_limit = 0.0f;
  float swiglu_alpha = 0.0f;
  bool biases = false;  // the blob holds gate, up and down biases (bias_offset)
  bool is_default() const { return swiglu_limit == 0.0f && swiglu_alpha == 0.0f && !biases; }
};

struct PackedShape {
  PackedFormat format = PackedFormat::kBf16;
  uint32_t num_experts = 0;
  uint32_t hidden_size = 0;
  uint32_t intermediate_size = 0;
  uint32_t group_size = 0;  // int4 formats: one of int_layout::kGroupSizes dividing H and I; mxfp4: 32; else 0
  uint32_t numa_parts = 1;  // parts the intermediate dimension is split into (1: none)
  uint32_t gguf_types[3] = {0, 0, 0};  // gguf: ggml type ids of gate, up, down
  GluSpec glu;
  // int4_asym only: every minimum is -z * scale for an integer zero point z in
  // [0, kMaxIntegerZero] and a normal scale below 2^64, or both are 0 (AWQ, GPTQ with zero
  // points, online round-to-nearest; the packers check and set it: mark_integer_zeros).
  // w = scale * q + minimum either way; with the flag the kernels compute
  // scale * sum (q - z) a as one exact integer sum per group (int_layout.h).
  bool integer_zeros = false;
};
constexpr int kMaxIntegerZero = 16;

// Bytes of the bias region of `shape` (0 without biases): E * (2 * I16 + H16) fp32.
uint64_t glu_bias_bytes(const PackedShape& shape);

// Index of a gguf matrix in PackedShape::gguf_types and PackedLayout::matrix_*.
enum GgufMatrixIndex { kGgufGate = 0, kGgufUp = 1, kGgufDown = 2 };

struct PackedLayout {
  PackedShape shape;
  uint64_t gate_up_offset = 0;
  uint64_t gate_up_expert_bytes = 0;
  uint64_t down_offset = 0;
  uint64_t down_expert_bytes = 0;
  uint64_t total_bytes = 0;
  // gguf: blob offset and per-expert bytes of gate [E, I, H], up [E, I, H], down [E, H, I].
  uint64_t matrix_offset[3] = {0, 0, 0};
  uint64_t matrix_expert_bytes[3] = {0, 0, 0};
  uint64_t bias_offset = 0;  // the biases (shape.glu.biases), else 0
};

// Throws std::invalid_argument for impossible shapes (zero sizes, unknown format id, a
// group size the format does not allow or that does not divide H and I).
PackedLayout packed_layout(const PackedShape& shape);

// A gguf layout whose matrices start at `offsets` in a blob of `total_bytes` bytes (and
// whose biases, if shape.glu.biases, start at bias_offset). Throws std::invalid_argument
// if a type is unsupported, a row length is not a multiple of its type's block, or a
// matrix or the biases overlap the header or run past the end.
PackedLayout gguf_layout(const PackedShape& shape, const uint64_t offsets[3], uint64_t total_bytes,
                         uint64_t bias_offset = 0);

// Writes the 256-byte header of `layout` at `blob`.
void write_packed_header(const PackedLayout& layout, uint8_t* blob);

// Parses and validates a blob of `blob_bytes` bytes. Throws std::invalid_argument with
// the reason (too small, bad magic, version, checksum, sizes) on any mismatch.
PackedLayout read_packed_header(const uint8_t* blob, size_t blob_bytes);

}  // namespace kt::cpu
