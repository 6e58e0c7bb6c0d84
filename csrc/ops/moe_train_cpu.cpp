// CPU kernels of the training operators: kt::moe_train_backward (moe_forward_train's
// backward), kt::moe_backward (moe_forward's, recomputing), kt::moe_lora_forward and
// kt::moe_lora_backward (per-expert LoRA on gate, up and down over a frozen base of any
// format), the experts frozen.
//
// The LoRA forward runs the inference kernel (moe_forward_cpu.h): its gate and up branches
// go in as the kernel's gate_up_add, its down branch is added to the kernel's fp32 output,
// and the kernel's g and u come back for the backward. The backwards are one pass over the
// experts the live tokens route to, in C++: each expert's weights are dequantized to fp32
// (the format table's "dequantize rows" columns, the values the inference kernels multiply),
// its tokens gathered, and differentiated in fp32 — the products with the weights (G Wd,
// dg Wg, du Wu, and x Wg^T, x Wu^T where g and u are recomputed) on the panel kernel
// (cpu/kernels/panel_gemm.h) on the AVX2 variants and on ATen's sgemm on the AVX-512 ones
// (use_panel_gemm), the LoRA products of token rows on the panel kernel always
// (row_products.h: a token's bits do not depend on the other tokens), the LoRA weight
// gradients with ATen — at the g and u the forward saved (moe_forward_train,
// moe_lora_forward), or at g and u recomputed in fp32 (moe_backward, and
// moe_lora_backward without gate_up). The activation and biases are the blob header's. For
// expert e of token t (slot j, weight w, input row x, output gradient G, s = LoRA scaling,
// A/B that expert's LoRA matrices):
//   g = x Wg^T + bg + s (x Ag^T) Bg^T     (u likewise)       h = act(g, u)
//   d = h Wd^T + bd + s (h Ad^T) Bd^T     out[t] += w d
//   grad_w[t, j] = <G, d> = <G Wd, h> + <G, bd> + s <G Bd, h Ad^T>   (d is not recomputed)
//   dd = w G    dh = dd Wd + s (dd Bd) Ad    dg = dh act_g'   du = dh act_u'
//   dx += dg Wg + du Wu + s (dg Bg) Ag + s (du Bu) Au
//   dBd += s dd^T (h Ad^T)   dAd += s (dd Bd)^T h   (gate/up: with dg/du and x)
// [dg du] is also the gradient of moe_forward_train's gate_up_delta.
// Rows past live_tokens have zero output and zero gradients.
#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../cpu/engine/engine.h"
#include "../cpu/format_table.h"
#include "../cpu/formats/dequantize_experts.h"
#include "../cpu/isa/cpu_variant.h"
#include "../cpu/kernels/panel_gemm.h"
#include "checks.h"
#include "moe_call.h"
#include "moe_forward_cpu.h"
#include "packed_blob.h"
#include "row_products.h"

namespace kt::ops {
namespace {

// Whether the backward's out += a W products run on the panel kernel
// (cpu/kernels/panel_gemm.h, AVX2) or on ATen's sgemm: the panel kernel on the AVX2
// variants (avx2, avx_vnni), where it was measured faster; ATen's on the AVX-512 ones,
// whose sgemm has 16-wide FMAs the AVX2 kernel lacks. KT_OPS_TRAIN_GEMM=panel or aten
// forces one (read at every operator call: tests and benchmarks compare them in one process).
bool use_panel_gemm() {
  const char* forced = std::getenv("KT_OPS_TRAIN_GEMM");
  if (forced != nullptr && *forced != '\0' && std::strcmp(forced, "auto") != 0) {
    TORCH_CHECK_VALUE(std::strcmp(forced, "panel") == 0 || std::strcmp(forced, "aten") == 0,
                      "KT_OPS_TRAIN_GEMM must be panel, aten or auto; got ", forced);
    return std::strcmp(forced, "panel") == 0;
  }
  const cpu::CpuVariant v = cpu::active_cpu_variant();
  return v == cpu::CpuVariant::kAvx2 || v == cpu::CpuVariant::kAvxVnni;
}

// The token rows and slots each expert is routed from, for the first `live` tokens.
struct Routes {
  std::vector<int64_t> experts;               // distinct experts, ascending
  std::vector<std::vector<int64_t>> tokens;   // per expert: token rows
  std::vector<std::vector<int64_t>> flat;     // per expert: t * K + j
};

Routes routes(const at::Tensor& topk_ids, int64_t live, int64_t num_experts) {
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t K = ids.size(1);
  const int64_t* p = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> slot_of(static_cast<size_t>(num_experts), -1);
  Routes r;
  // Which experts are routed to, then their slots in ascending expert order: a token's
  // rows are summed in that order (add_rows_in_expert_order), so it must not depend on
  // the order in which the earlier rows of the call name the experts.
  for (int64_t t = 0; t < live; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = p[t * K + j];
      if (e < 0) continue;
      TORCH_CHECK_VALUE(e < num_experts, "topk_ids[", t, ", ", j, "] = ", e, " is out of range: the packed layer has ",
                        num_experts, " experts");
      slot_of[e] = 0;
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    if (slot_of[e] < 0) continue;
    slot_of[e] = static_cast<int64_t>(r.experts.size());
    r.experts.push_back(e);
  }
  r.tokens.resize(r.experts.size());
  r.flat.resize(r.experts.size());
  for (int64_t t = 0; t < live; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = p[t * K + j];
      if (e < 0) continue;
      r.tokens[slot_of[e]].push_back(t);
      r.flat[slot_of[e]].push_back(t * K + j);
    }
  }
  return r;
}

// A packed blob's layout, format row and fp32 biases (undefined without biases), and the
// fp32 GEMMs of the backward on its experts' dequantized weights.
struct Layer {
  at::Tensor packed;
  cpu::PackedLayout layout;
  const cpu::FormatRow* row = nullptr;
  at::Tensor gate_bias, up_bias, down_bias;  // fp32 [E, I], [E, I], [E, H] views into the blob

