"""GPU staging layouts (kt_ops.staging, KTMoEWrapper.submit_write_weight_scale_to_buffer):
checkpoints read in place are written back byte for byte in kt-kernel's per-rank layouts
(../shared/reference/kt-kernel-upstream-specs.md §6.5), layers quantized online decode to
the oracle's weights, and what has no layout is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kt_ops
from checkpoint_helpers import make_weights, write_checkpoint, write_fp8_layer
from kt_ops import reference
from kt_ops.staging import stage_expert, stage_rows_into, write_weight_scale_to_buffer
from kt_ops.wrappers import KTMoEWrapper
from test_int4_checkpoint import write_int4_checkpoint
from test_mxfp4_checkpoint import write_deepseek_v4

E2M1 = torch.tensor(reference.MXFP4_VALUES)
NAN_CODES = (0x7F, 0xFF)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, k / 2]`` uint8 -> ``[n, k]`` codes, element 2j from the low nibble."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()


def decode(method: str, s, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent decode of one rank's staged (w13, w2) to fp32."""
    def one(w: torch.Tensor, scale: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
        if method == "BF16":
            return w.float()
        if method == "FP8":
            per = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            return w.float() * per
        if method == "FP8_PERCHANNEL":
            return w.float() * scale.reshape(-1, 1)
        if method == "MXFP8":
            return w.float() * torch.exp2(scale.float() - 127).repeat_interleave(32, 1)
        codes = nibbles(w)
        values = (codes - 8).float() if method == "RAWINT4" else E2M1[codes]
        return values * scale.float().repeat_interleave(k // scale.shape[1], 1)

    H = s.w2_weight.shape[0]
    k13 = s.w13_weight.shape[1] * (2 if s.w13_weight.dtype == torch.uint8 else 1)
    return one(s.w13_weight, s.w13_scale, 2 * rows, k13), one(s.w2_weight, s.w2_scale, H, rows)


@pytest.mark.parametrize("method", ["BF16", "FP8", "FP8_PERCHANNEL", "MXFP8", "RAWINT4", "MXFP4"])
@pytest.mark.parametrize("tp", [1, 2])
def test_online_layers_stage_the_oracles_weights(method: str, tp: int) -> None:
    E, H, I = 3, 256, 256
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(*shape, generator=g) * 0.05 for shape in ((E, I, H), (E, I, H), (E, H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method=method)
    rg, ru, rd = reference.dequantize(packed.data)
    ir = I // tp
    staged = stage_expert(packed, 1, tp)
    assert len(staged) == tp
    for r, s in enumerate(staged):
        rows = slice(r * ir, (r + 1) * ir)
        w13, w2 = decode(method, s, ir)
        want13, want2 = torch.cat((rg[1, rows], ru[1, rows])), rd[1, :, rows]
        if method == "RAWINT4":  # fp32 scales truncated to bf16, as kt-kernel does
            torch.testing.assert_close(w13, want13, rtol=2**-7, atol=0)
            torch.testing.assert_close(w2, want2, rtol=2**-7, atol=0)
        else:
            assert torch.equal(w13, want13) and torch.equal(w2, want2)


def test_a_partial_last_scale_group_is_staged() -> None:
    """MXFP8 with I = 71: down's rows end in a 7-value group whose scale must be staged
    (a floor division once dropped it)."""
    E, H, I = 2, 96, 71
    g = torch.Generator().manual_seed(2)
    gate, up, down = (torch.randn(*shape, generator=g) * 0.05 for shape in ((E, I, H), (E, I, H), (E, H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method="MXFP8")
    s = stage_expert(packed, 1)[0]
    assert tuple(s.w2_scale.shape) == (H, 3) and tuple(s.w13_scale.shape) == (2 * I, 3)
    w2 = s.w2_weight.float() * torch.exp2(s.w2_scale.float() - 127).repeat_interleave(32, 1)[:, :I]
    assert torch.equal(w2, reference.dequantize(packed.data)[2][1])


@pytest.mark.parametrize("method,group_size", [("BF16", None), ("AMXINT8", None), ("FP8", None),
                                               ("FP8_PERCHANNEL", None), ("MXFP8", None)])
@pytest.mark.parametrize("H,I", [(96, 48), (352, 200), (130, 66)])
def test_every_step_of_the_row_writers_stages_the_oracles_weights(method: str, group_size: int | None, H: int,
                                                                  I: int) -> None:
    """Sizes that take each step of the AVX2 row writers (whole 64-byte lines per row,
    streamed where aligned; half lines; the scalar rest), rows aligned and not, and partial
    16-row blocks."""
    stage_and_compare(method, group_size, H, I)


@pytest.mark.parametrize("method,group_size", [("FP8", None), ("RAWINT4", 32), ("AMXINT4", 64)])
def test_fp32_scales_of_eight_groups_and_more_are_transposed_as_the_codes(method: str, group_size: int | None) -> None:
    """FP8's block scales and INT4's fp32 scales (the prefill rows) of 8 or more groups go
    through the vector transpose (8 at a time, the rest scalar): H 1152, I 320 give 9 / 3
    (FP8), 36 / 10 (groups of 32) and 18 / 5 (groups of 64) groups per row."""
    stage_and_compare(method, group_size, 1152, 320)


def stage_and_compare(method: str, group_size: int | None, H: int, I: int) -> None:
    """Stages two experts of a layer packed online into the prefill rows (buffers filled
    with 0xAB first) and checks that the rows expand to the oracle's weights exactly."""
    from kt_ops.gpu_prefill import expand_rows, row_layout

    E = 2
    g = torch.Generator().manual_seed(3)
    gate, up, down = (torch.randn(*shape, generator=g) * 0.05 for shape in ((E, I, H), (E, I, H), (E, H, I)))
    packed = kt_ops.pack_experts(gate, up, down, method=method,
                                 **({} if group_size is None else {"group_size": group_size}))
    layout = row_layout(packed)
    outs = layout.buffers(E)
    for t in outs:
        t.fill_(0xAB)
    for e in range(E):
        stage_rows_into(packed, e, [t[e] for t in outs], layout.int4_fp32_scales)
    r = layout.views(outs)
    want = reference.dequantize(packed.data)
    for got, scale, k, w in ((r.gate, r.gate_scale, H, want[0]), (r.up, r.up_scale, H, want[1]),
                             (r.down, r.down_scale, I, want[2])):
        assert torch.equal(expand_rows(layout, got, scale, k, torch.float32), w.float())


def fp8_wrapper(tmp_path: Path, kind: str, method: str) -> tuple[KTMoEWrapper, dict]:
    E, H, I = 3, 256, 256
    path, mats = write_fp8_layer(tmp_path, kind, "per_expert", E=E, H=H, I=I, layer=1)
    if kind == "mxfp8":  # exponent code 0 is refused by the packer (docs/formats.md): use 127
        tensors = load_file(str(path / "model.safetensors"))
        for key, t in tensors.items():
            if key.endswith("weight_scale_inv"):
                codes = t.view(torch.uint8).clone()
                codes[codes == 0] = 127
                tensors[key] = codes
        save_file(tensors, str(path / "model.safetensors"))
        for name, (codes, scale) in mats.items():
            scale[scale == 0] = 127
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           weight_path=path, method=method)
    wrapper.load_weights()
    return wrapper, mats


def staged_by_wrapper(wrapper: KTMoEWrapper, expert: int, tp: int) -> list[dict[str, torch.Tensor]]:
    """Writes through submit/sync into tensors (rank 0) and raw host addresses (the others)."""
    shapes = stage_expert(wrapper._parts, int(wrapper._route[expert]), tp)
    out, keep = [], []
    dests: dict[str, list] = {"w13_weight": [], "w13_scale": [], "w2_weight": [], "w2_scale": []}
    for r, s in enumerate(shapes):
        bufs = {}
        for name in dests:
            t = getattr(s, name)
            buf = torch.full((t.numel() * t.element_size(),), 0xAB, dtype=torch.uint8) if t is not None else None
            bufs[name] = buf
            dests[name].append(None if buf is None else (buf if r == 0 else buf.data_ptr()))
        out.append(bufs)
        keep.append(shapes[r])
    wrapper.submit_write_weight_scale_to_buffer(tp, expert, dests["w13_weight"], dests["w13_scale"],
                                                dests["w2_weight"], dests["w2_scale"])
    wrapper.sync_write_weight_scale_to_buffer()
    return [{name: None if b is None else b.view(getattr(keep[r], name).dtype).reshape(getattr(keep[r], name).shape)
             for name, b in bufs.items()} for r, bufs in enumerate(out)]


@pytest.mark.parametrize("kind,method", [("fp8", "FP8"), ("fp8_perchannel", "FP8_PERCHANNEL"), ("mxfp8", "MXFP8")])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_checkpoints_stage_their_own_bytes(tmp_path: Path, kind: str, method: str, tp: int) -> None:
    wrapper, mats = fp8_wrapper(tmp_path, kind, method)
    (gate, gate_s), (up, up_s), (down, down_s) = mats["gate"], mats["up"], mats["down"]
    I, e = gate.shape[1], 2
    ir = I // tp
    for r, got in enumerate(staged_by_wrapper(wrapper, e, tp)):
        rows = slice(r * ir, (r + 1) * ir)
        assert torch.equal(got["w13_weight"].view(torch.uint8), torch.cat((gate[e, rows], up[e, rows])))
        assert torch.equal(got["w2_weight"].view(torch.uint8), down[e, :, rows])
        if kind == "fp8":
            want13 = torch.cat((gate_s[e, r * ir // 128 : (r + 1) * ir // 128], up_s[e, r * ir // 128 : (r + 1) * ir // 128]))
            assert torch.equal(got["w13_scale"], want13)
            assert torch.equal(got["w2_scale"], down_s[e][:, r * ir // 128 : (r + 1) * ir // 128])
            continue
        # Rows (per channel) or groups (mxfp8) holding a NaN code carry the packer's NaN mark
        # (docs/formats.md): their outputs are NaN on the GPU either way.
        def nan_groups(codes: torch.Tensor, group: int) -> torch.Tensor:
            bad = (codes == NAN_CODES[0]) | (codes == NAN_CODES[1])
            return bad.reshape(codes.shape[0], -1, group).any(-1) if group else bad.any(-1)

        if kind == "fp8_perchannel":
            checks = ((got["w13_scale"], torch.cat((gate_s[e, rows], up_s[e, rows])),
                       nan_groups(torch.cat((gate[e, rows], up[e, rows])), 0)),
                      (got["w2_scale"], down_s[e], nan_groups(down[e], 0)))
            for staged, want, bad in checks:
                assert torch.equal(staged[~bad], want[~bad]) and bool(staged[bad].isnan().all())
        else:
            checks = ((got["w13_scale"], torch.cat((gate_s[e, rows], up_s[e, rows])),
                       nan_groups(torch.cat((gate[e, rows], up[e, rows])), 32)),
                      (got["w2_scale"], down_s[e][:, r * ir // 32 : (r + 1) * ir // 32],
                       nan_groups(down[e][:, rows].contiguous(), 32)))
            for staged, want, bad in checks:
                assert torch.equal(staged[~bad], want[~bad]) and bool((staged[bad] == 255).all())


@pytest.mark.parametrize("tp", [1, 2])
def test_rawint4_checkpoint_stages_its_own_bytes(tmp_path: Path, tp: int) -> None:
    path, _ = write_int4_checkpoint(tmp_path, "RAWINT4")
    tensors = load_file(str(path / "model.safetensors"))
    E, H, I = 3, 256, 128
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           weight_path=path, method="RAWINT4")
    wrapper.load_weights()
    e, ir = 0, I // tp  # expert 0 stores int32 words (expert 1 uint8 bytes: the same bytes)
    base = f"model.layers.1.mlp.experts.{e}"

    def raw(name: str, suffix: str) -> torch.Tensor:
        t = tensors[f"{base}.{name}.{suffix}"]
        return t.view(torch.uint8).reshape(t.shape[0], -1) if suffix == "weight_packed" else t

    for r, got in enumerate(staged_by_wrapper(wrapper, e, tp)):
        rows = slice(r * ir, (r + 1) * ir)
        assert torch.equal(got["w13_weight"], torch.cat((raw("gate_proj", "weight_packed")[rows],
                                                         raw("up_proj", "weight_packed")[rows])))
        assert torch.equal(got["w2_weight"], raw("down_proj", "weight_packed")[:, r * ir // 2 : (r + 1) * ir // 2])
        assert torch.equal(got["w13_scale"], torch.cat((raw("gate_proj", "weight_scale")[rows],
                                                        raw("up_proj", "weight_scale")[rows])))
        assert torch.equal(got["w2_scale"], raw("down_proj", "weight_scale")[:, r * ir // 32 : (r + 1) * ir // 32])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("parts", [1, 2])
def test_deepseek_v4_mxfp4_stages_its_own_bytes(tmp_path: Path, tp: int, parts: int) -> None:
    write_deepseek_v4(tmp_path, torch.Generator().manual_seed(5))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    E, H, I = 4, 96, 64
    wrapper = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           weight_path=tmp_path, method="MXFP4", threadpool_count=parts)
    wrapper.load_weights()
    e, ir = 3, I // tp
    key = f"layers.0.ffn.experts.{e}"
    w = {n: tensors[f"{key}.{n}.weight"].view(torch.uint8) for n in ("w1", "w3", "w2")}
    s = {n: tensors[f"{key}.{n}.scale"].view(torch.uint8) for n in ("w1", "w3", "w2")}
    bf16 = lambda codes: (codes.to(torch.int32) << 7).to(torch.int16).view(torch.bfloat16)  # 2^(e - 127), e in (0, 255)
    for r, got in enumerate(staged_by_wrapper(wrapper, e, tp)):
        rows = slice(r * ir, (r + 1) * ir)
        assert torch.equal(got["w13_weight"], torch.cat((w["w1"][rows], w["w3"][rows])))
        assert torch.equal(got["w2_weight"], w["w2"][:, r * ir // 2 : (r + 1) * ir // 2])
        assert torch.equal(got["w13_scale"], bf16(torch.cat((s["w1"][rows], s["w3"][rows]))))
        assert torch.equal(got["w2_scale"], bf16(s["w2"][:, r * ir // 32 : (r + 1) * ir // 32]))


def test_bf16_checkpoint_stages_its_own_bytes(tmp_path: Path) -> None:
    E, H, I = 3, 64, 96
    weights = make_weights([1], E, H, I)
    path = write_checkpoint(tmp_path, weights)
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           weight_path=path, method="BF16")
    wrapper.load_weights()
    gate, up, down = (t.bfloat16() for t in weights[1])
    for r, got in enumerate(staged_by_wrapper(wrapper, 1, 2)):
        rows = slice(r * 48, (r + 1) * 48)
        assert torch.equal(got["w13_weight"], torch.cat((gate[1, rows], up[1, rows])))
        assert torch.equal(got["w2_weight"], down[1, :, rows])
        assert got["w13_scale"] is None and got["w2_scale"] is None


def test_scale_conversions() -> None:
    """int4 scales: fp32 -> bf16 by truncation (kt-kernel's); MXFP4: the OCP values of ue8m0."""
    E, H, I = 1, 64, 64
    w = torch.zeros(E, I, H)
    w[0, 0, 0] = -8 * (1.0 + 2**-8 + 2**-9)  # the group's scale: its largest weight / -8 = 1 + 2^-8 + 2^-9
    packed = kt_ops.pack_experts(w, w, w.transpose(1, 2).contiguous(), method="RAWINT4")
    scale = stage_expert(packed, 0)[0].w13_scale[0, 0].item()
    assert scale == 1.0, scale  # rounding would give 1 + 2^-7
    blob = kt_ops.pack_experts(w, w, w.transpose(1, 2).contiguous(), method="LLAMAFILE", gguf_type="MXFP4").data.clone()
    info = kt_ops._native._C.packed_info(blob)
    gate = blob[info["matrix_offsets"][0] :].view(-1)
    codes = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    gate[torch.arange(5) * 17] = codes  # the exponents of gate row 0's first blocks... (2 blocks per row)
    blocks = [blob[o : o + E * 64 * 2 * 17] for o in info["matrix_offsets"]]
    mxfp4 = kt_ops._native._C.mxfp4_experts_from_blocks(*blocks, E, H, I)  # format mxfp4: the same scales
    for packed in (blob, mxfp4):
        staged = stage_expert(kt_ops.PackedExperts(packed), 0)[0].w13_scale.float().reshape(-1)[:5]
        assert staged[0].item() == 2.0**-127 and staged[1].item() == 2.0**-126 and staged[2].item() == 1.0
        assert staged[3].item() == 2.0**127 and staged[4].isnan()


def test_what_has_no_staging_layout_is_refused(tmp_path: Path) -> None:
    E, H, I = 3, 256, 128
    g = torch.randn(E, I, H) * 0.05
    d = torch.randn(E, H, I) * 0.05
    for method, kwargs in (("AMXINT8", {}), ("AWQ_INT4", {}), ("LLAMAFILE", {"gguf_type": "Q8_0"})):
        packed = kt_ops.pack_experts(g, g, d, method=method, **kwargs)
        with pytest.raises(ValueError, match="no GPU staging layout"):
            stage_expert(packed, 0)
    fp8 = kt_ops.pack_experts(g, g, d, method="FP8")
    with pytest.raises(ValueError, match="does not divide"):
        stage_expert(fp8, 0, 5)
    with pytest.raises(ValueError, match="not multiples of the fp8 scale group"):
        stage_expert(fp8, 0, 2)  # I_r = 64 cuts 128-row blocks
    with pytest.raises(ValueError, match="not in this layer"):
        stage_expert(fp8, 3)
    staged = stage_expert(fp8, 0)[0]
    with pytest.raises(ValueError, match="contiguous tensor of"):
        write_weight_scale_to_buffer(fp8, 0, 1, [torch.empty(3, dtype=torch.uint8)], [staged.w13_scale],
                                     [staged.w2_weight], [staged.w2_scale])
    with pytest.raises(ValueError, match="entries for gpu_tp_count"):
        write_weight_scale_to_buffer(fp8, 0, 1, [], [], [], [])

    weights = make_weights([1], E, 64, 32)
    path = write_checkpoint(tmp_path, weights)
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
                           weight_path=path, method="BF16", num_gpu_experts=1)
    with pytest.raises(RuntimeError, match="load_weights first"):
        wrapper.submit_write_weight_scale_to_buffer(1, 1, [0], [0], [0], [0])
    wrapper.load_weights()
    gpu_slot = int(torch.nonzero(wrapper.gpu_experts_mask)[0])
    with pytest.raises(ValueError, match="GPU expert"):
        wrapper.submit_write_weight_scale_to_buffer(1, gpu_slot, [0], [0], [0], [0])
    with pytest.raises(ValueError, match="not a slot"):
        wrapper.submit_write_weight_scale_to_buffer(1, E, [0], [0], [0], [0])
    for slot in (1.5, True):  # IndexError / RuntimeError from indexing the route with them
        with pytest.raises(ValueError, match="not a slot"):
            wrapper.submit_write_weight_scale_to_buffer(1, slot, [0], [0], [0], [0])
    with pytest.raises(ValueError, match="gpu_tp_count must be a positive int"):
        wrapper.submit_write_weight_scale_to_buffer(1.0, int(torch.nonzero(~wrapper.gpu_experts_mask)[0]), [0], [0],
                                                    [0], [0])
    cpu_slot = int(torch.nonzero(~wrapper.gpu_experts_mask)[0])
    wrapper.submit_write_weight_scale_to_buffer(1, cpu_slot, [0], [None], [0], [None])
    with pytest.raises(ValueError, match="host address"):
        wrapper.sync_write_weight_scale_to_buffer()


def test_a_gpu_slot_of_a_layer_with_every_slot_on_the_gpu_is_named(tmp_path: Path) -> None:
    """Every slot on the GPU, weights loaded: staging a slot is the GPU-expert ValueError (was a RuntimeError saying
    to call load_weights, which had been called)."""
    E, H, I = 3, 64, 32
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           method="BF16", num_gpu_experts=E)
    with pytest.raises(RuntimeError, match="load_weights first"):
        wrapper.submit_write_weight_scale_to_buffer(1, 0, [0], [0], [0], [0])
    wrapper.load_weights_from_tensors(*make_weights([1], E, H, I)[1])
    with pytest.raises(ValueError, match="expert_id 0 is a GPU expert"):
        wrapper.submit_write_weight_scale_to_buffer(1, 0, [0], [0], [0], [0])


@pytest.mark.parametrize("bad", [None, 0, torch.empty(0)])
def test_destinations_that_are_not_lists_are_named(bad: object) -> None:
    """A destination list that is not a list (None, one address, a bare tensor) is a ValueError naming it (was a
    TypeError "object of type 'NoneType' has no len()", or a tensor's elements taken as destinations)."""
    E, H, I = 2, 64, 32
    packed = kt_ops.pack_experts(*make_weights([1], E, H, I)[1], method="BF16")
    staged = stage_expert(packed, 0)[0]
    with pytest.raises(ValueError, match="w2_weight_ptrs must be a list or tuple of 1 destination"):
        write_weight_scale_to_buffer(packed, 0, 1, [torch.empty_like(staged.w13_weight)], [None], bad, [None])


@pytest.mark.parametrize("method,I", [("FP8", 192), ("MXFP8", 80), ("MXFP8", 96), ("FP8_PERCHANNEL", 128)])
def test_parts_that_cut_a_down_scale_group_are_refused(method: str, I: int) -> None:
    """NUMA parts (threadpool_count) whose I slices cut a down_proj scale group (FP8 blocks of 128, MXFP8 groups of
    32), or whose per-channel down scales differ, have no staging layout: a ValueError (were staged with the first
    part's scales over the next part's columns: silently wrong w2 weights on the GPU)."""
    from kt_ops.parts import pack_parts

    E, H = 2, 256
    gate, up = torch.zeros(E, I, H), torch.zeros(E, I, H)
    gate[:, :, ::32] = 1.0
    up[:, :, ::32] = 1.0  # every gate/up block the same scale: only down's differ
    down = torch.randn(E, H, I, generator=torch.Generator().manual_seed(0)) * 0.01
    down[:, :, 0], down[:, :, I // 2] = 1.0, 2.0
    parts = pack_parts(gate, up, down, method, 2)
    with pytest.raises(ValueError, match="scale"):
        stage_expert(parts, 0)


def test_parts_on_whole_scale_groups_stage_as_the_whole_layer() -> None:
    """Parts split on whole groups stage as the unsplit layer does."""
    from kt_ops.parts import pack_parts

    E, H, I = 2, 256, 256
    g = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(*shape, generator=g) * 0.05 for shape in ((E, I, H), (E, I, H), (E, H, I)))
    for method in ("FP8", "MXFP8", "MXFP4", "RAWINT4", "BF16"):
        whole = stage_expert(kt_ops.pack_experts(gate, up, down, method=method), 1)[0]
        split = stage_expert(pack_parts(gate, up, down, method, 2), 1)[0]
        assert torch.equal(split.w2_weight.view(torch.uint8), whole.w2_weight.view(torch.uint8)), method
        if whole.w2_scale is not None:
            assert torch.equal(split.w2_scale.view(torch.uint8), whole.w2_scale.view(torch.uint8)), method


@pytest.mark.parametrize("bad", [True, 2**64, "meta", "quantized", "conj", "sparse"])
def test_destinations_that_cannot_hold_the_bytes_are_refused(bad: object) -> None:
    """A bool (was taken as host address 1: SIGSEGV), an address past 64 bits (was an OverflowError from ctypes), a
    meta tensor (was a silent no-op: nothing staged), a quantized or conjugate-view tensor of the right size (were a
    RuntimeError from the copy, after rank 0's w13 was written) are ValueErrors naming the destination."""
    E, H, I = 2, 64, 32
    packed = kt_ops.pack_experts(*make_weights([1], E, H, I)[1], method="BF16")
    staged = stage_expert(packed, 0)[0]
    n = staged.w2_weight.numel() * 2
    dest = {"meta": lambda: torch.empty_like(staged.w2_weight, device="meta"),
            "quantized": lambda: torch.quantize_per_tensor(torch.zeros(n), 1.0, 0, torch.quint8),
            "conj": lambda: torch.zeros(n // 8, dtype=torch.complex64).conj(),
            "sparse": lambda: torch.zeros(n, dtype=torch.uint8).to_sparse()}.get(bad, lambda: bad)()
    with pytest.raises(ValueError, match=r"w2_weight_ptrs\[0\]"):
        write_weight_scale_to_buffer(packed, 0, 1, [torch.empty_like(staged.w13_weight)], [None], [dest], [None])


def test_a_bad_destination_is_refused_before_anything_is_written() -> None:
    """Every destination is checked before the first byte is written (a wrong-sized w2 buffer of rank 1 left rank 0's
    buffers half written)."""
    E, H, I = 2, 64, 32
    packed = kt_ops.pack_experts(*make_weights([1], E, H, I)[1], method="BF16")
    staged = stage_expert(packed, 0, 2)
    w13 = [torch.zeros_like(s.w13_weight) for s in staged]
    w2 = [torch.zeros_like(staged[0].w2_weight), torch.zeros(3)]
    with pytest.raises(ValueError, match=r"w2_weight_ptrs\[1\]"):
        write_weight_scale_to_buffer(packed, 0, 2, w13, [None, None], w2, [None, None])
    assert not any(bool(t.view(torch.uint8).any()) for t in w13 + w2)


@pytest.mark.parametrize("expert,tp,match", [(True, 1, "expert True"), (1.0, 1, "expert 1.0"),
                                             (0, True, "gpu_tp_count"), (0, 2.0, "gpu_tp_count")])
def test_an_expert_or_rank_count_that_is_not_an_int_is_refused(expert: object, tp: object, match: str) -> None:
    """stage_expert took True as expert 1 and as gpu_tp_count 1 (the wrapper refuses both), and 1.0 / 2.0 were a
    pybind or slicing TypeError naming nothing: ValueErrors naming the argument."""
    packed = kt_ops.pack_experts(*make_weights([1], 2, 64, 32)[1], method="BF16")
    with pytest.raises(ValueError, match=match):
        stage_expert(packed, expert, tp)


def test_destination_lists_are_read_at_submit(tmp_path: Path) -> None:
    """kt-kernel converts the pointer lists when submit is called; the write here ran later on the worker from the
    caller's list objects, so a caller refilling its lists for the next expert before the sync had this expert written
    into the next expert's buffers (and the first ones left unwritten)."""
    import threading

    E, H, I = 3, 64, 32
    wrapper = KTMoEWrapper(layer_idx=1, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                           method="BF16", num_gpu_experts=0)
    wrapper.load_weights_from_tensors(*make_weights([1], E, H, I)[1])
    want = stage_expert(wrapper._parts, 0)[0]
    first = [torch.zeros_like(want.w13_weight), torch.zeros_like(want.w2_weight)]
    second = [torch.zeros_like(want.w13_weight), torch.zeros_like(want.w2_weight)]
    w13, w2 = [first[0]], [first[1]]
    gate = threading.Event()
    blocker = KTMoEWrapper._run_on_worker(gate.wait, 10)  # the worker is busy until the lists are refilled
    wrapper.submit_write_weight_scale_to_buffer(1, 0, w13, [None], w2, [None])
    w13[0], w2[0] = second
    gate.set()
    blocker.result()
    wrapper.sync_write_weight_scale_to_buffer()
    assert torch.equal(first[0], want.w13_weight) and torch.equal(first[1], want.w2_weight)
    assert not bool(second[0].any()) and not bool(second[1].any())


@pytest.mark.parametrize("size", [0, 4096])
def test_staging_a_mapped_layer_whose_file_was_truncated_names_the_file(tmp_path: Path, size: int) -> None:
    """A layer memory-mapped by PackedExperts.load whose file was cut short afterwards: staging it (stage_expert, the
    wrapper's write, GPU prefill's rows) is the RuntimeError naming the file that moe_forward raises (it was SIGBUS:
    the process killed). Run in a subprocess so a crash fails the test only."""
    import subprocess
    import sys

    code = f"""
import os, torch, kt_ops
from kt_ops.staging import stage_expert
E, H, I = 4, 512, 256
packed = kt_ops.pack_experts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), method="BF16")
path = {str(tmp_path / "layer.safetensors")!r}
packed.save(path)
mapped = kt_ops.PackedExperts.load(path)
os.truncate(path, {size})
try:
    stage_expert(mapped, 3)
except RuntimeError as error:
    assert "layer.safetensors" in str(error), error
    print("refused")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["refused"], (result.returncode, result.stderr[-2000:])
