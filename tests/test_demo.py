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
