// [NOTE] The fp32 GEMM of the training backward: c [m, k] += a [m, n] b [n, k], with b
// (an expert's dequantized weights, n = their rows) in 16-column panels. The backward's
// big products (G Wd, dg Wg, du Wu: kt::moe_train_backward, kt::moe_backward,
// kt::moe_lora_backward) contract over the weights' rows, a few dozen token rows at a
// time; ATen's sgemm re-packs b for each such call. In a standalone loop on one Zen 3 core
// (2026-11-26, AVX2, b already in panels) this kernel ran 67-77 GFLOP/s at 8 rows of a and
// 68-82 at 32, ATen's 31-48 and 63-76.
//
// Panel layout of b with `rows` rows and `cols` columns: panel j (columns [16 j, 16 j + 16))
// holds its rows one after another, 16 floats each:
//   panel[(j * rows + r) * 16 + c] = b[r, 16 j + c].
// The last panel's columns past `cols` are summed into lanes that are never stored, so they
// may hold anything (pack_panel_rows zeroes them; the decoders writing panels directly
// leave them as they were).
// The micro-kernel keeps a 6 x 16 tile of c in 12 ymm accumulators, runs the sum over n in
// ascending order in them (one FMA chain per element), then adds the tile to c: each
// element of c is c + (a[i, 0] b[0, j] + a[i, 1] b[1, j] + ...), the same bits whichever
// tile its row falls in, so a row's result depends on that row of a alone.
//
// AVX2 + FMA by target attribute (every kt_ops CPU variant has both; the file is built for
// baseline x86-64 otherwise); on the AVX-512 variants a 12 x 16 tile in 12 zmm accumulators
// (avx512f by target attribute) runs the same FMA chains and final add: the same bits.
#pragma once

#include <cstdint>

namespace kt::cpu {

constexpr int64_t kPanelColumns = 16;

// Floats a panel-packed b of `rows` x `cols` takes.
inline int64_t panel_floats(int64_t rows, int64_t cols) {
  return (cols + kPanelColumns - 1) / kPanelColumns * kPanelColumns * rows;
}

// Rows [0, count) of a row-major fp32 `src` (leading dimension `ld`, `cols` columns) into
// rows [row_offset, row_offset + count) of `panel`, a panel-packed matrix of `rows` rows.
void pack_panel_rows(const float* src, int64_t ld, int64_t count, int64_t cols, float* panel, int64_t rows,
                     int64_t row_offset);

// The transpose of a row-major fp32 `src` of `cols` rows and `rows` columns (leading
// dimension `ld`) as a whole panel-packed matrix of `rows` rows and `cols` columns:
// panel row r, column c = src[c * ld + r]; the last panel's columns past `cols` are zeroed.
// For products with a matrix's transpose (x W^T: b = W^T).
void pack_panel_transposed(const float* src, int64_t ld, int64_t rows, int64_t cols, float* panel);
// c[i, j] += sum_{r < n} a[i, r] b[r, j] for i < m, j < k; a row-major (leading dimension
// lda), c row-major (ldc), b panel-packed with n rows and k columns.
void panel_gemm_add(const float* a, int64_t lda, int64_t m, const float* panel, int64_t n, int64_t k, float* c,
                    int64_t ldc);

}  // namespace kt::cpu