  bool panel_gemm = use_panel_gemm();  // one choice per operator call

  explicit Layer(const at::Tensor& blob) : packed(blob), layout(read_packed(blob, "packed")) {
    row = &cpu::format_row(layout.shape.format);
    if (layout.shape.glu.biases) {
      const int64_t E = layout.shape.num_experts, H = layout.shape.hidden_size, I = layout.shape.intermediate_size;
      const int64_t I16 = (I + 15) / 16 * 16, H16 = (H + 15) / 16 * 16;
      auto* base = const_cast<uint8_t*>(blob.const_data_ptr<uint8_t>()) + layout.bias_offset;
      const at::Tensor floats = at::from_blob(base, {E * (2 * I16 + H16)}, at::TensorOptions().dtype(at::kFloat));
      gate_bias = floats.narrow(0, 0, E * I16).view({E, I16}).narrow(1, 0, I);
      up_bias = floats.narrow(0, E * I16, E * I16).view({E, I16}).narrow(1, 0, I);
      down_bias = floats.narrow(0, 2 * E * I16, E * H16).view({E, H16}).narrow(1, 0, H);
    }
  }

  // x W^T for matrix m of expert e: x fp32 [n, K] -> [n, N] (W [N, K]: gate and up [I, H],
  // down [H, I]).
  // On the panel kernel where add_times runs there (a row's bits then depend on that row
  // alone, see row_products.h), else on ATen's sgemm.
  at::Tensor times_transposed(cpu::ExpertMatrix m, int64_t e, const at::Tensor& x) const {
    at::Tensor out = at::empty({x.size(0), cpu::matrix_rows(layout, m)}, x.options());
    if (panel_gemm) {
      const at::Tensor rows = x.contiguous();
      thread_local std::vector<float> panel;  // one per thread: experts run in parallel
      for_chunks(m, e, [&](int64_t r0, const at::Tensor& w) {
        const auto need = static_cast<size_t>(cpu::panel_floats(w.size(1), w.size(0)));
        if (panel.size() < need) panel.resize(need);
        rows_times_transposed_into(rows, w.const_data_ptr<float>(), w.size(0), out, r0, panel.data());
      });
      return out;
    }
    for_chunks(m, e, [&](int64_t r0, const at::Tensor& w) { out.narrow(1, r0, w.size(0)).copy_(at::mm(x, w.t())); });
    return out;
  }

  // out += a W for matrix m of expert e: a fp32 [n, N], out fp32 [n, K] contiguous.
  void add_times(cpu::ExpertMatrix m, int64_t e, const at::Tensor& a, at::Tensor& out) const {
    if (panel_gemm) {
      add_times_panel(m, e, a.contiguous(), out);
      return;
    }
    for_chunks(m, e, [&](int64_t r0, const at::Tensor& w) { out.addmm_(a.narrow(1, r0, w.size(0)), w); });
  }

 private:

  // fn(r0, W[r0 : r0 + c] as fp32 [c, K]) for consecutive chunks of ~512 KiB of rows
  // (multiples of 16), each dequantized over the previous one into the thread's buffer: the
  // rows stay in L2 between their decode and their GEMM, where whole experts (19 MB of fp32
  // each for S1) went through L3 and memory.
  template <typename Fn>
  void for_chunks(cpu::ExpertMatrix m, int64_t e, Fn&& fn) const {
    const int64_t N = cpu::matrix_rows(layout, m);
    const int64_t K = cpu::matrix_cols(layout, m);
    const int64_t chunk = std::max<int64_t>(16, (kChunkBytes / (4 * K)) / 16 * 16);
    thread_local std::vector<float> buffer;  // one per thread: experts run in parallel
    if (buffer.size() < static_cast<size_t>(chunk * K)) buffer.resize(chunk * K);
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t c = std::min(chunk, N - r0);
      // Inside the backward's expert jobs: decoded on this thread (a nested parallel_for).
      cpu::dequantize_expert_rows(row->dequantize, packed.const_data_ptr<uint8_t>(), layout, m, e, r0, r0 + c,
                                  buffer.data());
      fn(r0, at::from_blob(buffer.data(), {c, K}, at::TensorOptions().dtype(at::kFloat)));
    }
  }

  // add_times on the panel kernel (cpu/kernels/panel_gemm.h): W's rows a chunk at a time,
  // each 16-row block dequantized into the chunk's panels (straight there where the format
  // has a "dequantize rows to" column; through the thread's row buffer otherwise), then
  // out += a[:, chunk] panels.
  void add_times_panel(cpu::ExpertMatrix m, int64_t e, const at::Tensor& a, at::Tensor& out) const {
    const int64_t N = cpu::matrix_rows(layout, m);
    const int64_t K = cpu::matrix_cols(layout, m);
    const int64_t chunk = std::max<int64_t>(16, (kChunkBytes / (4 * cpu::panel_floats(1, K))) / 16 * 16);
    thread_local std::vector<float> rows, panel;  // one per thread: experts run in parallel
    if (row->dequantize_to == nullptr && rows.size() < static_cast<size_t>(16 * K)) rows.resize(16 * K);
    if (panel.size() < static_cast<size_t>(cpu::panel_floats(chunk, K))) panel.resize(cpu::panel_floats(chunk, K));
    const uint8_t* blob = packed.const_data_ptr<uint8_t>();
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t c = std::min(chunk, N - r0);
      for (int64_t b = r0; b < r0 + c; b += 16) {  // one block of the 16-row layouts per decode
        const int64_t count = std::min<int64_t>(16, r0 + c - b);
        if (row->dequantize_to != nullptr) {
          row->dequantize_to(blob, layout, m, e, b, b + count, cpu::RowsOut::panels(panel.data(), c, b - r0));
          continue;
        }
        row->dequantize(blob, layout, m, e, b, b + count, rows.data());
        cpu::pack_panel_rows(rows.data(), K, count, K, panel.data(), c, b - r0);
      }
      cpu::panel_gemm_add(a.const_data_ptr<float>() + r0, a.stride(0), a.size(0), panel.data(), c, K,
                          out.mutable_data_ptr<float>(), out.stride(0));
    }
  }

  static constexpr int64_t kChunkBytes = 512 * 1024;
};

// h = act(g, u) and its partial derivatives (the header's activation; kt_ops.reference.glu).
// A clamp passes the gradient inside its range, bounds included (torch.clamp's gradient).
struct Glu {
  at::Tensor h, dg, du;
};

Glu glu(at::Tensor g, at::Tensor u, float limit, float alpha) {
  at::Tensor g_in, u_in;
  if (limit > 0) {
    g_in = g.le(limit).to(at::kFloat);
    u_in = at::logical_and(u.ge(-limit), u.le(limit)).to(at::kFloat);
    g = g.clamp_max(limit);
    u = u.clamp(-limit, limit);
  }
  Glu out;
  if (alpha > 0) {
    const at::Tensor s = at::sigmoid(g * alpha), gs = g * s;
    out.h = gs * (u + 1);
    out.dg = (s + gs * (1 - s) * alpha) * (u + 1);
    out.du = gs;
  } else {
    const at::Tensor s = at::sigmoid(g), silu = g * s;
    out.h = silu * u;
    out.dg = s * (g * (1 - s) + 1) * u;
    out.du = silu;
  }
  if (limit > 0) {
    out.dg = out.dg * g_in;
    out.du = out.du * u_in;
  }
  return out;
}

