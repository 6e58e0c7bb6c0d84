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
  // A layer split over the intermediate dimension into parts (kt_ops/parts.py), the sum of
  // moe_forward over them: hidden_states, topk_ids, topk_weights as moe_forward's (CPU);
  // parts: packed uint8 blobs of one E and H; nodes: the NUMA node id each part runs on
  // (one per part). The parts run at once, each on its node's threads; their fp32 outputs
  // are summed in part order -> [T, H] (hidden dtype).
  m.def(
      "moe_forward_parts(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor[] parts,"
      " int[] nodes) -> Tensor");
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
  // kt-kernel's converted AMXINT8 weights -> packed int8 blob, copied, never re-quantized:
  // levels int8 gate_proj, up_proj [E, I, H], down_proj [E, H, I] in [-127, 127]; scales
  // float [E, N] (one per row): w = scale * q.
  m.def(
      "pack_int8_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale,"
      " Tensor up_scale, Tensor down_scale) -> Tensor");
  m.def(
      "pack_fp8_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale,"
      " Tensor up_scale, Tensor down_scale, str format) -> Tensor");
  // moe_forward for training: the same output, and gate_up fp32 [T, K, 2 * I], each slot's
  // gate (columns [0, I)) and up ([I, 2I)) as the activation saw them (after the format's
  // scale and the biases; zero for skipped slots and rows past live_tokens), which
  // moe_train_backward reads instead of recomputing them. intermediate_size: the packed
  // layer's I (checked against its header; the fake cannot read it). gate_up_delta:
  // optional f32|bf16|f16 [T, K, 2 * I] added to gate and up before the activation (a LoRA
  // branch's contribution) -> (output [T, H] (hidden dtype), gate_up).
  m.def(
      "moe_forward_train(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed,"
      " int intermediate_size, Tensor? gate_up_delta=None, Tensor? live_tokens=None) -> (Tensor, Tensor)");
  // Its backward: grad_output [T, H], the forward's inputs and its gate_up -> (grad_hidden
  // [T, H] (hidden dtype), grad_weights [T, K] (weights dtype), grad_gate_up fp32 [T, K, 2I]:
  // the gradient w.r.t. gate and up before the activation, which is gate_up_delta's).
  m.def(
      "moe_train_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights,"
      " Tensor packed, Tensor gate_up, Tensor? live_tokens=None) -> (Tensor, Tensor, Tensor)");
  // The backward of moe_forward with the experts frozen: grad_output [T, H] and
  // moe_forward's inputs -> (grad_hidden [T, H] in hidden_states' dtype, grad_weights
  // [T, K] in topk_weights' dtype). Kernel: csrc/ops/moe_train_cpu.cpp (fp32 on the
  // dequantized weights, activation and biases of the blob's header).
  m.def(
      "moe_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights,"
      " Tensor packed, Tensor? live_tokens=None) -> (Tensor, Tensor)");
  // moe_forward with LoRA on every expert's gate, up and down over the frozen packed base
  // (csrc/ops/moe_train_cpu.cpp, on the inference kernel): gate_a, up_a [E, r, H], gate_b,
  // up_b [E, I, r], down_a [E, r, I], down_b [E, H, r] (f32|bf16|f16), scaling = alpha / r
  // -> (output [T, H] (hidden dtype), gate_up fp32 [T, K, 2I]: g and u as moe_forward_train's,
  // LoRA branch included, for the backward).
  m.def(
      "moe_lora_forward(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed,"
      " Tensor gate_a, Tensor gate_b, Tensor up_a, Tensor up_b, Tensor down_a, Tensor down_b, float scaling,"
      " Tensor? live_tokens=None) -> (Tensor, Tensor)");
  // Its backward: (grad_hidden, grad_weights, grad_gate_a, grad_gate_b, grad_up_a, grad_up_b,
  // grad_down_a, grad_down_b), each in its input's dtype. gate_up: the forward's, or None
  // (g and u recomputed in fp32).
  m.def(
      "moe_lora_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights,"
      " Tensor packed, Tensor gate_a, Tensor gate_b, Tensor up_a, Tensor up_b, Tensor down_a, Tensor down_b,"
      " float scaling, Tensor? live_tokens=None, Tensor? gate_up=None)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Chosen experts of a packed blob (any format) as Hugging Face weights: packed uint8 [n]
  // (host memory), expert_ids int32|int64 [m] (ids in [0, E), repeats allowed), dtype
  // float32 (None) or bfloat16 -> (gate [m, I, H], up [m, I, H], down [m, H, I]), padding
  // dropped: the values the kernels multiply, bit for bit kt_ops.reference.dequantize's
  // (bf16: those rounded to nearest even). Fake: I and H are data-dependent (the header).
  m.def(
      "dequantize_experts(Tensor packed, Tensor expert_ids, ScalarType? dtype=None)"
      " -> (Tensor, Tensor, Tensor)");
}
