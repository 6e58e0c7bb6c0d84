"""kt_ops' optional packages: imported when a feature first needs them (never by ``import
kt_ops``), with an ``ImportError`` that names the package and how to install it."""

from __future__ import annotations

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