// The rows computed: live_tokens checked as the forwards check it (a -1, a count past T, a
// float or two values are a ValueError; they were clamped or truncated silently here).
int64_t live_rows(const std::optional<at::Tensor>& live_tokens, int64_t T) {
  check_live_tokens(live_tokens);
  if (!live_tokens.has_value()) return T;
  TORCH_CHECK_VALUE(live_tokens->device().is_cpu(), "live_tokens must be on the CPU with CPU inputs; got ",
                    live_tokens->device());
  std::string error;
  const int64_t n = clamp_live_tokens(live_tokens->item<int64_t>(), T, &error);
  TORCH_CHECK_VALUE(error.empty(), error);
  return n;
}

at::Tensor index_tensor(const std::vector<int64_t>& v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong));
}

// The LoRA matrices of one call, fp32 (undefined: no LoRA).
struct Lora {
  at::Tensor gate_a, gate_b, up_a, up_b, down_a, down_b;
  double scaling = 0.0;
  bool on() const { return gate_a.defined(); }
};

void check_lora(const Lora& lora, int64_t E, int64_t H, int64_t I) {
  const int64_t r = lora.gate_a.size(1);
  const std::vector<std::tuple<const at::Tensor*, const char*, std::vector<int64_t>>> want = {
      {&lora.gate_a, "gate_a", {E, r, H}}, {&lora.gate_b, "gate_b", {E, I, r}}, {&lora.up_a, "up_a", {E, r, H}},
      {&lora.up_b, "up_b", {E, I, r}},     {&lora.down_a, "down_a", {E, r, I}}, {&lora.down_b, "down_b", {E, H, r}}};
  for (const auto& [t, name, shape] : want) {
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(shape), name, " must be ", at::IntArrayRef(shape),
                      " (E, H, I of the packed layer, rank ", r, "); got ", t->sizes());
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be on the CPU; got ", t->device());
  }
}

void check_call(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w, const cpu::PackedLayout& layout) {
  check_dim(x, "hidden_states", 2);
  check_dim(ids, "topk_ids", 2);
  check_dtype(ids, "topk_ids", {at::kInt, at::kLong});
  check_dtype(x, "hidden_states", {at::kFloat, at::kBFloat16, at::kHalf});
  check_dtype(w, "topk_weights", {at::kFloat, at::kBFloat16, at::kHalf});
  TORCH_CHECK_VALUE(ids.size(0) == x.size(0), "topk_ids has ", ids.size(0), " rows but hidden_states has ", x.size(0),
                    " tokens");
  TORCH_CHECK_VALUE(w.sizes() == ids.sizes(), "topk_weights must have the shape of topk_ids ", ids.sizes(), ", got ",
                    w.sizes());
  TORCH_CHECK_VALUE(x.size(1) == layout.shape.hidden_size, "hidden_states has ", x.size(1),
                    " features but the packed layer's hidden size is ", layout.shape.hidden_size);
}

// Everything one routed expert computes and needs for its backward.
struct ExpertPass {
  at::Tensor x, xa_g, xa_u, g, u, h, ha_d;  // fp32, rows = the expert's tokens
  Glu act;
};

// saved: the expert's rows of the forward's gate_up [n, 2I] (g and u with the biases and
// the LoRA branch already in), or undefined to recompute them.
ExpertPass expert_forward(const Layer& layer, const Lora& lora, int64_t e, const at::Tensor& x,
                          const at::Tensor& saved) {
  ExpertPass p;
  p.x = x;
  const int64_t I = layer.layout.shape.intermediate_size;
  if (saved.defined()) {
    p.g = saved.narrow(1, 0, I);
    p.u = saved.narrow(1, I, I);
  } else {
    p.g = layer.times_transposed(cpu::ExpertMatrix::kGate, e, x);
    p.u = layer.times_transposed(cpu::ExpertMatrix::kUp, e, x);
  }
  if (lora.on()) {
    p.xa_g = rows_times_transposed(x, lora.gate_a[e]);
    p.xa_u = rows_times_transposed(x, lora.up_a[e]);
  }
  if (lora.on() && !saved.defined()) {
    p.g = p.g + rows_times_transposed(p.xa_g, lora.gate_b[e]) * lora.scaling;
    p.u = p.u + rows_times_transposed(p.xa_u, lora.up_b[e]) * lora.scaling;
  }
  if (layer.gate_bias.defined() && !saved.defined()) {
    p.g = p.g + layer.gate_bias[e];
    p.u = p.u + layer.up_bias[e];
  }
  p.act = glu(p.g, p.u, layer.layout.shape.glu.swiglu_limit, layer.layout.shape.glu.swiglu_alpha);
  p.h = p.act.h;
  if (lora.on()) p.ha_d = rows_times_transposed(p.h, lora.down_a[e]);
  return p;
}

