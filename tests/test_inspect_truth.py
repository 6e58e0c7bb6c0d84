"""``kt-ops inspect`` states only facts: every method it names loads the weights it
inspected, into the format whose kernel it names, and the bytes it counts are the bytes of
the experts' tensors on disk."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import make_weights, write_checkpoint
from safetensors import safe_open

import kt_ops
from kt_ops import KTMoEWrapper
from kt_ops.inspection import inspect_weights

E, H, I = 4, 256, 128  # H and I multiples of 128: block FP8 needs whole scale blocks


def _named_methods(notes: tuple[str, ...]) -> list[tuple[str, str]]:
    """(method, format) for each method of the "packed when loaded" lines of a Hugging
    Face checkpoint's notes (``"  methods AMXINT4, MOE_INT4: int4/amx (...)"``)."""
    named = []
    for note in notes:
        match = re.match(r"^  methods? (?P<methods>[A-Z0-9_, ]+?)(?P<rest> \+ [^:]*)?: (?P<fmt>\w+)/", note)
        if match:
            named.extend((method, match["fmt"]) for method in match["methods"].split(", "))
    return named


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_every_method_named_for_a_float_checkpoint_loads_it(tmp_path: Path, dtype: torch.dtype) -> None:
    """The notes of a float or FP8 checkpoint listed "methods AMXINT4, MOE_INT4 +
    zero_point=True: int4_asym" (KTMoEWrapper takes no zero_point: it packs int4) and, for
    block FP8, methods FP8_PERCHANNEL and MXFP8, which refuse it ("holds FP8 experts")."""
    path = write_checkpoint(tmp_path, make_weights([1], E, H, I), dtype=dtype)
    report = inspect_weights(path)
    named = _named_methods(report.notes)
    assert {"BF16", "AMXINT8", "AMXINT4", "FP8", "MXFP4"} <= {method for method, _ in named}, report.notes
    for method, fmt in named:
        wrapper = KTMoEWrapper(1, E, 2, H, I, method=method, weight_path=path)
        try:
            wrapper.load_weights()
        except ValueError as error:
            pytest.fail(f"inspect names method {method} for {path}, which refuses it: {error}")
        assert [part.format for part in wrapper._parts] == [fmt], (method, report.notes)
    variant = kt_ops.cpu_variant()
    assert all(note.split(": ", 1)[1].startswith(f"{fmt}/{variant} ") for note in report.notes
               for method, fmt in _named_methods((note,)))


def _expert_bytes(path: Path) -> int:
    """Bytes of every ``*.experts.*`` tensor of the checkpoint's safetensors files."""
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            total += sum(handle.get_tensor(key).nbytes
                         for key in handle.keys() if ".experts." in key)
    return total


@pytest.mark.parametrize("case", ["W8A16", "zero_points"])
def test_int8_bytes_count_every_expert_tensor(tmp_path: Path, case: str) -> None:
    """An INT8 layer's bytes left out the W8A16 experts' ``weight_shape`` and the
    ``weight_zero_point`` tensors (the INT4 layouts count theirs)."""
    from test_int8_checkpoint import I as I8
    from test_int8_checkpoint import _add, write_int8_checkpoint

    if case == "W8A16":
        path, _ = write_int8_checkpoint(tmp_path, packed=True)
    else:
        path, _ = write_int8_checkpoint(tmp_path, edit=_add("weight_zero_point", torch.zeros(I8, 1, dtype=torch.int8)))
    [layer] = inspect_weights(path).layers
    assert layer.nbytes == _expert_bytes(path) == sum(m.nbytes or 0 for m in layer.matrices)


@pytest.mark.parametrize("n,text", [(1023, "1023 B"), (1024 * 1024 - 1, "1.0 MiB"), (1024**3 - 1, "1.0 GiB"),
                                    (1024 * 1024 - 60, "1023.9 KiB"), (1536, "1.5 KiB")])
def test_bytes_round_up_into_the_next_unit(n: int, text: str) -> None:
    """1,048,575 bytes printed as "1024.0 KiB"."""
    from kt_ops.inspection import format_bytes

    assert format_bytes(n) == text


def test_a_multimodal_config_gives_its_text_models_facts(tmp_path: Path) -> None:
    """Qwen3-VL's config.json keeps the language model's keys under ``text_config``: inspect
    said "experts per token: unknown" and left out the model's layer count (the converter
    reads them there)."""
    import json

    from checkpoint_helpers import write_fp8_layer

    path, _ = write_fp8_layer(tmp_path, "fp8", "vl_per_expert", E=E, H=H, I=I, layer=1)
    text = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "hidden_size": H, "moe_intermediate_size": I,
            "num_experts": E}
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe", "text_config": text}))
    report = inspect_weights(path)
    facts = dict(report.facts)
    assert (facts["model type"], facts["experts per token"], report.num_layers) == ("qwen3_vl_moe", "2", 2)


