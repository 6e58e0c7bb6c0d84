"""kt_ops.from_gguf: a GGUF file becomes a transformers model whose routed experts run from
the mapped file through kt::moe_forward (the rest dequantized by transformers' GGUF loader);
checked against the same weights in plain transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import kt_ops  # noqa: E402
from gguf_helpers import finish  # noqa: E402
from hf_models import tiny_model  # noqa: E402
from kt_ops import hf_experts  # noqa: E402


def _header(writer: gguf.GGUFWriter, cfg: Any, num_experts: int, expert_size: int, head_dim: bool = True) -> None:
    """The metadata every writer below shares: sizes, heads, rope base, norm, vocabulary, experts."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(expert_size)


def write_qwen3moe_gguf(model: torch.nn.Module, path: Path, expert_type: str,
                        tokenizer: bool = False) -> torch.nn.Module:
    """``model`` (a tiny Qwen3-MoE, fp32) written as a GGUF of llama.cpp's names, its expert
    tensors in ``expert_type``; returns the model with its experts replaced by what the file
    holds (dequantized by the gguf package), the reference. ``tokenizer``: the file also
    carries a byte-level BPE tokenizer of its 96 tokens (printable ASCII, "Ġ" for the space,
    "<eos>"), no merges: one token per character."""
    cfg = model.config
    kind = gguf.GGMLQuantizationType[expert_type]
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    _header(writer, cfg, cfg.num_experts, cfg.moe_intermediate_size)
    if tokenizer:
        tokens = [chr(c) for c in range(33, 127)] + ["Ġ", "<eos>"]
        assert len(tokens) == cfg.vocab_size
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * (len(tokens) - 1) + [3])
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_merges([])
        writer.add_eos_token_id(len(tokens) - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, cfg.num_hidden_layers)

    def add_experts(name: str, weights: torch.Tensor) -> torch.Tensor:
        array = np.ascontiguousarray(weights.numpy())
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
            return weights
        raw = gguf.quants.quantize(array, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        return torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(array.shape).copy())

    state = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.float()
        block = key.split(".")[2] if ".layers." in f".{key}" else None
        if key.endswith("mlp.experts.gate_up_proj"):
            half = tensor.shape[1] // 2
            gate = add_experts(f"blk.{block}.ffn_gate_exps.weight", tensor[:, :half].contiguous())
            up = add_experts(f"blk.{block}.ffn_up_exps.weight", tensor[:, half:].contiguous())
            state[key] = torch.cat((gate, up), dim=1)
        elif key.endswith("mlp.experts.down_proj"):
            state[key] = add_experts(f"blk.{block}.ffn_down_exps.weight", tensor.contiguous())
        else:
            base, suffix = key.rsplit(".", 1)
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(tensor.numpy()))
    finish(writer)
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize("expert_type,bound", [("F32", 1e-5), ("Q8_0", 3e-2), ("Q4_0", 3e-2)])
def test_from_gguf_matches_transformers_on_the_same_weights(tmp_path: Path, expert_type: str, bound: float) -> None:
    path = tmp_path / "tiny.gguf"
    reference = write_qwen3moe_gguf(tiny_model("qwen3_moe", dtype=torch.bfloat16).float().eval(), path, expert_type)
    model = kt_ops.from_gguf(path, dtype=torch.float32)
    experts = [m for m in model.modules() if hf_experts.is_experts_module(m)]
    assert len(experts) == 2 and all(m.gate_up_proj.numel() == 0 for m in experts)
    for module in experts:  # mapped from the file: the blob is the GGUF's own blocks
        packed = kt_ops.PackedExperts(hf_experts.packed_blob(module))
        assert packed.format == "gguf"
        assert kt_ops._native._C.changed_mapped_file(packed.data) == ""
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        got = model(ids).logits
    assert sum(1 for e in prof.events() if e.name == "kt::moe_forward") == 2
    with torch.no_grad():
        want = reference(ids).logits
    assert ((got - want).norm() / want.norm()) <= bound


