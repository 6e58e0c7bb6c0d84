"""Builds kt_ops._C against the installed torch (pip install --no-build-isolation -e .).

One extension holds every CPU variant: csrc/cpu/kernels/variants/*.cpp select their
instruction set with a target pragma, so no file is compiled with -march=native and one
build runs on any x86-64 CPU with AVX2; the best variant is chosen at run time.
"""

from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
SOURCES = sorted(
    str(path.relative_to(ROOT))
    for folder in ("csrc/ops", "csrc/cpu")
    for path in (ROOT / folder).rglob("*.cpp")
)

setup(
    name="kt_ops",
    version="0.1.0",
    description="PyTorch operators for Mixture-of-Experts layers on the CPU (kt-kernel compatible)",
    packages=find_packages(include=["kt_ops", "kt_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "safetensors", "gguf"],
    ext_modules=[
        CppExtension(
            "kt_ops._C",
            SOURCES,
            extra_compile_args={
                "cxx": ["-O3", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-fno-math-errno", "-DNDEBUG"],
            },
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
