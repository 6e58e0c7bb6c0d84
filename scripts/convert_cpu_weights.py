#!/usr/bin/env python
"""kt-kernel's CPU-weight converter, by its usual name: the same program as
``python -m kt_ops.convert`` (see kt_ops/convert.py and the README)."""

import sys

from kt_ops.cli import run_program
from kt_ops.convert import main

if __name__ == "__main__":
    sys.exit(run_program(main, "python -m kt_ops.convert"))