Lora lora_of(const at::Tensor& gate_a, const at::Tensor& gate_b, const at::Tensor& up_a, const at::Tensor& up_b,
             const at::Tensor& down_a, const at::Tensor& down_b, double scaling, const cpu::PackedLayout& layout) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&gate_a, "gate_a"}, {&gate_b, "gate_b"},
                                {&up_a, "up_a"}, {&up_b, "up_b"}, {&down_a, "down_a"}, {&down_b, "down_b"}}) {
    // Before the fp32 copies below: check_lora sees only those (an int32 adapter was
    // accepted, its gradient handed back truncated to int32).
    check_dim(*t, name, 3);
    check_dtype(*t, name, {at::kFloat, at::kBFloat16, at::kHalf});
  }
  Lora lora{gate_a.to(at::kFloat), gate_b.to(at::kFloat), up_a.to(at::kFloat),
            up_b.to(at::kFloat),   down_a.to(at::kFloat), down_b.to(at::kFloat), scaling};
  check_lora(lora, layout.shape.num_experts, layout.shape.hidden_size, layout.shape.intermediate_size);
  return lora;
}

// Runs job(i), i in [0, n), on the Engine's threads, each under the caller's thread-local
// state. The jobs call ATen ops; on a worker thread these would otherwise run with that
// thread's defaults: autograd on, while the caller (a CPU kernel) runs below autograd. Two
// experts' in-place adds into one gradient tensor then raced in autograd's metadata ("a
// leaf Variable that requires grad is being used in an in-place operation", in 2-50% of
// the calls with 3 to 16 threads), and the returned gradients carried autograd history.
template <class Job>
void parallel_aten_jobs(int64_t n, const Job& job) {
  const at::ThreadLocalState caller;
  cpu::Engine::instance().parallel_for(n, [&](int64_t i) {
    const at::ThreadLocalStateGuard guard(caller);
    job(i);
  });
}

// out[t] += each expert's row for token t, the experts in ascending order (the order of
// r.experts; a token routed twice to one expert: its rows in slot order) -- the bits of an
// index_add_ per expert in that order, with the tokens shared among the Engine's threads.
// out: fp32 [T, H] contiguous; dxs[i]: fp32 [rows of r.tokens[i], H] contiguous.
void add_rows_in_expert_order(at::Tensor& out, const Routes& r, const std::vector<at::Tensor>& dxs) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.scalar_type() == at::kFloat);
  const int64_t T = out.size(0), H = out.size(1);
  std::vector<int64_t> first(static_cast<size_t>(T) + 1, 0);  // token t's rows: [first[t], first[t + 1])
  for (const auto& tokens : r.tokens)
    for (const int64_t t : tokens) ++first[t + 1];
  for (int64_t t = 0; t < T; ++t) first[t + 1] += first[t];
  std::vector<const float*> rows(static_cast<size_t>(first[T]));
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    const float* dx = dxs[i].const_data_ptr<float>();
    for (size_t j = 0; j < r.tokens[i].size(); ++j) rows[next[r.tokens[i][j]]++] = dx + j * H;
  }
  float* o = out.mutable_data_ptr<float>();
  cpu::Engine::instance().parallel_for(T, [&](int64_t t) {
    float* row = o + t * H;
    for (int64_t p = first[t]; p < first[t + 1]; ++p)
      for (int64_t h = 0; h < H; ++h) row[h] += rows[p][h];
  });
}