def test_from_gguf_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        kt_ops.from_gguf(tmp_path / "missing.gguf")
    from gguf_helpers import random_blocks, write_model

    rng = np.random.default_rng(0)
    layer = {name: ("Q8_0", random_blocks("Q8_0", 4 * rows, 64, rng).reshape(4, rows, -1))
             for name, rows in (("ffn_gate_exps", 64), ("ffn_up_exps", 64), ("ffn_down_exps", 64))}
    write_model(tmp_path / "split.gguf", [layer, layer], 4, 64, 64, split_max_tensors=4)
    with pytest.raises(ValueError, match="split into"):
        kt_ops.from_gguf(tmp_path)


def test_kt_ops_generate_runs_a_gguf_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kt-ops generate MODEL.gguf: the model from kt_ops.from_gguf, the tokenizer from the
    file; greedy tokens as transformers generates them from the same weights. --method
    other than LLAMAFILE is exit status 2; a GGUF without a tokenizer asks for --tokenizer,
    which then works."""
    from kt_ops import generate
    from test_hf_experts import save_tokenizer

    path = tmp_path / "tiny.gguf"
    reference = write_qwen3moe_gguf(tiny_model("qwen3_moe", dtype=torch.bfloat16).float().eval(), path, "F32",
                                    tokenizer=True)
    prompt = "hello world"
    assert generate.main([str(path), "--prompt", prompt, "--max-new-tokens", "6", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert "kt_ops LLAMAFILE: loaded" in err
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] == len(prompt)  # one token per character
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert out.strip() == tokenizer.decode(want[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert generate.main([str(path), "--prompt", prompt, "--method", "AMXINT8"]) == 2
    assert "do not apply" in capsys.readouterr().err.splitlines()[-1]
    bare = tmp_path / "bare"
    bare.mkdir()
    write_qwen3moe_gguf(tiny_model("qwen3_moe", dtype=torch.bfloat16).float().eval(), bare / "m.gguf", "Q8_0")
    assert generate.main([str(bare), "--prompt", "w5 w17"]) == 2
    assert "pass --tokenizer DIR" in capsys.readouterr().err.splitlines()[-1]
    save_tokenizer(tmp_path / "tokenizer")
    assert generate.main([str(bare), "--prompt", "w5 w17", "--max-new-tokens", "2",
                          "--tokenizer", str(tmp_path / "tokenizer")]) == 0
    assert "kt_ops LLAMAFILE: loaded" in capsys.readouterr().err


def write_qwen2moe_gguf(model: torch.nn.Module, path: Path) -> None:
    """``model`` (a tiny Qwen2-MoE, fp32) written as an F32 GGUF of llama.cpp's names and
    metadata keys (``expert_shared_feed_forward_length`` for the shared expert's size; the
    shared-expert gate a vector, as llama.cpp stores it)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    _header(writer, cfg, cfg.num_experts, cfg.moe_intermediate_size, head_dim=False)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2MOE, cfg.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        array = tensor.float()
        block = key.split(".")[2] if ".layers." in f".{key}" else None
        if key.endswith("mlp.experts.gate_up_proj"):
            half = array.shape[1] // 2
            writer.add_tensor(f"blk.{block}.ffn_gate_exps.weight", np.ascontiguousarray(array[:, :half].numpy()))
            writer.add_tensor(f"blk.{block}.ffn_up_exps.weight", np.ascontiguousarray(array[:, half:].numpy()))
            continue
        if key.endswith("mlp.experts.down_proj"):
            writer.add_tensor(f"blk.{block}.ffn_down_exps.weight", np.ascontiguousarray(array.numpy()))
            continue
        if key.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)
        base, suffix = key.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(array.numpy()))
    finish(writer)


def test_from_gguf_sizes_a_qwen2moe_shared_expert_from_the_file(tmp_path: Path) -> None:
    """transformers' GGUF mapping has no key for the shared expert's size: the model was built
    with Qwen2MoeConfig's 5632 and loading its 48-row shared expert failed."""
    path = tmp_path / "tiny.gguf"
    reference = tiny_model("qwen2_moe", dtype=torch.bfloat16).float().eval()
    write_qwen2moe_gguf(reference, path)
    model = kt_ops.from_gguf(path, dtype=torch.float32)
    assert model.config.shared_expert_intermediate_size == reference.config.shared_expert_intermediate_size == 48
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ((got - want).norm() / want.norm()) <= 1e-5


