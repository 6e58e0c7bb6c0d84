"""kt_ops without its optional packages (transformers, PEFT, accelerate, vLLM), or with a
transformers too old for its integrations: ``import kt_ops`` and the features that do not
need them work, and those that do fail naming the package and how to install it. Each
case runs in a subprocess where the package is blocked (``sys.modules[name] = None``, as
Python reports an absent package) or replaced by a stub of an old version."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, block: tuple[str, ...] = (), path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the packages of ``block`` absent and ``path``
    first on ``sys.path`` (where a stub package shadows the installed one)."""
    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in block)
    prelude += "".join(f"sys.path.insert(0, {str(p)!r})\n" for p in path)
    prelude += f"sys.path.insert(0, {str(ROOT)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def old_transformers(root: Path) -> Path:
    """A stub ``transformers`` 4.0.0 package under ``root`` (with ``modeling_utils``, which
    every ``from_pretrained`` imports, and none of transformers v5's modules)."""
    package = root / "transformers"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "4.0.0"\n')
    (package / "modeling_utils.py").write_text("PreTrainedModel = object\n")
    return root


def old_peft(root: Path) -> Path:
    """A stub ``peft`` 0.10.0 package under ``root`` whose ``peft.tuners.lora.layer`` (which
    ``import peft`` imports) has no ``ParamWrapper``, as PEFT before LoRA on parameters."""
    layer = root / "peft" / "tuners" / "lora"
    layer.mkdir(parents=True)
    (root / "peft" / "__init__.py").write_text('__version__ = "0.10.0"\nimport peft.tuners.lora.layer\n')
    (root / "peft" / "tuners" / "__init__.py").write_text("")
    (layer / "__init__.py").write_text("")
    (layer / "layer.py").write_text("class LoraLayer:\n    pass\n")
    return root


@pytest.mark.slow
def test_transformers_absent_features_name_it() -> None:
    result = run_python("""
        import kt_ops
        assert "transformers" not in sys.modules or sys.modules["transformers"] is None
        for name, call in (("KtOpsConfig", lambda: kt_ops.KtOpsConfig),
                           ("from_gguf", lambda: kt_ops.from_gguf("model.gguf"))):
            try:
                call()
            except ImportError as error:
                print(name, "|", error)
            else:
                print(name, "| no error")
    """, block=("transformers",))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert "transformers" in line and "pip install" in line, line


@pytest.mark.slow
def test_generate_without_transformers_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    result = run_python(f"""
        from kt_ops.cli import main
        sys.exit(main(["generate", {str(tmp_path)!r}, "--prompt", "hi"]))
    """, block=("transformers",))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("kt-ops generate: error:") and "transformers" in last and "pip install" in last, last


@pytest.mark.slow
def test_old_transformers_keeps_working_after_import_kt_ops(tmp_path: Path) -> None:
    """kt_ops registers its quantizer when transformers.modeling_utils is imported: with a
    transformers it cannot serve that is skipped, never an error in the user's import."""
    result = run_python("""
        import kt_ops
        import transformers.modeling_utils
        print("modeling_utils imported")
        try:
            kt_ops.KtOpsConfig
        except ImportError as error:
            print("KtOpsConfig |", error)
    """, path=(old_transformers(tmp_path),))
    assert result.returncode == 0, result.stderr
    assert "modeling_utils imported" in result.stdout
    line = result.stdout.splitlines()[-1]
    assert line.startswith("KtOpsConfig |") and "4.0.0" in line and "pip install" in line, line


@pytest.mark.slow
def test_doctor_reports_optional_integrations() -> None:
    result = run_python("""
        import kt_ops
        print(kt_ops.doctor())
    """, block=("transformers", "peft", "vllm"))
    assert result.returncode == 0, result.stderr
    assert "optional packages" in result.stdout, result.stdout
    text = result.stdout.split("optional packages")[1]
    for name in ("transformers", "peft", "vllm"):
        assert f"{name}: not installed" in text, text
    assert "accelerate: " in text and "accelerate: not installed" not in text, text
    result = run_python("""
        import kt_ops
        kt_ops.doctor()
        print(sorted(m for m in ("transformers", "peft", "accelerate", "vllm") if m in sys.modules))
    """)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.slow
def test_patch_model_without_transformers_says_it_is_missing() -> None:
    """Without transformers only the HybridMoE architectures are listed as supported: the
    refusal says why the others (gpt-oss, GLM-4-MoE, ...) are not."""
    result = run_python("""
        import torch, types, kt_ops
        model = torch.nn.Module()
        model.config = types.SimpleNamespace(model_type="gpt_oss")
        try:
            kt_ops.patch_model(model)
        except ValueError as error:
            print(error)
    """, block=("transformers",))
    assert result.returncode == 0, result.stderr
    assert "transformers" in result.stdout and "pip install" in result.stdout, result.stdout


@pytest.mark.slow
def test_demo_names_a_missing_or_old_transformers(tmp_path: Path) -> None:
    stub = old_transformers(tmp_path)
    for block, path in ((("transformers",), ()), ((), (stub,))):
        result = run_python("""
            from kt_ops.demo import main
            main([])
        """, block=block, path=path)
        assert result.returncode == 1, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert "transformers" in last and "pip install" in last and "Traceback" not in result.stderr, result.stderr
        assert "4.0.0" in last or not path, last


@pytest.mark.slow
def test_star_import_without_transformers() -> None:
    """``from kt_ops import *`` needs no transformers (KtOpsConfig and from_gguf, which do,
    are left out of it then)."""
    result = run_python("""
        from kt_ops import *
        print(moe_forward.__name__, "KtOpsConfig" in globals())
    """, block=("transformers",))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["moe_forward", "False"], result.stdout


@pytest.mark.slow
def test_an_old_peft_keeps_importing_after_import_kt_ops(tmp_path: Path) -> None:
    """kt_ops teaches PEFT's ParamWrapper about packed experts when PEFT is imported: a PEFT
    without it is left alone, never an error in the user's ``import peft``."""
    result = run_python("""
        import kt_ops
        import peft
        print("peft", peft.__version__)
    """, path=(old_peft(tmp_path),))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["peft", "0.10.0"], result.stdout
