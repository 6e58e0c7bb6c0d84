// [NOTE] Dequantizing packed experts: chosen experts of a packed blob of any format back
// as Hugging Face weights, gate [n, I, H], up [n, I, H], down [n, H, I], padding dropped:
// the values the MoE kernels multiply, as kt_ops.reference.dequantize decodes them, bit
// for bit. The fine-tuning backward (its GEMMs on the frozen base weights), GPU-slot
// refills and staging read experts this way.
//
// Each format has one "dequantize rows" micro-kernel, a column of the format table
// (../format_table.h; dequantize_bf16.h, dequantize_int.h, dequantize_fp8.h,
// dequantize_gguf.h): a row range of one matrix of one expert -> fp32 rows. Each decodes
// with the oracle's operations in the oracle's order (two roundings where it rounds
// twice, as int4_asym's q * scale + minimum), in plain C++ compiled for baseline x86-64,
// which has no FMA to fuse them. The BF16, INT8/INT4 and FP8 decoders also have an AVX2
// path (target attribute, taken when the CPU has AVX2; transpose_avx2.h) for whole 8- or
// 16-row stretches, with the same operations (no FMA either): the same bits.
// dequantize_experts runs them on the Engine, one job per (expert slot, matrix,
// kDequantizeJobRows rows).
#pragma once

#include <cstdint>

#include "../isa/element_type.h"
#include "packed_header.h"

namespace kt::cpu {

enum class ExpertMatrix : uint8_t { kGate = 0, kUp = 1, kDown = 2 };

// Rows [row_begin, row_end) of `matrix` of expert `expert` of a blob laid out as `layout`
// (gate and up: I rows of K = H weights; down: H rows of K = I) -> fp32
// out[(r - row_begin) * K + k] for k < K. Every format's micro-kernel has this signature.
using DequantizeRowsFn = void (*)(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix,
                                  int64_t expert, int64_t row_begin, int64_t row_end, float* out);

// Where a "dequantize rows" micro-kernel writes: element (i, k) of its rows (i counted from
// its first row) at base[i * row_stride + (k / 16) * panel_stride + k % 16]. Row-major rows
// of K floats are {out, K, 16}; rows [r, ...) of a panel-packed matrix of R rows
// (kernels/panel_gemm.h: 16-column panels, the training backward's GEMM operand) are
// {panel + 16 r, 16, 16 R}. Writers store at most 8 consecutive k at a time, starting at a
// multiple of 8, so a store never crosses a panel.
struct RowsOut {
  float* base;
  int64_t row_stride;
  int64_t panel_stride;

  static RowsOut row_major(float* out, int64_t k) { return {out, k, 16}; }
  static RowsOut panels(float* panel, int64_t rows, int64_t first_row) { return {panel + 16 * first_row, 16, 16 * rows}; }
  float* at(int64_t i, int64_t k) const { return base + i * row_stride + (k >> 4) * panel_stride + (k & 15); }
};

// The same decode as DequantizeRowsFn, written through a RowsOut: the format table's
// optional "dequantize rows to" column (nullptr: row-major only, and callers that want
// panels pack the rows themselves).
using DequantizeRowsToFn = void (*)(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix,
                                    int64_t expert, int64_t row_begin, int64_t row_end, const RowsOut& out);

// Rows and columns (K, weights per row) of `matrix`: gate and up [I, H], down [H, I].
inline int64_t matrix_rows(const PackedLayout& layout, ExpertMatrix matrix) {
  return matrix == ExpertMatrix::kDown ? layout.shape.hidden_size : layout.shape.intermediate_size;
}
inline int64_t matrix_cols(const PackedLayout& layout, ExpertMatrix matrix) {
  return matrix == ExpertMatrix::kDown ? layout.shape.intermediate_size : layout.shape.hidden_size;
}

// A "dequantize rows to" micro-kernel writing row-major rows: what a format's plain
// DequantizeRowsFn does when it has a RowsOut writer.
inline void dequantize_row_major(DequantizeRowsToFn to, const uint8_t* blob, const PackedLayout& layout,
                                 ExpertMatrix matrix, int64_t expert, int64_t row_begin, int64_t row_end,
                                 float* out) {
  to(blob, layout, matrix, expert, row_begin, row_end, RowsOut::row_major(out, matrix_cols(layout, matrix)));
}

// Rows per job: the 16-row block of the bf16, int and fp8 layouts, so a job decodes one
// block (gate and up blocks alternate in job order, as they do in the blob).
constexpr int64_t kDequantizeJobRows = 16;

// The 16-row block holding row r of `matrix` of `expert` in the bf16, int and fp8 layouts,
// whose blocks are `block_bytes` long: gate_up block 2b holds gate rows [16b, 16b + 16),
// block 2b + 1 the same rows of up; down block b holds rows [16b, 16b + 16).
inline const uint8_t* row_block(const uint8_t* blob, const PackedLayout& layout, ExpertMatrix matrix, int64_t expert,
                                int64_t r, size_t block_bytes) {
  const bool down = matrix == ExpertMatrix::kDown;
  const uint8_t* first = down ? blob + layout.down_offset + expert * layout.down_expert_bytes
                              : blob + layout.gate_up_offset + expert * layout.gate_up_expert_bytes;
  const int64_t block = down ? r / kDequantizeJobRows : 2 * (r / kDequantizeJobRows) + (matrix == ExpertMatrix::kUp);
  return first + block * block_bytes;
}

// experts[0, n): expert ids in [0, E) (the caller checks them; repeats allowed). gate, up:
// [n, I, H] and down: [n, H, I] row-major of `out_type`, kF32 or kBf16 (fp32 rounded to
// the nearest bf16, ties to even); throws std::invalid_argument for kF16.
void dequantize_experts(DequantizeRowsFn dequantize_rows, const uint8_t* blob, const PackedLayout& layout,
                        const int64_t* experts, int64_t n, ElementType out_type, void* gate, void* up,
                        void* down);

// Rows [row_begin, row_end) of `matrix` of `expert` -> fp32 out[(r - row_begin) * K + k]
// (K = H for gate and up, I for down), decoded on the Engine in jobs of the 16-row blocks
// they touch: what the training backward multiplies a chunk at a time, so the fp32 rows
// stay in cache.
void dequantize_expert_rows(DequantizeRowsFn dequantize_rows, const uint8_t* blob, const PackedLayout& layout,
                            ExpertMatrix matrix, int64_t expert, int64_t row_begin, int64_t row_end, float* out);

}  // namespace kt::cpu