// The LoRA forward on the inference kernel: the gate and up branches s (x A^T) B^T go in
// as the kernel's gate_up_add, the down branch s (h Ad^T) Bd^T is added to its fp32
// output, h = act(g, u) from the g and u it saved. -> (output [T, H] in hidden_states'
// dtype, gate_up fp32 [T, K, 2I] for the backward). Both branches run one expert per job
// on the Engine's threads (each job's ATen ops on its thread; each writes only its slots'
// rows of delta), and the down branches are added to the output per token in expert order
// (add_rows_in_expert_order): the same bits as one expert at a time (2026-11-26, Zen 3,
// S1 512 tokens AMXINT8: the LoRA forward 337 -> 235 ms).
std::tuple<at::Tensor, at::Tensor> lora_forward(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                                const at::Tensor& topk_weights, const Layer& layer, const Lora& lora,
                                                const std::optional<at::Tensor>& live_tokens) {
  const at::Tensor x = hidden_states.to(at::kFloat).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous().view({-1});
  const int64_t T = x.size(0), K = topk_ids.size(1), I = layer.layout.shape.intermediate_size;
  const Routes r = routes(topk_ids, live_rows(live_tokens, T), layer.layout.shape.num_experts);
  const double s = lora.scaling;
  const int64_t n = static_cast<int64_t>(r.experts.size());
  at::Tensor delta = at::empty({T, K, 2 * I}, x.options());  // rows of unrouted slots are never read
  float* delta_rows = delta.mutable_data_ptr<float>();
  translate_errors([&] {
    parallel_aten_jobs(n, [&](int64_t i) {
      const int64_t e = r.experts[i];
      const at::Tensor xe = x.index_select(0, index_tensor(r.tokens[i]));
      const at::Tensor dg = rows_times_transposed(rows_times_transposed(xe, lora.gate_a[e]), lora.gate_b[e]) * s;
      const at::Tensor du = rows_times_transposed(rows_times_transposed(xe, lora.up_a[e]), lora.up_b[e]) * s;
      const float* pg = dg.const_data_ptr<float>();
      const float* pu = du.const_data_ptr<float>();
      for (size_t j = 0; j < r.flat[i].size(); ++j) {  // slot rows [g, u]
        float* row = delta_rows + r.flat[i][j] * 2 * I;
        std::copy(pg + j * I, pg + (j + 1) * I, row);
        std::copy(pu + j * I, pu + (j + 1) * I, row + I);
      }
    });
  });
  auto [out, gate_up] = moe_forward_train_kernel(hidden_states.contiguous(), topk_ids.contiguous(),
                                                 topk_weights.contiguous(), layer.packed, I, delta, live_tokens,
                                                 /*fp32_output=*/true);
  const at::Tensor gate_up_rows = gate_up.view({T * K, 2 * I});
  const float limit = layer.layout.shape.glu.swiglu_limit, alpha = layer.layout.shape.glu.swiglu_alpha;
  std::vector<at::Tensor> downs(static_cast<size_t>(n));
  translate_errors([&] {
    parallel_aten_jobs(n, [&](int64_t i) {
      const int64_t e = r.experts[i];
      const at::Tensor flat = index_tensor(r.flat[i]);
      const at::Tensor gu = gate_up_rows.index_select(0, flat);
      const at::Tensor h = glu(gu.narrow(1, 0, I), gu.narrow(1, I, I), limit, alpha).h;
      const at::Tensor d = rows_times_transposed(rows_times_transposed(h, lora.down_a[e]), lora.down_b[e]) * s;
      downs[i] = (d * weights.index_select(0, flat).unsqueeze(1)).contiguous();
    });
  });
  add_rows_in_expert_order(out, r, downs);
  return {out.to(hidden_states.scalar_type()), gate_up};
}

// grad_x, grad_w, (with LoRA) the six LoRA gradients and (with a saved gate_up) the
// gradient w.r.t. gate and up before the activation [T * K, 2I], fp32.
struct Grads {
  at::Tensor x, w, gate_a, gate_b, up_a, up_b, down_a, down_b, gate_up;
};

