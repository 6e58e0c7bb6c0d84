"""PackedExperts: metadata, tensors round trip, safetensors save/load (memory-mapped),
module buffers."""

from __future__ import annotations

import pytest
import torch

import kt_ops
from conftest import make_experts, random_routing


@pytest.fixture(scope="module")
def experts():
    return make_experts(5, 40, 24)


def test_metadata(experts) -> None:
    packed = experts.packed
    assert (packed.format, packed.num_experts, packed.hidden_size, packed.intermediate_size) == ("bf16", 5, 40, 24)
    assert packed.nbytes == packed.data.numel()
    assert "num_experts=5" in repr(packed)


def test_tensors_round_trip(experts) -> None:
    again = kt_ops.PackedExperts.from_tensors(experts.packed.to_tensors())
    assert torch.equal(again.data, experts.packed.data)
    with pytest.raises(KeyError, match="packed"):
        kt_ops.PackedExperts.from_tensors({"weights": experts.packed.data})



def test_comparison_and_hash(experts) -> None:
    """``==`` and ``in`` compared the blobs with tensor ``==`` (RuntimeError: ambiguous bool)."""
    packed = experts.packed
    copy = kt_ops.PackedExperts(packed.data.clone())
    assert packed == kt_ops.PackedExperts(packed.data) and hash(packed) == hash(kt_ops.PackedExperts(packed.data))
    assert packed != copy and copy not in [packed] and packed in [copy, packed]
    assert packed != packed.data and len({packed, copy}) == 2

def test_save_load_is_memory_mapped_and_runs(tmp_path, experts) -> None:
    path = tmp_path / "layer0.safetensors"
    experts.packed.save(path)
    loaded = kt_ops.PackedExperts.load(path)
    assert torch.equal(loaded.data, experts.packed.data)
    ids, weights = random_routing(4, 5, 2)
    x = torch.randn(4, 40)
    torch.testing.assert_close(
        kt_ops.moe_forward(x, ids, weights, loaded), kt_ops.moe_forward(x, ids, weights, experts.packed)
    )


def test_torch_save_load_weights_only(tmp_path, experts) -> None:
    """torch.save of a PackedExperts (alone or inside a dict) loads with
    torch.load(weights_only=True), torch's default since 2.6: it was an UnpicklingError
    (kt_ops.packed.PackedExperts not an allowed global). Same blob, same outputs bit for
    bit; PackedExperts.save / load (the documented path) unchanged."""
    path = tmp_path / "layer0.pt"
    torch.save({"layer0": experts.packed}, path)
    loaded = torch.load(path, weights_only=True)["layer0"]
    assert isinstance(loaded, kt_ops.PackedExperts) and torch.equal(loaded.data, experts.packed.data)
    documented = tmp_path / "layer0.safetensors"
    experts.packed.save(documented)
    ids, weights = random_routing(4, 5, 2)
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    out = kt_ops.moe_forward(x, ids, weights, experts.packed)
    for other in (loaded, kt_ops.PackedExperts.load(documented)):
        assert torch.equal(kt_ops.moe_forward(x, ids, weights, other), out)
    corrupt = kt_ops.PackedExperts(experts.packed.data.clone())
    corrupt.data[:4] = 0  # changed after construction: torch.load validates the blob again
    torch.save(corrupt, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="bad magic"):
        torch.load(tmp_path / "bad.pt", weights_only=True)


def test_save_names_a_bad_path(tmp_path, experts) -> None:
    """save() to a directory or into a missing one: the path named, nothing written."""
    with pytest.raises(IsADirectoryError, match="is a directory; PackedExperts.save writes one file"):
        experts.packed.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="its directory .*missing.* does not exist"):
        experts.packed.save(tmp_path / "missing" / "layer0.safetensors")
    assert list(tmp_path.iterdir()) == []


def resident_mb() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6


def test_load_maps_without_reading_the_weights(tmp_path) -> None:
    zeros = torch.zeros(16, 512, 1024, dtype=torch.bfloat16)
    packed = kt_ops.pack_experts(zeros, zeros, zeros.transpose(1, 2).contiguous())
    path = tmp_path / "big.safetensors"
    packed.save(path)
    nbytes_mb = packed.nbytes / 1e6
    del packed, zeros
    before = resident_mb()
    loaded = kt_ops.PackedExperts.load(path)
    grew = resident_mb() - before
    assert loaded.nbytes / 1e6 == nbytes_mb
    assert grew < nbytes_mb / 4, f"loading {nbytes_mb:.0f} MB made {grew:.0f} MB resident: copied, not mapped"


def test_load_refuses_other_files(tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"packed": torch.zeros(300, dtype=torch.uint8)}, str(path))
    with pytest.raises(ValueError, match="not a kt_ops packed-experts file"):
        kt_ops.PackedExperts.load(path)


def test_module_buffer_state_dict_round_trip(tmp_path, experts) -> None:
    from safetensors.torch import load_file, save_file

    module = torch.nn.Module()
    module.register_buffer("packed", experts.packed.data)
    save_file(module.state_dict(), str(tmp_path / "module.safetensors"))
    other = torch.nn.Module()
    other.register_buffer("packed", torch.empty_like(experts.packed.data))
    other.load_state_dict(load_file(str(tmp_path / "module.safetensors")))
    assert torch.equal(other.packed, experts.packed.data)
    assert kt_ops.PackedExperts(other.packed).num_experts == 5


def test_constructor_validates(experts) -> None:
    with pytest.raises(TypeError, match="torch.Tensor"):
        kt_ops.PackedExperts(b"not a tensor")
    with pytest.raises(ValueError, match="bad magic"):
        kt_ops.PackedExperts(torch.zeros(1000, dtype=torch.uint8))


def test_packing_layout_is_what_the_docs_say() -> None:
    """Block b of gate/up: [Hp][16][2]; gate block then up block; rows past I are zero."""
    E, H, I = 1, 6, 17
    gate = torch.arange(E * I * H, dtype=torch.float32).reshape(E, I, H).bfloat16()
    up = -gate
    down = torch.ones(E, H, I).bfloat16()
    data = kt_ops.pack_experts(gate, up, down).data[256:].view(torch.int16).view(torch.bfloat16)
    pairs = (H + 1) // 2
    block = data[: pairs * 32].reshape(pairs, 16, 2)
    assert torch.equal(block[1, 3], gate[0, 3, 2:4])  # pair 1 of row 3 = columns 2, 3
    up_block = data[pairs * 32 : 2 * pairs * 32].reshape(pairs, 16, 2)
    assert torch.equal(up_block[0, 0], up[0, 0, 0:2])
    second_gate = data[2 * pairs * 32 : 3 * pairs * 32].reshape(pairs, 16, 2)
    assert torch.equal(second_gate[0, 0], gate[0, 16, 0:2])
    assert torch.all(second_gate[:, 1:] == 0)  # rows 17.. of a 17-row matrix are padding
