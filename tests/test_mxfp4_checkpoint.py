"""MXFP4 experts through KTMoEWrapper: a gpt-oss GGUF with MXFP4 experts and expert
biases against kt_ops.reference on the weights gguf.quants decodes, gpt-oss's
alpha-SwiGLU and biases included.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import kt_ops
from conftest import random_routing, rel_err
from kt_ops import KTMoEWrapper, reference

E, H, I = 4, 96, 64


def run_wrapper(path: Path, layer: int, **kwargs) -> tuple[KTMoEWrapper, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    wrapper = KTMoEWrapper(layer_idx=layer, num_experts=E, num_experts_per_tok=2, hidden_size=H,
                           moe_intermediate_size=I, weight_path=path, method=kwargs.pop("method", "MXFP4"), **kwargs)
    wrapper.load_weights()
    T = 7
    ids, weights = random_routing(T, E, 2, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(8))
    return wrapper, x, ids, weights, wrapper.forward(x, ids.long(), weights)


# --- GGUF ------------------------------------------------------------------------------


def write_gpt_oss_gguf(path: Path, g: torch.Generator, arch: str = "gpt-oss"):
    """A one-layer GGUF with MXFP4 experts (ggml block order) and F32 expert biases."""
    rng = np.random.default_rng(int(torch.randint(0, 1000, (1,), generator=g)))
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_block_count(1)
    writer.add_expert_count(E)
    writer.add_expert_used_count(2)
    writer.add_embedding_length(H)
    writer.add_expert_feed_forward_length(I)
    weights, biases = [], []
    for name, (rows, k) in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), ((I, H), (I, H), (H, I))):
        raw = rng.integers(0, 256, size=(E, rows, k // 32, 17), dtype=np.uint8)
        raw[..., 0] = rng.integers(119, 125, size=(E, rows, k // 32), dtype=np.uint8)
        writer.add_tensor(f"blk.0.{name}.weight", raw.reshape(E, rows, -1), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        bias = rng.standard_normal((E, rows)).astype(np.float32)
        writer.add_tensor(f"blk.0.{name}.bias", bias)
        weights.append(torch.from_numpy(gguf.quants.dequantize(raw.reshape(E * rows, -1), gguf.GGMLQuantizationType.MXFP4))
                       .reshape(E, rows, k))
        biases.append(torch.from_numpy(bias))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tuple(weights), tuple(biases)


def test_gpt_oss_gguf(tmp_path: Path) -> None:
    path = tmp_path / "gpt-oss.gguf"
    (gate, up, down), biases = write_gpt_oss_gguf(path, torch.Generator().manual_seed(9))
    got = kt_ops.load_gguf_expert_biases(path, 0)
    for ours, theirs in zip(got, biases):
        assert torch.equal(ours, theirs)
    for method in ("LLAMAFILE", "MXFP4"):
        wrapper, x, ids, weights, out = run_wrapper(path, 0, method=method)
        assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (pytest.approx(1.702), 7.0)
        assert wrapper._parts[0].has_biases
        ref = reference.moe_forward(x, ids, weights, gate, up, down, swiglu_limit=7.0, swiglu_alpha=1.702, biases=biases)
        assert rel_err(out, ref) <= 3e-2


def test_other_gguf_architectures_keep_their_activation(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    (gate, up, down), _ = write_gpt_oss_gguf(path, torch.Generator().manual_seed(10), arch="qwen3moe")
    wrapper, x, ids, weights, out = run_wrapper(path, 0, method="LLAMAFILE")
    assert (wrapper.swiglu_alpha, wrapper.swiglu_limit) == (0.0, 0.0) and not wrapper._parts[0].has_biases
    assert rel_err(out, reference.moe_forward(x, ids, weights, gate, up, down)) <= 3e-2
