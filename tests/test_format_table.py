"""The format table (csrc/cpu/format_table.h) is the one list of formats: Python's lists,
the kernels per CPU variant, the header sizes, kt_ops.doctor() and docs/formats.md must
all agree with it, row for row."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import gguf
import kt_ops
from kt_ops import formats, gguf_types
from kt_ops._native import _C

DOCS = Path(__file__).resolve().parent.parent / "docs" / "formats.md"
ROWS = _C.format_table()
GGML_ROWS = _C.ggml_type_table()


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every pipe table of a markdown text as (header cells, body rows of cells)."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            tables.append((block[0], block[2:]))
        block = []
    return tables


def docs_table(first_header: str, second_header: str) -> list[list[str]]:
    """The body of the one docs/formats.md table whose header starts with these cells."""
    found = [rows for header, rows in markdown_tables(DOCS.read_text()) if header[:2] == [first_header, second_header]]
    assert len(found) == 1, f"docs/formats.md must have one table headed | {first_header} | {second_header} |"
    return found[0]


def table_methods() -> set[tuple[tuple[str, ...], bool, str]]:
    """(methods, zero_point, format) per row of the format table."""
    return {(tuple(row["methods"]), row["zero_point"], row["name"]) for row in ROWS}


def docs_methods(text: str | None = None) -> list[tuple[tuple[str, ...], bool, str]]:
    """(methods, zero_point, format) per row of the method table at the top of docs/formats.md."""
    rows = [rows for header, rows in markdown_tables(text or DOCS.read_text()) if header[:2] == ["method", "format"]]
    assert len(rows) == 1, "docs/formats.md must have one table headed | method | format |"
    parsed = []
    for cells in rows[0]:
        methods = tuple(re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[0]))
        parsed.append((methods, "zero_point=True" in cells[0], cells[1].strip("`")))
    return parsed


IN_PLACE_CELLS = {"all variants": kt_ops.CPU_VARIANTS, "AVX-512": ("avx512", "avx512_vnni", "avx512_bf16", "amx"), "—": ()}


def docs_ggml_types() -> dict[str, tuple[int, int, tuple[str, ...], str | None]]:
    """name -> (block elements, block bytes, variants reading it in place, llama.cpp
    fallback) per type of the GGUF table of docs/formats.md (a row may list several types)."""
    types = {}
    for cells in docs_table("type", "block"):
        names = [name.strip() for name in cells[0].split(",")]
        sizes = [int(size) for size in cells[2].split(":")[0].split("/")]
        if len(sizes) == 1:
            sizes *= len(names)
        assert len(sizes) == len(names), f"docs/formats.md GGUF row {cells[0]}: one byte size per type"
        fallback = None if cells[5] == "—" else cells[5].split()[0]
        for name, size in zip(names, sizes):
            assert name not in types, f"docs/formats.md lists GGUF type {name} twice"
            types[name] = (int(cells[1]), size, tuple(IN_PLACE_CELLS[cells[4]]), fallback)
    return types


# --- the table itself ---------------------------------------------------------------------


def test_rows_are_in_header_id_order_with_unique_names_and_methods() -> None:
    assert [row["id"] for row in ROWS] == list(range(1, len(ROWS) + 1))
    assert len({row["name"] for row in ROWS}) == len(ROWS)
    selectors = [(method, row["zero_point"]) for row in ROWS for method in row["methods"]]
    assert len(selectors) == len(set(selectors)), "a (method, zero_point) selects one format"
    assert all(row["methods"] for row in ROWS), "every format has a kt-kernel method"


def test_every_format_has_a_kernel_for_every_variant() -> None:
    for row in ROWS:
        assert list(row["kernels"]) == list(kt_ops.CPU_VARIANTS)
        for variant, name in row["kernels"].items():
            assert name.startswith(f"{row['name']}/{variant} ("), name
            assert _C.kernel_name(row["name"], variant) == name


def test_every_oracle_is_a_reference_function() -> None:
    for row in ROWS:
        module, _, function = row["oracle"].rpartition(".")
        assert module == "kt_ops.reference", row["oracle"]
        assert callable(getattr(importlib.import_module(module), function))


def test_block_geometry_gives_the_header_sizes() -> None:
    """The geometry fields predict packed_nbytes (the C++ layouts) for every format."""
    E = 3
    for row in ROWS:
        if row["k_rule"] == "ggml_block":
            continue
        group = row["default_group_size"]
        H, I = (2 * group, group) if group else (297, 40)  # odd H, I off the 16-row blocks (H > 256: fp8 groups)

        def block_bytes(k: int, pad: int) -> int:
            padded = -(-k // pad) * pad
            if row["scale_group_k"]:  # fixed groups over the real k (fp8, mxfp8)
                scale_rows = -(-k // row["scale_group_k"])
            else:
                scale_rows = padded // group if group else (1 if row["scale_bytes"] else 0)
            scales = -(-scale_rows * row["scale_bytes"] * row["block_rows"] // row["scale_pad"]) * row["scale_pad"]
            return padded // row["line_k"] * row["line_bytes"] + scales + row["row_tail_bytes"] * row["block_rows"]

        blocks_i, blocks_h = -(-I // row["block_rows"]), -(-H // row["block_rows"])
        # down's k (the intermediate) comes out of gate/up in whole blocks: padded to block_rows too
        down_pad = max(row["k_pad"], row["block_rows"])
        expected = 256 + E * (2 * blocks_i * block_bytes(H, row["k_pad"]) + blocks_h * block_bytes(I, down_pad))
        assert _C.packed_nbytes(row["name"], E, H, I, group) == expected, row["name"]


def test_row_length_rules() -> None:
    for row in ROWS:
        if row["k_rule"] == "group_size":
            assert row["group_sizes"] and row["default_group_size"] in row["group_sizes"]
            for group in row["group_sizes"]:
                _C.packed_nbytes(row["name"], 1, 2 * group, group, group)
                with pytest.raises(ValueError, match="must divide"):
                    _C.packed_nbytes(row["name"], 1, group * 3 // 2, group, group)
        else:
            assert not row["group_sizes"] and row["default_group_size"] == 0
        if row["k_rule"] == "any":
            _C.packed_nbytes(row["name"], 1, 7, 5, 0)  # any K, padded
        if row["max_k"]:
            _C.packed_nbytes(row["name"], 1, row["max_k"], 16, 0)
            with pytest.raises(ValueError, match=str(row["max_k"])):
                _C.packed_nbytes(row["name"], 1, row["max_k"] + 1, 16, 0)


def test_ggml_types_match_the_gguf_package() -> None:
    for row in GGML_ROWS:
        qtype = gguf.GGMLQuantizationType[row["name"]]
        assert row["id"] == int(qtype)
        assert (row["block_elems"], row["block_bytes"]) == gguf.GGML_QUANT_SIZES[qtype]
        assert row["is_float"] == (row["block_elems"] == 1)
        assert _C.ggml_type(row["id"]) == (row["name"], row["block_elems"], row["block_bytes"])
        if row["llama_cpp_fallback"] is not None:
            assert row["llama_cpp_fallback"] in gguf.GGMLQuantizationType.__members__
        # every variant reads every quantized type in place
        expected = () if row["is_float"] else kt_ops.CPU_VARIANTS
        assert tuple(row["in_place_variants"]) == tuple(expected)


# --- Python reads it ------------------------------------------------------------------------


def test_python_lists_equal_the_table() -> None:
    assert [f.name for f in formats.FORMATS] == [row["name"] for row in ROWS]
    for info, row in zip(formats.FORMATS, ROWS):
        assert info == formats.FormatInfo.from_row(row)
        assert dict(info.kernels) == row["kernels"] and list(info.methods) == row["methods"]
    assert formats.METHOD_FORMATS == {m: row["name"] for row in ROWS if not row["zero_point"] for m in row["methods"]}
    assert formats.ZERO_POINT_FORMATS == {m: row["name"] for row in ROWS if row["zero_point"] for m in row["methods"]}
    assert kt_ops.METHOD_FORMATS is formats.METHOD_FORMATS
    assert formats.GROUPED_FORMATS == tuple(row["name"] for row in ROWS if row["group_sizes"])
    assert formats.GROUP_SIZES == tuple(sorted({g for row in ROWS for g in row["group_sizes"]}))
    # formats with a choice of group sizes share the default; a fixed group (mxfp4's 32) is its own default
    assert {row["default_group_size"] for row in ROWS if len(row["group_sizes"]) > 1} == {formats.DEFAULT_GROUP_SIZE}
    for row in ROWS:
        if len(row["group_sizes"]) == 1:
            assert row["default_group_size"] == row["group_sizes"][0]
            assert all(formats.default_group_size(m) == row["group_sizes"][0] for m in row["methods"])
    for method, fmt in formats.METHOD_FORMATS.items():
        assert formats.format_for_method(method) == fmt
    for method, fmt in formats.ZERO_POINT_FORMATS.items():
        assert formats.format_for_method(method, zero_point=True) == fmt
    assert formats.format_info("int4_asym").zero_point


def test_python_ggml_types_equal_the_table() -> None:
    assert gguf_types.SUPPORTED_TYPES == tuple(row["name"] for row in GGML_ROWS)
    assert [t.name for t in gguf_types.GGML_TYPES] == list(gguf_types.SUPPORTED_TYPES)
    supported = set(gguf_types.SUPPORTED_TYPES)
    assert gguf_types.LLAMA_CPP_FALLBACK == {
        row["name"]: row["llama_cpp_fallback"] for row in GGML_ROWS if row["llama_cpp_fallback"] in supported
    }
    for row in GGML_ROWS:
        assert gguf_types.gguf_type_id(row["name"]) == row["id"]


def test_error_messages_list_what_the_table_holds() -> None:
    with pytest.raises(ValueError) as method_error:
        formats.format_for_method("INT3")
    assert f"implemented: {', '.join(formats.METHOD_FORMATS)}" in str(method_error.value)
    weights = torch.zeros(1, 32, 32)
    with pytest.raises(ValueError) as format_error:
        torch.ops.kt.pack_experts(weights, weights, weights, "int3")
    assert f"expected one of: {', '.join(row['name'] for row in ROWS)}" in str(format_error.value)
    with pytest.raises(ValueError) as type_error:
        _C.ggml_type(int(gguf.GGMLQuantizationType.IQ4_XS))
    assert all(name in str(type_error.value) for name in gguf_types.SUPPORTED_TYPES)


def test_doctor_lists_every_format_with_the_active_kernel() -> None:
    report = kt_ops.doctor()
    active = kt_ops.cpu_variant()
    for info in formats.FORMATS:
        assert re.search(rf"^  {info.name} +methods? {', '.join(info.methods)}.*: {re.escape(info.kernels[active])}$",
                         report, re.MULTILINE), info.name
    in_place = [t.name for t in gguf_types.GGML_TYPES if active in t.in_place_variants]
    assert f"read in place: {', '.join(in_place) or 'none'}" in report
    # Each published 4-bit checkpoint method names the format the wrapper packs it into.
    checkpoints = re.search(r"^4-bit checkpoints read in place: (.*)$", report, re.MULTILINE)
    assert checkpoints is not None, report
    for method, (fmt, _) in formats.CHECKPOINT_METHODS.items():
        assert f"{method} -> {fmt}" in checkpoints[1]
        formats.format_info(fmt)  # a format of the table


# --- docs/formats.md is checked against it --------------------------------------------------


def test_docs_method_table_matches_the_format_table() -> None:
    documented = docs_methods()
    assert len(documented) == len(set(documented)), "docs/formats.md lists a method row twice"
    assert set(documented) == table_methods()


def test_docs_method_check_catches_a_missing_or_extra_row() -> None:
    text = DOCS.read_text()
    bf16_row = next(line for line in text.splitlines() if line.startswith("| `BF16` |"))
    assert set(docs_methods(text.replace(bf16_row + "\n", ""))) != table_methods()
    extra = bf16_row.replace("`BF16`", "`NO_SUCH_METHOD`").replace("`bf16`", "`no_such_format`")
    assert set(docs_methods(text.replace(bf16_row, bf16_row + "\n" + extra))) != table_methods()


def test_docs_ggml_types_match_the_table() -> None:
    table = {
        row["name"]: (row["block_elems"], row["block_bytes"], tuple(row["in_place_variants"]), row["llama_cpp_fallback"])
        for row in GGML_ROWS
    }
    assert docs_ggml_types() == table


def test_docs_header_format_ids_match_the_table() -> None:
    match = re.search(r"format id \(([^)]*)\)", DOCS.read_text())
    assert match, "docs/formats.md names the header's format ids"
    ids = dict((name, int(number)) for number, name in (item.split() for item in match.group(1).split(", ")))
    assert ids == {row["name"]: row["id"] for row in ROWS}