// Expert e's part of the backward: writes its slots of out.w (and out.gate_up) and its
// LoRA gradients, returns its rows of grad_x [n, H] (n = its tokens).
at::Tensor expert_backward(const Layer& layer, const Lora& lora, int64_t e, const at::Tensor& x, const at::Tensor& grad,
                           const at::Tensor& weights, const at::Tensor& saved, const at::Tensor& tokens,
                           const at::Tensor& flat, Grads& out) {
  const double s = lora.scaling;
  const ExpertPass p = expert_forward(layer, lora, e, x.index_select(0, tokens),
                                      saved.defined() ? saved.index_select(0, flat) : at::Tensor());
  const at::Tensor g_rows = grad.index_select(0, tokens);
  const at::Tensor route_w = weights.index_select(0, flat).unsqueeze(1);  // [n, 1]
  // grad_w = <G, d> = <G Wd, h> + <G, bd> + s <G Bd, h Ad^T>: d itself is never formed
  at::Tensor g_down = at::zeros({g_rows.size(0), layer.layout.shape.intermediate_size}, g_rows.options());
  layer.add_times(cpu::ExpertMatrix::kDown, e, g_rows, g_down);  // G Wd [n, I]
  at::Tensor grad_w = (g_down * p.h).sum(1);
  if (layer.down_bias.defined()) grad_w = grad_w + (g_rows * layer.down_bias[e]).sum(1);
  at::Tensor dh = g_down * route_w;  // (w G) Wd
  if (lora.on()) {
    const at::Tensor g_b = rows_times(g_rows, lora.down_b[e]);  // [n, r]
    grad_w = grad_w + (g_b * p.ha_d).sum(1) * s;
    const at::Tensor dd = g_rows * route_w, dd_b = g_b * route_w;
    out.down_b[e].add_(at::matmul(dd.t(), p.ha_d), s);
    out.down_a[e].add_(at::matmul(dd_b.t(), p.h), s);
    dh = dh + rows_times(dd_b, lora.down_a[e]) * s;
  }
  out.w.index_copy_(0, flat, grad_w);
  const at::Tensor dg = dh * p.act.dg, du = dh * p.act.du, dgu = at::cat({dg, du}, 1);
  if (out.gate_up.defined()) out.gate_up.index_copy_(0, flat, dgu);
  at::Tensor dx = at::zeros_like(p.x);  // dg Wg + du Wu
  layer.add_times(cpu::ExpertMatrix::kGate, e, dg, dx);
  layer.add_times(cpu::ExpertMatrix::kUp, e, du, dx);
  if (lora.on()) {
    const at::Tensor dg_b = rows_times(dg, lora.gate_b[e]), du_b = rows_times(du, lora.up_b[e]);
    out.gate_b[e].add_(at::matmul(dg.t(), p.xa_g), s);
    out.up_b[e].add_(at::matmul(du.t(), p.xa_u), s);
    out.gate_a[e].add_(at::matmul(dg_b.t(), p.x), s);
    out.up_a[e].add_(at::matmul(du_b.t(), p.x), s);
    dx = dx + (rows_times(dg_b, lora.gate_a[e]) + rows_times(du_b, lora.up_a[e])) * s;
  }
  return dx;
}

