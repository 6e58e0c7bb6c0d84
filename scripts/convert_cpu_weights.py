#!/usr/bin/env python
"""kt-kernel's CPU-weight converter, by its usual name: the same program as
``python -m kt_ops.convert`` (see kt_ops/convert.py and the README), whose usage lines,
errors and Ctrl-C line name this script."""

import sys

from kt_ops.cli import run_program
from kt_ops.convert import main

PROG = "convert_cpu_weights.py"

if __name__ == "__main__":
    sys.exit(run_program(lambda: main(prog=PROG), PROG))
