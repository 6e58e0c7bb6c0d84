"""Builds kt_ops._C against the installed torch (pip install --no-build-isolation -e .).

One extension holds every CPU variant: csrc/cpu/kernels/variants/*.cpp select their
instruction set with a target pragma, so no file is compiled with -march=native and one
build runs on any x86-64 CPU with AVX2; the best variant is chosen at run time.

The CUDA key (csrc/cuda/*.cu, compiled by nvcc) is added when torch was built with CUDA
and nvcc is found; KT_OPS_CUDA=1 forces it (the build fails loudly if it cannot), and
KT_OPS_CUDA=0 leaves it out.
"""

import os
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
SOURCES = sorted(
    str(path.relative_to(ROOT))
    for folder in ("csrc/ops", "csrc/cpu")
    for path in (ROOT / folder).rglob("*.cpp")
)
CUDA_SOURCES = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "csrc/cuda").glob("*.cu"))
# Some toolchains link libstdc++ statically into shared objects (seen: the GPU image's
# /opt/gcc g++). Its exported std:: symbols then mix with the process's shared libstdc++
# (two std::locale facet ids) and the first `ostream << int` segfaults; keeping the
# static copy's symbols local makes the extension self-consistent. No effect otherwise.
LINK_FLAGS = ["-Wl,--exclude-libs,libstdc++.a", "-fopenmp"]
# Our sources are C++17; torch >= 2.14's headers require C++20.
STD = "-std=c++20" if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14) else "-std=c++17"
# -fopenmp: csrc/ops/torch_thread_team.cpp runs the kernels' parallel regions on torch's
# intra-op threads through at::parallel_for, a header template that is an OpenMP region
# only when compiled with OpenMP. The libgomp it links resolves at load time to the copy
# torch has already loaded (same soname): one runtime, one set of threads.
CXX_FLAGS = ["-O3", STD, "-Wall", "-Wextra", "-Wno-unused-parameter", "-fno-math-errno", "-DNDEBUG", "-fopenmp"]


def with_cuda() -> bool:
    """KT_OPS_CUDA=1/0 forces the CUDA key on/off; unset: on when torch has CUDA and nvcc exists."""
    choice = os.environ.get("KT_OPS_CUDA", "").strip()
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if choice == "0":
        return False
    if choice == "1":
        if not available:
            raise RuntimeError(f"KT_OPS_CUDA=1 but torch {torch.__version__} has CUDA {torch.version.cuda} and "
                               f"nvcc's CUDA_HOME is {CUDA_HOME}: both are needed for the CUDA key")
        return True
    return available


def extension():
    if not with_cuda():
        return CppExtension("kt_ops._C", SOURCES, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=LINK_FLAGS)
    return CUDAExtension(
        "kt_ops._C",
        SOURCES + CUDA_SOURCES,
        define_macros=[("KT_OPS_WITH_CUDA", "1")],
        extra_link_args=LINK_FLAGS,
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", STD, "-DNDEBUG"]},
    )


setup(
    name="kt_ops",
    version="0.1.0",
    description="PyTorch operators for Mixture-of-Experts layers on the CPU (kt-kernel compatible)",
    packages=find_packages(include=["kt_ops", "kt_ops.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "safetensors", "gguf", "tqdm>=4.61"],
    entry_points={"console_scripts": ["kt-ops = kt_ops.cli:main"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
