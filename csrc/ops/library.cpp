// [NOTE] The one TORCH_LIBRARY block of kt_ops: every schema, in one place. The fake
// (meta) implementations live in the Python module named by set_python_module; a test
// checks that every schema has exactly one fake and vice versa.
#include <torch/library.h>

TORCH_LIBRARY(kt, m) {
  m.set_python_module("kt_ops.fakes");
  // hidden_states [T, H] f32|bf16|f16, topk_ids [T, K] i32|i64 (-1 = skip),
  // topk_weights [T, K] f32|bf16|f16, packed uint8 [n] (host memory) -> [T, H] (hidden
  // dtype). live_tokens: int32|int64 [1] on the inputs' device, or None: only the first
  // live_tokens tokens are computed, the other rows are zero (a CUDA graph captured at a
  // padded batch size replays for the live one).
  m.def(
      "moe_forward(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed,"
      " Tensor? live_tokens=None) -> Tensor");
  // gate_proj, up_proj [E, I, H], down_proj [E, H, I] (f32|bf16|f16) -> packed uint8 [n];
  // format bf16|int8|int4|int4_asym, group_size: int4 k-group (32|64|128), else 0.
  m.def(
      "pack_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, str format,"
      " int group_size=0, bool scale_search=False) -> Tensor");
  // gate_proj, up_proj [E, I, H], down_proj [E, H, I] (f32|bf16|f16) -> packed uint8 [n]
  // (format gguf): each matrix quantized into GGUF blocks of its ggml type id
  // (gguf_types = [gate, up, down], e.g. Q4_K = 12, Q6_K = 14).
  m.def(
      "pack_gguf_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, int[] gguf_types)"
      " -> Tensor");
  // FP8 checkpoint tensors -> packed uint8 [n], the e4m3 bytes re-tiled, never widened.
  // gate_proj, up_proj [E, I, H], down_proj [E, H, I]: float8_e4m3fn (or uint8 codes);
  // scales per matrix [E, N, K] by format: fp8 float [E, ceil(N/128), ceil(K/128)] (or per
  // row [E, N, ceil(K/128)]); fp8_perchannel float [E, N] or [E, N, 1]; mxfp8 uint8 (or
  // float8_e8m0fnu) ue8m0 [E, N, ceil(K/32)].
  // INT4 checkpoint levels -> packed uint8 [n] (format int4, or int4_asym when the three
  // minimums are given), copied, never re-quantized. gate_proj, up_proj [E, I, H / 2],
  // down_proj [E, H, I / 2]: uint8, two levels 0..15 per byte (element k of a row: byte
  // k / 2, low nibble for even k); scales (and minimums) float [E, N, K / group_size]:
  // w = scale * (q - 8), or w = scale * q + minimum.
  m.def(
      "pack_int4_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale,"
      " Tensor up_scale, Tensor down_scale, Tensor? gate_min, Tensor? up_min, Tensor? down_min,"
      " int group_size) -> Tensor");
  m.def(
      "pack_fp8_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale,"
      " Tensor up_scale, Tensor down_scale, str format) -> Tensor");
}
