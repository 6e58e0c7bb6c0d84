"""python -m kt_ops.demo runs end to end on a small model and reports what it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_demo_generates_with_the_patched_model() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # no setting needed
    args = ["--layers", "2", "--hidden", "256", "--experts", "8", "--top-k", "2", "--intermediate", "128",
            "--tokens", "6", "--method", "AMXINT8"]
    result = subprocess.run([sys.executable, "-m", "kt_ops.demo", *args], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "kt_ops.patch_model: 2 MoE layers -> AMXINT8" in out
    tokens = re.search(r"patched tokens\s+\[([^\]]*)\]", out)
    assert tokens is not None and len(tokens.group(1).split(",")) == 6
    assert re.search(r"MoE blocks\s+Hugging Face\s+[\d.]+ ms/token\s+kt_ops\s+[\d.]+ ms/token", out)


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "--layers must be at least 1"),
    (["--experts", "0"], "--experts must be at least 1"),
    (["--tokens", "0"], "--tokens must be at least 1"),
    (["--top-k", "0"], "--top-k must be between 1 and --experts (64)"),
    (["--top-k", "99"], "--top-k must be between 1 and --experts (64)"),
    (["--hidden", "0"], "--hidden must be a positive multiple of 16"),
    (["--hidden", "33"], "--hidden must be a positive multiple of 16"),
    (["--intermediate", "7"], "--intermediate must be a positive multiple of 8"),
    (["--method", "BOGUS"], "unknown method 'BOGUS'; choose one of BF16"),
    (["--method", "LLAMAFILE"], "LLAMAFILE needs a GGUF type"),
    (["--method", "AMXINT4", "--hidden", "48"], "group_size 128 must divide hidden_size"),
])
def test_demo_refuses_bad_arguments_before_building_a_model(
        args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kt_ops import demo

    with pytest.raises(SystemExit) as exit_info:
        demo.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_demo_takes_a_gguf_type_as_the_method() -> None:
    from kt_ops import demo

    assert demo.method_arguments("q4_0", 64, 32) == ("LLAMAFILE", "Q4_0")
    assert demo.method_arguments("amxint8", 64, 32) == ("AMXINT8", None)
    assert demo.method_arguments("MXFP4", 64, 32) == ("MXFP4", None)  # the method, not GGUF's MXFP4 blocks