// gate_up: moe_forward_train's [T, K, 2I], or undefined (recompute g and u).
Grads backward(const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
               const at::Tensor& topk_weights, const Layer& layer, const Lora& lora,
               const std::optional<at::Tensor>& live_tokens, const at::Tensor& gate_up = {}) {
  TORCH_CHECK_VALUE(grad_output.sizes() == hidden_states.sizes(), "grad_output must have hidden_states' shape ",
                    hidden_states.sizes(), ", got ", grad_output.sizes());
  const at::ScalarType grad_type = grad_output.scalar_type();  // an int32 or float64 one was converted silently
  TORCH_CHECK_VALUE(grad_type == at::kFloat || grad_type == at::kBFloat16 || grad_type == at::kHalf,
                    "grad_output must be float32, bfloat16 or float16 (as the forward's output); got ", grad_type);
  const at::Tensor x = hidden_states.to(at::kFloat).contiguous();
  const at::Tensor grad = grad_output.to(at::kFloat).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous().view({-1});
  Grads out;
  out.x = at::zeros_like(x);
  out.w = at::zeros({weights.numel()}, x.options());
  if (lora.on()) {
    out.gate_a = at::zeros_like(lora.gate_a);
    out.gate_b = at::zeros_like(lora.gate_b);
    out.up_a = at::zeros_like(lora.up_a);
    out.up_b = at::zeros_like(lora.up_b);
    out.down_a = at::zeros_like(lora.down_a);
    out.down_b = at::zeros_like(lora.down_b);
  }
  const int64_t live = live_rows(live_tokens, x.size(0));
  at::Tensor saved;  // [T * K, 2I]
  if (gate_up.defined()) {
    // [T * K, 2I] by its sizes: T * K may be 0 (an empty batch, top-k 0), where -1 cannot be inferred
    saved = gate_up.to(at::kFloat).contiguous().view({weights.numel(), 2 * layer.layout.shape.intermediate_size});
    out.gate_up = at::empty_like(saved);
    zero_unrouted_rows(out.gate_up, topk_ids, live);  // the routed rows are written below
  }
  const Routes r = routes(topk_ids, live, layer.layout.shape.num_experts);
  // One expert per job, the jobs on the Engine's threads (each ATen op and GEMM inside runs
  // on its job's thread): an expert's decoded rows stay in its core's L2, and no GEMM waits
  // for the other core. Each job writes only its expert's slots and LoRA slices; the dx
  // rows are added to grad_x afterwards in expert order, so the sum is the same whatever
  // thread ran which expert (2026-11-26, Zen 3, S1 512 tokens BF16, scripts/bench_train.py:
  // the backward ~1050 -> ~460 ms against one expert at a time on both threads).
  std::vector<at::Tensor> dxs(r.experts.size());
  translate_errors([&] {
    parallel_aten_jobs(static_cast<int64_t>(r.experts.size()), [&](int64_t i) {
      dxs[i] = expert_backward(layer, lora, r.experts[i], x, grad, weights, saved, index_tensor(r.tokens[i]),
                               index_tensor(r.flat[i]), out);
    });
  });
  add_rows_in_expert_order(out.x, r, dxs);
  out.w = out.w.view(topk_weights.sizes());
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_backward_cpu(const at::Tensor& grad_output, const at::Tensor& hidden_states,
                                                    const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                                    const at::Tensor& packed,
                                                    const std::optional<at::Tensor>& live_tokens) {
  RECORD_FUNCTION("kt::moe_backward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  const Layer layer(packed);
  check_call(hidden_states, topk_ids, topk_weights, layer.layout);
  const Grads g = backward(grad_output, hidden_states, topk_ids, topk_weights, layer, Lora{}, live_tokens);
  return {g.x.to(hidden_states.scalar_type()), g.w.to(topk_weights.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_train_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, const at::Tensor& packed, const at::Tensor& gate_up,
    const std::optional<at::Tensor>& live_tokens) {
  RECORD_FUNCTION("kt::moe_train_backward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  const Layer layer(packed);
  check_call(hidden_states, topk_ids, topk_weights, layer.layout);
  check_slot_rows(gate_up, "gate_up", topk_ids, layer.layout.shape.intermediate_size, {at::kFloat});
  const Grads g = backward(grad_output, hidden_states, topk_ids, topk_weights, layer, Lora{}, live_tokens, gate_up);
  return {g.x.to(hidden_states.scalar_type()), g.w.to(topk_weights.scalar_type()), g.gate_up.view(gate_up.sizes())};
}

std::tuple<at::Tensor, at::Tensor> moe_lora_forward_cpu(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& packed, const at::Tensor& gate_a, const at::Tensor& gate_b, const at::Tensor& up_a,
    const at::Tensor& up_b, const at::Tensor& down_a, const at::Tensor& down_b, double scaling,
    const std::optional<at::Tensor>& live_tokens) {
  RECORD_FUNCTION("kt::moe_lora_forward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  const Layer layer(packed);
  check_call(hidden_states, topk_ids, topk_weights, layer.layout);
  const Lora lora = lora_of(gate_a, gate_b, up_a, up_b, down_a, down_b, scaling, layer.layout);
  return lora_forward(hidden_states, topk_ids, topk_weights, layer, lora, live_tokens);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
moe_lora_backward_cpu(const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, const at::Tensor& packed, const at::Tensor& gate_a,
                      const at::Tensor& gate_b, const at::Tensor& up_a, const at::Tensor& up_b,
                      const at::Tensor& down_a, const at::Tensor& down_b, double scaling,
                      const std::optional<at::Tensor>& live_tokens, const std::optional<at::Tensor>& gate_up) {
  RECORD_FUNCTION("kt::moe_lora_backward", std::vector<c10::IValue>({hidden_states, topk_ids}));
  const Layer layer(packed);
  check_call(hidden_states, topk_ids, topk_weights, layer.layout);
  const Lora lora = lora_of(gate_a, gate_b, up_a, up_b, down_a, down_b, scaling, layer.layout);
  if (gate_up.has_value())
    check_slot_rows(*gate_up, "gate_up", topk_ids, layer.layout.shape.intermediate_size, {at::kFloat});
  const Grads g = backward(grad_output, hidden_states, topk_ids, topk_weights, layer, lora, live_tokens,
                           gate_up.has_value() ? *gate_up : at::Tensor());
  return {g.x.to(hidden_states.scalar_type()), g.w.to(topk_weights.scalar_type()),
          g.gate_a.to(gate_a.scalar_type()),   g.gate_b.to(gate_b.scalar_type()),
          g.up_a.to(up_a.scalar_type()),       g.up_b.to(up_b.scalar_type()),
          g.down_a.to(down_a.scalar_type()),   g.down_b.to(down_b.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("moe_backward", &moe_backward_cpu);
  m.impl("moe_train_backward", &moe_train_backward_cpu);
  m.impl("moe_lora_forward", &moe_lora_forward_cpu);
  m.impl("moe_lora_backward", &moe_lora_backward_cpu);
}

}  // namespace kt::ops
