#include "dequantize_experts.h"

#include <algorithm>
#include <stdexcept>

#include "../engine/engine.h"
#include "../engine/scratch.h"
#include "../isa/scalar_convert.h"

namespace kt::cpu {

void dequantize_experts(DequantizeRowsFn dequantize_rows, const uint8_t* blob, const PackedLayout& layout,
                        const int64_t* experts, int64_t n, ElementType out_type, void* gate, void* up,
                        void* down) {
  if (out_type == ElementType::kF16)
    throw std::invalid_argument("dequantize_experts writes float32 or bfloat16, not float16");
  const int64_t H = layout.shape.hidden_size, I = layout.shape.intermediate_size;
  const int64_t gate_jobs = (I + kDequantizeJobRows - 1) / kDequantizeJobRows;
  const int64_t down_jobs = (H + kDequantizeJobRows - 1) / kDequantizeJobRows;
  const int64_t expert_jobs = 2 * gate_jobs + down_jobs;  // gate 0, up 0, gate 1, up 1, ..., down
  const bool bf16 = out_type == ElementType::kBf16;
  const size_t element = bf16 ? 2 : 4;
  Engine::instance().parallel_for(n * expert_jobs, [&](int64_t job) {
    const int64_t slot = job / expert_jobs, j = job % expert_jobs;
    const bool down_job = j >= 2 * gate_jobs;
    const ExpertMatrix matrix = down_job ? ExpertMatrix::kDown : j % 2 == 0 ? ExpertMatrix::kGate : ExpertMatrix::kUp;
    const int64_t rows = down_job ? H : I, k = down_job ? I : H;
    const int64_t row_begin = (down_job ? j - 2 * gate_jobs : j / 2) * kDequantizeJobRows;
    const int64_t row_end = std::min(row_begin + kDequantizeJobRows, rows);
    void* base = matrix == ExpertMatrix::kGate ? gate : matrix == ExpertMatrix::kUp ? up : down;
    uint8_t* target = static_cast<uint8_t*>(base) + (slot * rows + row_begin) * k * element;
    if (!bf16) {
      dequantize_rows(blob, layout, matrix, experts[slot], row_begin, row_end, reinterpret_cast<float*>(target));
      return;
    }
    const int64_t count = (row_end - row_begin) * k;
    ScratchLease scratch(static_cast<size_t>(count) * sizeof(float));
    auto* rows_f32 = reinterpret_cast<float*>(scratch.data());
    dequantize_rows(blob, layout, matrix, experts[slot], row_begin, row_end, rows_f32);
    auto* out = reinterpret_cast<uint16_t*>(target);
    for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(rows_f32[i]);
  });
}

void dequantize_expert_rows(DequantizeRowsFn dequantize_rows, const uint8_t* blob, const PackedLayout& layout,
                            ExpertMatrix matrix, int64_t expert, int64_t row_begin, int64_t row_end, float* out) {
  const int64_t K = matrix_cols(layout, matrix);
  const int64_t first_block = row_begin / kDequantizeJobRows;
  const int64_t blocks = (row_end + kDequantizeJobRows - 1) / kDequantizeJobRows - first_block;
  Engine::instance().parallel_for(blocks, [&](int64_t job) {
    const int64_t begin = std::max(row_begin, (first_block + job) * kDequantizeJobRows);
    const int64_t end = std::min(row_end, (first_block + job + 1) * kDequantizeJobRows);
    dequantize_rows(blob, layout, matrix, expert, begin, end, out + (begin - row_begin) * K);
  });
}

}  // namespace kt::cpu
