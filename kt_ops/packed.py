"""PackedExperts: one MoE layer's routed experts in a kernel-ready packed format."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from kt_ops._atomic import write_replacing
from kt_ops._native import _C
from kt_ops._validate import require_bools
from kt_ops.mapped_files import load_uint8_tensor, read_safetensors_header

_TENSOR_KEY = "packed"
_METADATA = {"producer": "kt_ops", "content": "packed_experts"}


@dataclass(frozen=True, eq=False)
class PackedExperts:
    """The routed experts of one MoE layer, packed for ``torch.ops.kt.moe_forward``.

    ``data`` is a contiguous 1-D ``uint8`` CPU tensor: a 256-byte versioned, checksummed
    header (format, E, H, I, group size, NUMA split) followed by the kernel-ready weight
    blocks. It is the only state, so it can be registered as an ``nn.Module`` buffer and
    saved with safetensors. Construction validates the header; the other attributes are
    read from it.

    :meth:`save` / :meth:`load` are the file format (safetensors, memory-mapped). A
    PackedExperts written with ``torch.save`` (alone or inside a dict) also loads with
    ``torch.load(path, weights_only=True)`` once ``kt_ops`` is imported: it is pickled as
    its ``data`` tensor and rebuilt by the constructor (the header validated again).
    """

    data: torch.Tensor

    # Equal when they wrap the same tensor (dataclass's generated __eq__ compared the blobs
    # with tensor ==: a RuntimeError for ``a == b`` and ``a in [b]``). Hash to match.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedExperts):
            return NotImplemented
        return self.data is other.data

    def __hash__(self) -> int:
        return hash(id(self.data))

    def __reduce__(self) -> tuple[object, tuple[torch.Tensor]]:
        # Pickled as the blob and a constructor torch's weights-only unpickler allows (below):
        # the default reduce named the class itself, refused by torch.load(weights_only=True).
        return _rebuild_packed_experts, (self.data,)

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise TypeError(f"data must be a torch.Tensor, got {type(self.data).__name__}")
        info = _C.packed_info(self.data)  # raises ValueError/TypeError on a bad blob
        object.__setattr__(self, "_info", info)

    @property
    def format(self) -> str:
        """Packed format name, e.g. ``"bf16"``."""
        return self._info["format"]

    @property
    def num_experts(self) -> int:
        return self._info["num_experts"]

    @property
    def hidden_size(self) -> int:
        return self._info["hidden_size"]

    @property
    def intermediate_size(self) -> int:
        return self._info["intermediate_size"]

    @property
    def group_size(self) -> int:
        """INT4 k-group size; 0 for formats without groups."""
        return self._info["group_size"]

    @property
    def gguf_types(self) -> tuple[str, str, str] | None:
        """Format ``gguf``: the ggml type names of gate, up and down (e.g. ``("Q4_K",
        "Q4_K", "Q6_K")`` for a Q4_K_M layer); None for the other formats."""
        types = self._info.get("gguf_types")
        return None if types is None else tuple(types)

    def require_format(self, *formats: str) -> None:
        """Raises ``ValueError`` unless this blob's format is one of ``formats`` (e.g.
        a wrapper built for ``AMXINT8`` given INT4 weights)."""
        if self.format not in formats:
            raise ValueError(
                f"packed experts are in format {self.format!r}; this call needs {' or '.join(map(repr, formats))}"
            )

    @property
    def nbytes(self) -> int:
        return self._info["nbytes"]

    @property
    def swiglu_limit(self) -> float:
        """The activation's clamp ``L`` (0: none); see :func:`kt_ops.set_activation`."""
        return self._info["swiglu_limit"]

    @property
    def swiglu_alpha(self) -> float:
        """The alpha-SwiGLU's ``alpha`` (0: ``silu(g) * u``); see :func:`kt_ops.set_activation`."""
        return self._info["swiglu_alpha"]

    @property
    def has_biases(self) -> bool:
        """Whether the blob holds gate, up and down expert biases."""
        return self._info["biases"]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """``{"packed": data}``: the tensors to store (e.g. with safetensors)."""
        return {_TENSOR_KEY: self.data}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> PackedExperts:
        """Inverse of :meth:`to_tensors`; raises ``KeyError`` if ``"packed"`` is missing."""
        if _TENSOR_KEY not in tensors:
            raise KeyError(f"tensors has no {_TENSOR_KEY!r} entry; keys: {sorted(tensors)}")
        return cls(tensors[_TENSOR_KEY])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a safetensors file holding the packed blob (under a temporary name in the
        same directory, renamed over ``path``: an existing file stays whole until the new one
        is complete). ``IsADirectoryError`` when
        ``path`` is a directory, ``FileNotFoundError`` when its directory does not exist."""
        # Under a temporary name, then renamed: a crash or a full disk leaves the file that was
        # there intact, and a process with it memory-mapped keeps its weights (the old inode).
        example = os.path.join(os.fspath(path), "experts.safetensors")
        write_replacing(path, lambda tmp: save_file(self.to_tensors(), tmp, metadata=_METADATA),
                        f"PackedExperts.save writes one file (e.g. {example!r})")

    @classmethod
    def load(cls, path: str | os.PathLike[str], copy: bool = False) -> PackedExperts:
        """Opens a file written by :meth:`save`.

        The blob is memory-mapped (copy-on-write), not copied, and watched: a call that
        uses it after the file changed on disk raises ``RuntimeError`` naming the file
        (see :mod:`kt_ops.mapped_files`). ``copy=True`` reads it into RAM instead.
        ``FileNotFoundError`` / ``IsADirectoryError`` for a missing path or a directory (a
        converted model directory loads with ``KTMoEWrapper(weight_path=...)``),
        ``ValueError`` for a file that is not a packed-experts file (or a ``copy`` that is
        not a bool)."""
        require_bools(copy=copy)  # "no" is truthy: read into RAM instead of mapped
        if os.path.isdir(path):
            raise IsADirectoryError(f"{os.fspath(path)!r} is a directory; PackedExperts.load opens one file written "
                                    "by PackedExperts.save (a converted model directory loads with "
                                    "KTMoEWrapper(weight_path=...))")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{os.fspath(path)!r} does not exist")
        header = read_safetensors_header(path)  # read once: the check below and the mapping
        metadata = header[0].get("__metadata__") or {}
        keys = [key for key in header[0] if key != "__metadata__"]
        if not isinstance(metadata, dict) or metadata.get("content") != _METADATA["content"] or keys != [_TENSOR_KEY]:
            raise ValueError(f"{os.fspath(path)!r} is not a kt_ops packed-experts file")
        return cls(load_uint8_tensor(path, _TENSOR_KEY, copy=copy, header=header))

    def __repr__(self) -> str:
        return (
            f"PackedExperts(format={self.format!r}, num_experts={self.num_experts}, "
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"nbytes={self.nbytes})"
        )


def _rebuild_packed_experts(data: torch.Tensor) -> PackedExperts:
    """Unpickles a PackedExperts (:meth:`PackedExperts.__reduce__`): the constructor, which
    validates the blob. Allowed in ``torch.load(weights_only=True)``; the class itself is
    not (the unpickler could then make one with ``__new__`` and set its attributes, the
    header never validated)."""
    return PackedExperts(data)


torch.serialization.add_safe_globals([_rebuild_packed_experts])
