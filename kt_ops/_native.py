"""Loads the native extension and applies the environment's choices once.

Importing ``kt_ops._C`` registers the ``torch.ops.kt`` operators. ``KT_OPS_CPU_VARIANT``
(``avx2``, ``avx_vnni``, ``avx512``, ``avx512_vnni``, ``avx512_bf16``, ``amx``) forces a CPU variant; an unknown or
unsupported one raises at import, naming what is missing (``KT_OPS_NUM_THREADS`` out of range: an
``ImportError`` from the extension). When one of kt_ops' own commands started the process (``kt-ops``,
``python -m kt_ops...``, a script of the checkout's ``scripts/`` such as ``convert_cpu_weights.py``) such an
error is one line on stderr and exit status 2, as the commands' argument errors are, instead of an import
traceback.
"""

from __future__ import annotations

import os
import sys

import torch  # noqa: F401  (loads libtorch before the extension)


def _command_name() -> str | None:
    """The name a kt_ops command that started this process goes by (``kt-ops``, ``python -m kt_ops...``,
    a ``scripts/`` file's name, as each names itself in its usage line), else None.

    ``python -m`` sets ``sys.argv[0]`` only once the module is found, after its package (this one) is
    imported, so the module's name is read from ``sys.orig_argv``.
    """
    argv0 = sys.argv[0] if sys.argv else ""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    in_scripts = os.path.isfile(argv0) and os.path.dirname(os.path.abspath(argv0)) == scripts  # not "-c" run there
    if os.path.basename(argv0) == "kt-ops" or in_scripts:
        return os.path.basename(argv0)
    args = list(getattr(sys, "orig_argv", ()))[1:]
    while args:
        arg = args.pop(0)
        if arg in ("-X", "-W"):  # interpreter options that take a value
            args = args[1:]
            continue
        if arg.startswith("-m"):
            module = arg[2:] or (args[0] if args else "")
            return f"python -m {module}" if module == "kt_ops" or module.startswith("kt_ops.") else None
        if arg == "-c" or not arg.startswith("-"):  # a command string or a script
            return None
    return None


def _environment_error(error: Exception) -> None:
    """Exits with status 2 and one line naming the variable when ``error`` is an environment
    variable's (``KT_OPS_...``) and a kt_ops command started the process; returns otherwise."""
    command = _command_name()
    if command is not None and "KT_OPS_" in str(error):
        print(f"{command}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


try:
    from kt_ops import _C
except ImportError as error:  # KT_OPS_NUM_THREADS, read when the extension loads
    _environment_error(error)
    raise

_requested = os.environ.get("KT_OPS_CPU_VARIANT", "").strip()
if _requested:
    try:
        _C.set_cpu_variant(_requested)
    except (ValueError, RuntimeError) as error:
        wrapped = RuntimeError(f"KT_OPS_CPU_VARIANT={_requested!r}: {error}")
        _environment_error(wrapped)
        raise wrapped from error

__all__ = ["_C"]