def write_gpt_oss_gguf(model: torch.nn.Module, path: Path) -> None:
    """``model`` (a tiny gpt-oss, fp32) written as an F32 GGUF as llama.cpp's converter writes
    one: gate and up de-interleaved from ``gate_up_proj``, expert matrices ``[E, out, in]``,
    their biases, the attention sinks as ``blk.N.attn_sinks.weight``, and YaRN's
    ``rope.scaling.*`` keys."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _header(writer, cfg, cfg.num_local_experts, cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)

    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(tensor.numpy()))

    for key, tensor in model.state_dict().items():
        tensor = tensor.float()
        block = key.split(".")[2] if ".layers." in f".{key}" else None
        if key.endswith("experts.gate_up_proj"):
            add(f"blk.{block}.ffn_gate_exps.weight", tensor[..., ::2].transpose(1, 2))
            add(f"blk.{block}.ffn_up_exps.weight", tensor[..., 1::2].transpose(1, 2))
        elif key.endswith("experts.gate_up_proj_bias"):
            add(f"blk.{block}.ffn_gate_exps.bias", tensor[..., ::2])
            add(f"blk.{block}.ffn_up_exps.bias", tensor[..., 1::2])
        elif key.endswith("experts.down_proj"):
            add(f"blk.{block}.ffn_down_exps.weight", tensor.transpose(1, 2))
        elif key.endswith("experts.down_proj_bias"):
            add(f"blk.{block}.ffn_down_exps.bias", tensor)
        elif key.endswith("self_attn.sinks"):
            add(f"blk.{block}.attn_sinks.weight", tensor)
        else:
            base, suffix = key.rsplit(".", 1)
            add(f"{names.get_name(base)}.{suffix}", tensor)
    finish(writer)


def test_from_gguf_reads_a_gpt_oss_file_as_llama_cpp_writes_it(tmp_path: Path) -> None:
    """The sinks (``attn_sinks.weight``: transformers looked for ``attn_sinks``), the head
    size and the sliding window (``attention.*`` keys transformers' mapping misses: the config
    kept GptOssConfig's 64 and 128) come from the file."""
    from hf_models import EXPERTS_CONFIGS

    config = EXPERTS_CONFIGS["gpt_oss"]()
    config.head_dim, config.sliding_window = 8, 4
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path / "tiny.gguf"
    write_gpt_oss_gguf(reference, path)
    model = kt_ops.from_gguf(path, dtype=torch.float32)
    assert (model.config.head_dim, model.config.sliding_window) == (8, 4)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))  # < 32 tokens: see formats.md
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ((got - want).norm() / want.norm()) <= 1e-5


def test_from_gguf_reads_gpt_oss_yarn_rope_scaling(tmp_path: Path) -> None:
    """A gpt-oss GGUF with ``rope.scaling.*`` keys (every one llama.cpp writes): transformers'
    config reader raised ``TypeError`` on them; the factor and original context come from the
    file."""
    from hf_models import EXPERTS_CONFIGS

    config = EXPERTS_CONFIGS["gpt_oss"]()
    config.rope_parameters.update(factor=4.0, original_max_position_embeddings=32)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path / "tiny.gguf"
    write_gpt_oss_gguf(reference, path)
    model = kt_ops.from_gguf(path, dtype=torch.float32)
    assert model.config.rope_parameters == reference.config.rope_parameters
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ((got - want).norm() / want.norm()) <= 1e-5


def test_from_gguf_names_a_tensor_of_another_shape_as_value_error(tmp_path: Path) -> None:
    """A metadata size that disagrees with a tensor (a wrong head count here) is ValueError,
    as documented, which kt-ops generate reports (torch's RuntimeError was a traceback)."""
    path = tmp_path / "tiny.gguf"
    write_qwen2moe_gguf(tiny_model("qwen2_moe", dtype=torch.bfloat16).float().eval(), path)
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["qwen2moe.attention.head_count_kv"].parts[-1][0] = 1
    del reader
    message = "(?s)does not match the qwen2_moe model.*size mismatch for model.layers.0.self_attn.k_proj"
    with pytest.raises(ValueError, match=message):
        kt_ops.from_gguf(path, dtype=torch.float32)
