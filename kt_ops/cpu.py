"""CPU variant selection and the engine's thread count."""

from kt_ops._native import _C
from kt_ops._validate import is_integral

# In order of preference, oldest first: the best supported one is active by default.
# avx_vnni (AVX2 + 256-bit vpdpbusd: Intel Core from Alder Lake, Zen 5) is not required by
# the AVX-512 variants, so an AVX-512 CPU without AVX-VNNI (Zen 4) still runs them.
CPU_VARIANTS: tuple[str, ...] = ("avx2", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx")


def cpu_variant() -> str:
    """The active CPU variant: ``avx2``, ``avx_vnni``, ``avx512``, ``avx512_vnni``, ``avx512_bf16`` or ``amx``."""
    return _C.cpu_variant()


def supported_cpu_variants() -> list[str]:
    """Variants this CPU and OS can run, oldest first (CPUID, XCR0, AMX permission)."""
    return list(_C.supported_cpu_variants())


def set_cpu_variant(name: str) -> None:
    """Makes ``name`` the active variant for every later call in this process.

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` naming the missing
    CPU/OS features for an unsupported one. ``KT_OPS_CPU_VARIANT`` does the same at import,
    where either is a ``RuntimeError`` naming the variable.
    """
    if name not in CPU_VARIANTS:
        raise ValueError(f"unknown CPU variant {name!r}; expected one of {', '.join(CPU_VARIANTS)}")
    _C.set_cpu_variant(name)


def missing_features(name: str) -> str:
    """What the CPU/OS lacks for variant ``name`` (empty when it is supported)."""
    if name not in CPU_VARIANTS:
        raise ValueError(f"unknown CPU variant {name!r}; expected one of {', '.join(CPU_VARIANTS)}")
    return _C.missing_features(name)


def max_threads() -> int:
    """The most threads :func:`set_num_threads` and ``KT_OPS_NUM_THREADS`` accept: 16 per
    logical CPU of this machine, at least 1024. Far above any useful count (the default is
    one per physical core); the bound is there because torch's OpenMP pool crashes the
    process (a segfault, no exception) when it cannot start the threads it is given:
    ``torch.set_num_threads(50000)`` then any parallel op, on a 2-core VM with 24 GiB."""
    return _C.max_threads()


def set_num_threads(n: int) -> None:
    """Sets the number of threads the kernels run on.

    The kernels run on torch's intra-op threads (see :func:`thread_source`), so this is
    ``torch.set_num_threads(n)``: one number for torch and kt_ops. ``KT_OPS_NUM_THREADS``,
    when set, is applied the same way at import; otherwise torch's default (the physical
    cores) stands. With ``KT_OPS_THREAD_POOL=own`` kt_ops runs its own pool instead: the
    caller plus ``n - 1`` pinned helpers (default ``KT_OPS_NUM_THREADS`` or the physical
    cores), rebuilt here after any running kernel. Raises ``ValueError`` for ``n < 1`` and
    for more than :func:`max_threads`.
    """
    if not is_integral(n) or n < 1:  # numpy's integers too, as torch.set_num_threads takes them
        raise ValueError(f"n must be a positive int, got {n!r}")
    n = int(n)
    if n > max_threads():
        raise ValueError(f"{n} threads is more than kt_ops starts (at most {max_threads()}: 16 per CPU); torch's "
                         "OpenMP pool crashes the process when it cannot start that many")
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """The kernels' thread count, the calling thread included (``torch.get_num_threads()``
    unless ``KT_OPS_THREAD_POOL=own``)."""
    return _C.get_num_threads()


def thread_source() -> str:
    """Whose threads the kernels run on: torch's intra-op threads (the default) or, with
    ``KT_OPS_THREAD_POOL=own``, kt_ops' own pinned pools."""
    return _C.thread_source()
