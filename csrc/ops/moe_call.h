// What the CPU and CUDA keys of kt::moe_forward and kt::moe_forward_parts share: the
// metadata checks (dtypes, ranks, shapes, the packed headers, live_tokens, the parts'
// nodes) and the kernel arguments they fill. Data checks
// (expert ids in range) are pointer-based so the CUDA key's host function can run them
// on staged host memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "../cpu/kernels/moe_args.h"
#include "../cpu/kernels/moe_parts.h"

namespace kt::ops {

// Checks hidden_states [T, H], topk_ids [T, K], topk_weights [T, K] and the packed blob
// (named `packed_name` in messages) against each other (not their devices); returns the
// kernel arguments with the dtypes, top_k, tokens and packed blob filled in and no data
// pointers for the activations.
cpu::MoeArgs check_moe_call(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& packed,
                            const char* packed_name = "packed");

// moe_forward_parts' parts (packed blobs of one E and H, each checked as check_moe_call's
// `packed`, named parts[p]) and nodes (one NUMA node id per part) -> one MoePart each;
// *args gets check_moe_call's arguments of parts[0].
std::vector<cpu::MoePart> check_moe_parts(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                          const at::Tensor& topk_weights, at::TensorList parts,
                                          at::IntArrayRef nodes, cpu::MoeArgs* args);

// live_tokens: an optional one-element int32/int64 tensor; only its first `value` tokens
// are computed (the rest of the output is zero). Checks its dtype and size only.
void check_live_tokens(const c10::optional<at::Tensor>& live_tokens);

// The number of tokens to compute: `value` (from live_tokens) clamped to [0, tokens]; an
// error message when it was outside that range, else empty.
int64_t clamp_live_tokens(int64_t value, int64_t tokens, std::string* error);

// Empty when every id of [tokens, top_k] is in [-1, experts); else the message naming the
// first bad one.
std::string find_bad_expert_id(const void* ids, bool int64, int64_t tokens, int64_t top_k,
                               int64_t experts);

// A training operator's per-slot tensor (gate_up_delta, gate_up): `name` must be
// [T, K, 2 * intermediate_size] (T, K of topk_ids), of a dtype in `allowed`, on the CPU.
void check_slot_rows(const at::Tensor& t, const char* name, const at::Tensor& topk_ids, int64_t intermediate_size,
                     std::initializer_list<at::ScalarType> allowed);

// Zeroes the rows of rows_by_slot [tokens * top_k, C] (float32, contiguous) of slots that
// route nowhere: id -1, or a token at or past `live`. The training operators' per-slot
// outputs are written by the kernels for every other row.
void zero_unrouted_rows(at::Tensor& rows_by_slot, const at::Tensor& topk_ids, int64_t live);

}  // namespace kt::ops
