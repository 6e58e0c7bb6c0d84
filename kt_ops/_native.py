"""Loads the native extension and applies the environment's choices once.

Importing ``kt_ops._C`` registers the ``torch.ops.kt`` operators. ``KT_OPS_CPU_VARIANT``
(``avx2``, ``avx_vnni``, ``avx512``, ``avx512_vnni``, ``avx512_bf16``, ``amx``) forces a CPU variant; an unknown or
unsupported one raises at import, naming what is missing.
"""

import os

import torch  # noqa: F401  (loads libtorch before the extension)

from kt_ops import _C

_requested = os.environ.get("KT_OPS_CPU_VARIANT", "").strip()
if _requested:
    try:
        _C.set_cpu_variant(_requested)
    except (ValueError, RuntimeError) as error:
        raise RuntimeError(f"KT_OPS_CPU_VARIANT={_requested!r}: {error}") from error

__all__ = ["_C"]