def test_gpt_oss_gguf_bytes_count_the_expert_biases(tmp_path: Path) -> None:
    """A gpt-oss GGUF's ffn_*_exps.bias tensors, which the wrapper loads with the layer, were
    not counted (a gpt-oss Hugging Face checkpoint's biases are)."""
    import gguf
    from test_mxfp4_checkpoint import write_gpt_oss_gguf

    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(path, torch.Generator().manual_seed(9))
    stored = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    [layer] = inspect_weights(path).layers
    for matrix in layer.matrices:
        key = f"blk.0.ffn_{matrix.name}_exps"
        assert matrix.nbytes == stored[f"{key}.weight"] + stored[f"{key}.bias"]
    assert layer.nbytes == sum(stored.values())


def test_the_total_counts_only_the_layers_on_disk(tmp_path: Path) -> None:
    """An unfinished conversion's total said "in 2 layer(s)" over the bytes of the one layer
    written."""
    from kt_ops import convert
    from kt_ops.converted import INDEX, MANIFEST, Manifest, layer_file
    from kt_ops.inspection import format_inspection

    source = write_checkpoint(tmp_path / "model", make_weights([1, 2], E, H, I))
    out = tmp_path / "out"
    assert convert.main(["--input-path", str(source), "--input-type", "bf16", "--output", str(out), "--quant-method",
                         "int8", "--no-merge-safetensor"]) == 0
    Manifest(**{**Manifest.read(out).__dict__, "complete": False}).write(out)
    (out / INDEX).unlink()
    (out / layer_file(2)).unlink()
    assert (out / MANIFEST).is_file()
    report = inspect_weights(out)
    [written] = [layer for layer in report.layers if layer.nbytes is not None]
    text = format_inspection(report)
    assert f"({written.nbytes:,} bytes) of routed experts in 1 layer(s)\n" in text, text


@pytest.mark.parametrize("quant_method,extra", [("int8", ["--threadpool-count", "2"]),
                                                ("int4", ["--group-size", "32", "--threadpool-count", "2"]),
                                                ("mxfp8", [])])
def test_the_wrapper_a_converted_directory_names_loads_it(tmp_path: Path, quant_method: str, extra: list[str]) -> None:
    """A converted directory's method was the converter's name only ("int8", "int4"), which
    KTMoEWrapper refuses ("method 'int8' is not available"); the wrapper call it names now
    (method, threadpool_count, group_size) loads every layer into the format named."""
    from kt_ops import convert

    source = write_checkpoint(tmp_path / "model", make_weights([1, 2], E, H, I))
    out = tmp_path / "out"
    assert convert.main(["--input-path", str(source), "--input-type", "bf16", "--output", str(out), "--quant-method",
                         quant_method, *extra]) == 0
    report = inspect_weights(out)
    stated = dict(report.facts)["method"]
    call = re.search(r"read by KTMoEWrapper\((?P<args>[^)]*)\) as format (?P<fmt>\w+)", stated)
    assert call, stated
    kwargs = {key: value.strip("'") for key, value in (arg.split("=") for arg in call["args"].split(", "))}
    kwargs = {key: value if key == "method" else int(value) for key, value in kwargs.items()}
    for layer in report.layers:
        wrapper = KTMoEWrapper(layer.layer, E, 2, H, I, weight_path=out, **kwargs)
        wrapper.load_weights()
        assert {part.format for part in wrapper._parts} == {call["fmt"]} == {m.type for m in layer.matrices}
        assert sum(part.nbytes for part in wrapper._parts) == layer.nbytes


@pytest.mark.parametrize("case", ["AWQ_INT4", "GPTQ_INT4-asym"])
def test_the_kernel_named_for_zero_points_of_8_is_the_one_loaded(tmp_path: Path, case: str) -> None:
    """Zero points that are all 8 load as symmetric int4 (hf_int4), which the headers cannot
    tell: inspect named only int4_asym's kernel for them."""
    from test_int4_checkpoint import E as E4
    from test_int4_checkpoint import H as H4
    from test_int4_checkpoint import I as I4
    from test_int4_checkpoint import LAYER, write_int4_checkpoint

    from kt_ops.formats import format_info

    def eights(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(".qzeros")]:
            # AWQ: the zero itself; GPTQ v1: zero - 1 stored
            tensors[key] = torch.full_like(tensors[key], 0x77777777 if case.startswith("GPTQ") else -0x77777778)

    path, _ = write_int4_checkpoint(tmp_path, case, edit=eights)
    method = case.split("-")[0]
    wrapper = KTMoEWrapper(LAYER, E4, 2, H4, I4, weight_path=path, method=method)
    wrapper.load_weights()
    [fmt] = {part.format for part in wrapper._parts}
    [note] = [note for note in inspect_weights(path).notes if note.startswith(f"method {method} (read in place)")]
    assert format_info(fmt).kernels[kt_ops.cpu_variant()] in note, (fmt, note)


def test_the_json_keys_are_the_documented_ones(tmp_path: Path) -> None:
    """docs/cli.md lists the keys of ``kt-ops inspect --json``; the output has those, no others."""
    import json

    docs = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    paragraph = docs[docs.index("`--json` prints the same"):].split("\n\n")[0]
    documented = set(re.findall(r"`(\w+)`", paragraph))
    source = write_checkpoint(tmp_path, make_weights([1], E, H, I))
    data = json.loads(inspect_weights(source).to_json())
    [layer] = data["layers"]
    keys = {*data, *layer, *layer["matrices"], *layer["matrices"]["gate"], "read"}
    assert keys <= documented, keys - documented


