// kt_ops._C: the control plane that is not an operator (CPU variant, threads, the format
// table, packed header inspection, the bench's bandwidth probe). Importing it also
// registers the torch.ops.kt operators (static initialisers of the other translation units).
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <tuple>

#include "../cpu/bench/read_bandwidth.h"
#include "../cpu/engine/engine.h"
#include "../cpu/engine/node_memory.h"
#include "../cpu/format_table.h"
#include "../cpu/formats/expert_staging.h"
#include "../cpu/formats/gguf_types.h"
#include "../cpu/isa/cpu_model.h"
#include "../cpu/isa/cpu_variant.h"
#include "checks.h"
#include "gguf_blob.h"
#include "glu_blob.h"
#include "mapped_file.h"
#include "packed_blob.h"
#include "torch_thread_team.h"
#ifdef KT_OPS_WITH_CUDA
#include "../cuda/host_calls.h"
#include "../cuda/staging.h"
#endif

namespace kt::ops {
namespace {

std::vector<std::string> supported_names() {
  std::vector<std::string> names;
  for (cpu::CpuVariant v : cpu::supported_cpu_variants()) names.emplace_back(cpu::cpu_variant_name(v));
  return names;
}

py::dict packed_info(const at::Tensor& packed) {
  const cpu::PackedLayout layout = read_packed(packed, "packed");
  py::dict info;
  info["format"] = cpu::packed_format_name(layout.shape.format);
  info["num_experts"] = layout.shape.num_experts;
  info["hidden_size"] = layout.shape.hidden_size;
  info["intermediate_size"] = layout.shape.intermediate_size;
  info["group_size"] = layout.shape.group_size;
  info["numa_parts"] = layout.shape.numa_parts;
  info["nbytes"] = layout.total_bytes;
  info["swiglu_limit"] = layout.shape.glu.swiglu_limit;
  info["swiglu_alpha"] = layout.shape.glu.swiglu_alpha;
  info["biases"] = layout.shape.glu.biases;
  info["bias_offset"] = layout.bias_offset;
  info["integer_zeros"] = layout.shape.integer_zeros;
  if (layout.shape.format == cpu::PackedFormat::kGguf) {
    py::list types, offsets;
    for (int m = 0; m < 3; ++m) {
      types.append(cpu::ggml_type_info(layout.shape.gguf_types[m]).name);
      offsets.append(layout.matrix_offset[m]);
    }
    info["gguf_types"] = types;
    info["matrix_offsets"] = offsets;
  }
  return info;
}

int64_t packed_nbytes(const std::string& format, int64_t experts, int64_t hidden,
                      int64_t intermediate, int64_t group_size) {
  return translate_errors([&] {
    cpu::PackedShape shape;
    shape.format = cpu::parse_packed_format(format);
    shape.num_experts = static_cast<uint32_t>(experts);
    shape.hidden_size = static_cast<uint32_t>(hidden);
    shape.intermediate_size = static_cast<uint32_t>(intermediate);
    shape.group_size = static_cast<uint32_t>(group_size);
    return static_cast<int64_t>(cpu::packed_layout(shape).total_bytes);
  });
}

int64_t gguf_packed_nbytes(const std::vector<int64_t>& types, int64_t experts, int64_t hidden,
                           int64_t intermediate) {
  return translate_errors([&] {
    const cpu::PackedShape shape = gguf_shape(types, experts, hidden, intermediate);
    return static_cast<int64_t>(cpu::packed_layout(shape).total_bytes);
  });
}

// (name, block elements, block bytes) of a ggml type kt_ops computes; ValueError otherwise.
py::tuple ggml_type(int64_t id) {
  return translate_errors([&] {
    TORCH_CHECK_VALUE(id >= 0 && id < 1024, "ggml type id ", id, " is out of range");
    const cpu::GgmlTypeInfo& info = cpu::ggml_type_info(static_cast<uint32_t>(id));
    return py::make_tuple(std::string(info.name), info.block_elems, info.block_bytes);
  });
}

// One dict per row of the format table (csrc/cpu/format_table.h names the fields).
py::list format_table() {
  py::list rows;
  for (const cpu::FormatRow& row : cpu::format_table()) {
    py::list methods, group_sizes;
    for (const char* method : row.methods)
      if (method != nullptr) methods.append(method);
    for (size_t i = 0; i < row.num_group_sizes; ++i) group_sizes.append(row.group_sizes[i]);
    py::dict kernels;
    for (int v = 0; v < cpu::kNumCpuVariants; ++v)
      kernels[cpu::cpu_variant_name(static_cast<cpu::CpuVariant>(v))] = row.by_variant[v].name;
    py::dict d;
    d["name"] = row.name;
    d["id"] = static_cast<uint32_t>(row.format);
    d["methods"] = methods;
    d["zero_point"] = row.zero_point;
    d["block_rows"] = row.block_rows;
    d["line_k"] = row.line_k;
    d["line_bytes"] = row.line_bytes;
    d["scale_bytes"] = row.scale_bytes;
    d["scale_group_k"] = row.scale_group_k;
    d["scale_pad"] = row.scale_pad;
    d["row_tail_bytes"] = row.row_tail_bytes;
    d["k_rule"] = cpu::row_rule_name(row.k_rule);
    d["k_pad"] = row.k_pad;
    d["max_k"] = row.max_k;
    d["group_sizes"] = group_sizes;
    d["default_group_size"] = row.default_group_size;
    d["scale_search"] = row.scale_search;
    d["packer"] = row.packer;
    d["dequantizer"] = row.dequantizer;
    d["activations"] = cpu::activation_quant_name(row.activations);
    d["oracle"] = row.oracle;
    d["kernels"] = kernels;
    rows.append(d);
  }
  return rows;
}

// One dict per ggml type of format gguf (csrc/cpu/formats/gguf_types.h names the fields);
// "in_place_variants": the CPU variants whose kernel dots it from its bytes for decode.
py::list ggml_type_table() {
  py::list types;
  for (const cpu::GgmlTypeInfo& info : cpu::kGgmlTypes) {
    py::list in_place;
    for (int v = 0; v < cpu::kNumCpuVariants; ++v)
      if (cpu::gguf_reads_in_place(info, static_cast<cpu::CpuVariant>(v)))
        in_place.append(cpu::cpu_variant_name(static_cast<cpu::CpuVariant>(v)));
    py::dict d;
    d["id"] = static_cast<uint32_t>(info.type);
    d["name"] = info.name;
    d["block_elems"] = info.block_elems;
    d["block_bytes"] = info.block_bytes;
    d["is_float"] = info.is_float;
    d["llama_cpp_fallback"] = info.llama_cpp_fallback == nullptr ? py::object(py::none())
                                                                  : py::object(py::str(info.llama_cpp_fallback));
    d["in_place_variants"] = in_place;
    types.append(d);
  }
  return types;
}

std::string kernel_name(const std::string& format, const std::string& variant) {
  return translate_errors([&] {
    return std::string(
        cpu::moe_kernel(cpu::parse_packed_format(format), cpu::parse_cpu_variant(variant)).name);
  });
}

// One expert of a packed layer in staging rows (cpu/formats/expert_staging.h): `outs` =
// gate, up, down, gate_scale, up_scale, down_scale (uint8, CPU, contiguous, exactly the
// rows' bytes; the scales empty where the format has none).
void stage_expert_rows(const at::Tensor& packed, int64_t expert, const std::vector<at::Tensor>& outs,
                       bool int4_fp32_scales) {
  translate_errors([&] {
    check_dtype(packed, "packed", {at::kByte});
    check_cpu_contiguous(packed, "packed");
    const uint8_t* blob = packed.const_data_ptr<uint8_t>();
    const size_t blob_bytes = static_cast<size_t>(packed.numel());
    const cpu::StagingSizes sizes = cpu::staging_sizes(cpu::read_packed_header(blob, blob_bytes), int4_fp32_scales);
    TORCH_CHECK_VALUE(outs.size() == 6, "stage_expert_rows takes 6 outputs, got ", outs.size());
    const int64_t rows[6] = {sizes.intermediate, sizes.intermediate, sizes.hidden,
                             sizes.intermediate, sizes.intermediate, sizes.hidden};
    const size_t row_bytes[6] = {sizes.gate_up_row, sizes.gate_up_row, sizes.down_row,
                                 sizes.gate_up_scale_row, sizes.gate_up_scale_row, sizes.down_scale_row};
    const char* names[6] = {"gate", "up", "down", "gate_scale", "up_scale", "down_scale"};
    uint8_t* ptr[6];
    for (int i = 0; i < 6; ++i) {
      check_dtype(outs[i], names[i], {at::kByte});
      check_cpu_contiguous(outs[i], names[i]);
      const int64_t want = rows[i] * static_cast<int64_t>(row_bytes[i]);
      TORCH_CHECK_VALUE(outs[i].numel() == want, names[i], " must hold ", want, " bytes, got ", outs[i].numel());
      ptr[i] = want == 0 ? nullptr : outs[i].data_ptr<uint8_t>();
    }
    py::gil_scoped_release no_gil;
    cpu::stage_expert_rows(blob, blob_bytes, expert,
                           {ptr[0], ptr[1], ptr[2], ptr[3], ptr[4], ptr[5], int4_fp32_scales});
  });
}

std::vector<double> time_read_passes(const at::Tensor& buffer, int repeats) {
  check_dtype(buffer, "buffer", {at::kByte});
  check_cpu_contiguous(buffer, "buffer");
  py::gil_scoped_release no_gil;
  return cpu::time_read_passes(buffer.const_data_ptr<uint8_t>(),
                               static_cast<size_t>(buffer.numel()), repeats);
}

// Test support: the distinct OS threads that ran the `jobs` jobs of one parallel loop
// (the engine's, or torch's at::parallel_for). Each job waits (up to 2 s) until all jobs
// have arrived, so a loop that really runs in parallel shows min(jobs, threads) threads
// and a serial one shows 1.
template <class Loop>
std::vector<int64_t> loop_thread_ids(int64_t jobs, Loop loop) {
  py::gil_scoped_release no_gil;
  std::mutex mutex;
  std::vector<int64_t> ids;
  std::atomic<int64_t> arrived{0};
  loop([&](int64_t) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      const int64_t tid = static_cast<int64_t>(syscall(SYS_gettid));
      if (std::find(ids.begin(), ids.end(), tid) == ids.end()) ids.push_back(tid);
    }
    arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (arrived.load() < jobs && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  });
  return ids;
}

std::vector<int64_t> engine_thread_ids(int64_t jobs) {
  return loop_thread_ids(jobs, [&](auto job) { cpu::Engine::instance().parallel_for(jobs, job); });
}

// Test support: the OS thread of each part of one Engine::run_on_nodes over `nodes`.
// Each part waits (up to 10 s) until every part has started, so parts that really run
// at once return at once with as many threads as nodes, and parts run one after another
// show up as one thread or as a wait that ran out (-1 in place of its thread id).
std::vector<int64_t> engine_node_thread_ids(const std::vector<int>& nodes) {
  return translate_errors([&] {
    py::gil_scoped_release no_gil;
    const int64_t parts = static_cast<int64_t>(nodes.size());
    std::vector<int64_t> ids(nodes.size(), -1);
    std::atomic<int64_t> arrived{0};
    cpu::Engine::instance().run_on_nodes(nodes, [&](int64_t part) {
      arrived.fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (arrived.load() < parts && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      if (arrived.load() == parts) ids[part] = static_cast<int64_t>(syscall(SYS_gettid));
    });
    return ids;
  });
}

// {"simulated": bool, "nodes": [{"id": int, "cpus": [int], "physical_cpus": [int]}]}: the
// nodes the engine sees (the machine's, or KT_OPS_NUMA_SIMULATE's).
py::dict numa_topology() {
  const cpu::Topology& topology = cpu::Engine::instance().topology();
  py::list nodes;
  for (const cpu::NumaNode& node : topology.nodes) {
    py::dict d;
    d["id"] = node.id;
    d["cpus"] = node.cpus;
    d["physical_cpus"] = node.physical_cpus;
    nodes.append(d);
  }
  py::dict info;
  info["simulated"] = topology.simulated;
  info["nodes"] = nodes;
  return info;
}

// One dict per node: {"node", "caller_cpu" (-1: the caller is not its first thread),
// "cpus" (its own pinned threads, -1: unpinned)}.
py::list pool_plans() {
  py::list plans;
  for (const cpu::NodePlan& plan : cpu::Engine::instance().pool_plans()) {
    py::dict d;
    d["node"] = plan.node;
    d["caller_cpu"] = plan.caller_cpu;
    d["cpus"] = plan.cpus;
    plans.append(d);
  }
  return plans;
}

// (node, OS thread id, CPU at its start) of each part of the last run_on_nodes.
std::vector<std::tuple<int, int64_t, int>> last_parts() {
  std::vector<std::tuple<int, int64_t, int>> runs;
  for (const cpu::PartRun& run : cpu::Engine::instance().last_parts()) runs.emplace_back(run.node, run.thread, run.cpu);
  return runs;
}

// uint8 copy of `packed` in memory of NUMA node `node` (cpu/engine/node_memory.h), freed
// with the tensor; also returns whether the kernel accepted the node preference.
std::tuple<at::Tensor, bool> copy_to_node(const at::Tensor& packed, int64_t node) {
  check_dtype(packed, "packed", {at::kByte});
  check_cpu_contiguous(packed, "packed");
  check_dim(packed, "packed", 1);
  return translate_errors([&] {
    TORCH_CHECK_VALUE(node >= 0 && node < (int64_t{1} << 30), "node = ", node, " is not a NUMA node id");
    cpu::NodeMemory memory;
    {
      py::gil_scoped_release no_gil;
      memory = cpu::copy_to_node(packed.const_data_ptr<uint8_t>(), static_cast<size_t>(packed.numel()),
                                 static_cast<int>(node));
    }
    try {
      at::Tensor copy = at::from_blob(memory.data, {packed.numel()}, [memory](void*) { cpu::free_node_memory(memory); },
                                      at::TensorOptions().dtype(at::kByte));
      return std::make_tuple(copy, memory.bound);
    } catch (...) {
      cpu::free_node_memory(memory);
      throw;
    }
  });
}

std::vector<int64_t> torch_thread_ids(int64_t jobs) {
  return loop_thread_ids(jobs, [&](auto job) {
    at::parallel_for(0, jobs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) job(i);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kt_ops native control plane; the operators are torch.ops.kt.*";
  install_thread_team();
  m.def("cpu_variant", [] { return std::string(cpu::cpu_variant_name(cpu::active_cpu_variant())); });
  m.def("set_cpu_variant", [](const std::string& name) {
    cpu::set_active_cpu_variant(cpu::parse_cpu_variant(name));
  });
  m.def("supported_cpu_variants", &supported_names);
  m.def("missing_features", [](const std::string& name) {
    return cpu::missing_features(cpu::parse_cpu_variant(name));
  });
  m.def("prefetch_l2_fills_l1", &cpu::prefetch_l2_fills_l1);
  m.def("get_num_threads", [] { return cpu::Engine::instance().num_threads(); });
  m.def("max_threads", &cpu::Engine::max_threads);
  m.def("set_num_threads", [](int n) {
    py::gil_scoped_release no_gil;
    cpu::Engine::instance().set_num_threads(n);
  });
  m.def("numa_topology", &numa_topology);
  m.def("pool_plans", &pool_plans);
  m.def("last_parts", &last_parts);
  m.def("copy_to_node", &copy_to_node, py::arg("packed"), py::arg("node"));
  m.def("thread_source", [] { return cpu::Engine::instance().thread_source(); });
  m.def("packed_info", &packed_info);
  m.def("packed_nbytes", &packed_nbytes, py::arg("format"), py::arg("experts"), py::arg("hidden"),
        py::arg("intermediate"), py::arg("group_size") = 0);
  m.def("gguf_packed_nbytes", &gguf_packed_nbytes);
  m.def("ggml_type", &ggml_type);
  m.def("map_gguf_experts", &map_gguf_experts);
  m.def("map_file", &map_file, py::arg("path"), py::arg("offset"), py::arg("bytes"));
  m.def("changed_mapped_file", [](const at::Tensor& t) { return changed_mapped_file(t.const_data_ptr()); });
  m.def("gguf_experts_from_blocks", &gguf_experts_from_blocks);
  m.def("mxfp4_experts_from_blocks", &mxfp4_experts_from_blocks);
  m.def("set_activation", &set_activation, py::arg("packed"), py::arg("swiglu_limit") = 0.0,
        py::arg("swiglu_alpha") = 0.0, py::arg("gate_bias") = py::none(), py::arg("up_bias") = py::none(),
        py::arg("down_bias") = py::none());
  m.def("kernel_name", &kernel_name);
  m.def("format_table", &format_table);
  m.def("ggml_type_table", &ggml_type_table);
  m.def("time_read_passes", &time_read_passes);
  m.def("stage_expert_rows", &stage_expert_rows, py::arg("packed"), py::arg("expert"), py::arg("outs"),
        py::arg("int4_fp32_scales") = false);
  m.def("_engine_thread_ids", &engine_thread_ids);
  m.def("_torch_thread_ids", &torch_thread_ids);
  m.def("_engine_node_thread_ids", &engine_node_thread_ids);
#ifdef KT_OPS_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("reserve_graph_staging", &cuda::reserve_graph_staging, py::arg("device"), py::arg("tokens"),
        py::arg("hidden"), py::arg("top_k"));
  m.def("staging_bytes", &cuda::staging_bytes);
  m.def("take_host_error", &cuda::take_host_error);
  m.def("captured_host_calls", &cuda::captured_host_calls);
#else
  m.attr("with_cuda") = false;
#endif
}

}  // namespace kt::ops