def test_a_checkpoint_without_a_whole_expert_layer_names_no_method(tmp_path: Path) -> None:
    """Every expert layer lacking a tensor: "stored as" was blank, and the notes still listed
    the methods that would pack the layers when loaded (each refuses them)."""
    missing = "model.layers.1.mlp.experts.2.up_proj.weight"
    path = write_checkpoint(tmp_path, make_weights([1], E, H, I), skip=(missing,))
    with pytest.raises(KeyError, match="up_proj"):
        KTMoEWrapper(1, E, 2, H, I, method="BF16", weight_path=path).load_weights()
    report = inspect_weights(path)
    assert report.layers == () and all(value for _, value in report.facts), report.facts
    assert not _named_methods(report.notes), report.notes
    assert any(missing in note for note in report.notes)


@pytest.mark.parametrize("layout", ["gpt_oss_bf16", "per_expert_biases"])
def test_float_experts_with_biases_are_no_row(tmp_path: Path, layout: str) -> None:
    """The float readers refuse experts with biases (gpt-oss's bf16 fused layout, per-expert
    ``.bias`` tensors): inspect listed the layer and the methods that would pack it."""
    import json

    from safetensors.torch import save_file

    if layout == "gpt_oss_bf16":
        prefix = "model.layers.0.mlp.experts"
        save_file({f"{prefix}.gate_up_proj": torch.zeros(E, H, 2 * I, dtype=torch.bfloat16),
                   f"{prefix}.gate_up_proj_bias": torch.zeros(E, 2 * I, dtype=torch.bfloat16),
                   f"{prefix}.down_proj": torch.zeros(E, I, H, dtype=torch.bfloat16),
                   f"{prefix}.down_proj_bias": torch.zeros(E, H, dtype=torch.bfloat16)},
                  str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1}))
        path = tmp_path
    else:
        path = write_checkpoint(tmp_path / "model", make_weights([0], E, H, I))
        save_file({"model.layers.0.mlp.experts.1.down_proj.bias": torch.zeros(H, dtype=torch.bfloat16)},
                  str(path / "model-extra.safetensors"))
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.layers.0.mlp.experts.1.down_proj.bias"] = "model-extra.safetensors"
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="bias"):
        KTMoEWrapper(0, E, 2, H, I, method="BF16", weight_path=path).load_weights()
    report = inspect_weights(path)
    assert report.layers == () and not _named_methods(report.notes), report
    assert any(note.startswith("layer 0") and "bias" in note for note in report.notes), report.notes


def test_a_layer_of_mixed_dtypes_is_no_row(tmp_path: Path) -> None:
    """One fp16 tensor among a layer's bf16 experts: the readers refuse the layer ("mixes
    dtypes"); inspect showed it as a bf16 layer the methods would pack."""
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path, make_weights([0], E, H, I))
    file = path / "model-00001-of-00001.safetensors"
    tensors = load_file(str(file))
    key = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors[key] = tensors[key].half()
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="mixes dtypes"):
        KTMoEWrapper(0, E, 2, H, I, method="BF16", weight_path=path).load_weights()
    report = inspect_weights(path)
    assert report.layers == () and not _named_methods(report.notes), report
    assert any(note.startswith("layer 0 mixes dtypes") for note in report.notes), report.notes


@pytest.mark.parametrize("experts", ["mxfp4", "mixed"])
def test_the_methods_a_gguf_names_load_it(tmp_path: Path, experts: str) -> None:
    """A GGUF's inspection named no method; it names LLAMAFILE, and MXFP4 where every expert
    matrix is MXFP4 (the only GGUF that method reads), and each loads every layer."""
    import numpy as np
    from gguf_helpers import random_blocks, write_model
    from test_mxfp4_checkpoint import write_gpt_oss_gguf

    path = tmp_path / "m.gguf"
    if experts == "mxfp4":
        write_gpt_oss_gguf(path, torch.Generator().manual_seed(9))
    else:
        rng = np.random.default_rng(0)
        shapes = {"ffn_gate_exps": (I, H), "ffn_up_exps": (I, H), "ffn_down_exps": (H, I)}
        types = dict(zip(shapes, ("Q4_K", "Q8_0", "Q6_K")))
        write_model(path, [None, {name: (types[name], random_blocks(types[name], E * rows, k, rng).reshape(E, rows, -1))
                                  for name, (rows, k) in shapes.items()}], E, H, I)
    report = inspect_weights(path)
    named = re.findall(r"\b(LLAMAFILE|MXFP4)\b(?= \()", dict(report.facts)["method"])
    assert named == (["LLAMAFILE", "MXFP4"] if experts == "mxfp4" else ["LLAMAFILE"]), report.facts
    for method in named:
        for layer in report.layers:
            wrapper = KTMoEWrapper(layer.layer, layer.num_experts, 2, layer.hidden_size, layer.intermediate_size,
                                   method=method, weight_path=path)
            wrapper.load_weights()
