"""Kernels compiled on the machine that runs them and cached: plain C called through ctypes
(`build`), and C++ torch operators loaded with `torch.ops.load_library` (`load_torch_library`).

Why compile here: a kernel built with `-march=native` uses the vector units this CPU has
(AVX-512 on one machine, AVX2 or NEON on another) without shipping a binary per target. A C
kernel has no torch headers, so its build takes well under a second; an operator library includes
torch's headers and takes ~6 s (2-core AMD EPYC). Either happens once per source, compiler, CPU
(and torch build), and later starts load the cached library. Where nothing builds, both return
None and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from intone.engine.cache_dir import cache_dir

logger = logging.getLogger(__name__)

# No -ffast-math: the kernels say with `omp simd` where a reduction may be reordered.
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
# Tried in order: a compiler that does not take -march=native (some clang builds on ARM) still
# builds a portable library.
ARCH_FLAGS = (("-march=native",), ())
# The operators' GCC vector types are 16 floats wide: on AVX-512 one register each, where GCC
# and Clang otherwise split them in two 256-bit halves (decoder_ops.cpp).
WIDE_ARCH_FLAGS = (("-march=native", "-mprefer-vector-width=512"), *ARCH_FLAGS)
BUILD_TIMEOUT_S = 120.0

T = TypeVar("T")


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on the PATH."""
    return _find("CC", ("cc", "gcc", "clang"))


def cxx_compiler() -> str | None:
    """$CXX, else the first of c++, g++, clang++ on the PATH."""
    return _find("CXX", ("c++", "g++", "clang++"))


def _find(variable: str, names: tuple[str, ...]) -> str | None:
    if os.environ.get(variable):
        return os.environ[variable]
    return next((path for name in names if (path := shutil.which(name))), None)


@functools.cache
def build(source: Path) -> ctypes.CDLL | None:
    """The library compiled from `source`, from the cache when this source, compiler and CPU
    built it before; None (logged once per source) where it cannot be built."""
    target = _library(compiler(), source, FLAGS, ARCH_FLAGS, ())
    return None if target is None else _load(target, source, ctypes.CDLL)


@functools.cache
def load_torch_library(source: Path) -> bool:
    """Whether the torch operators of `source` (C++ against the installed torch's headers,
    registered with TORCH_LIBRARY) are loaded: compiled unless the cache has them for this
    source, compiler, CPU and torch build, then `torch.ops.load_library`. False where they
    cannot be built: the headers ship with torch's wheels, so what can be missing is a C++
    compiler."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    library_dir = root / "lib"
    flags = (
        *FLAGS,
        "-std=c++20",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        f"-L{library_dir}",
        f"-Wl,-rpath,{library_dir}",
    )
    libraries = ("-lc10", "-ltorch_cpu")
    cxx = cxx_compiler()
    target = _library(cxx, source, flags, WIDE_ARCH_FLAGS, libraries, torch.__version__)
    return target is not None and _load(target, source, _register_operators) is not None


def _register_operators(path: str) -> str:
    """Loads the library at `path` into torch's operator registry (`torch.ops.<namespace>`)."""
    torch.ops.load_library(path)
    return path


def _load(target: Path, source: Path, loader: Callable[[str], T]) -> T | None:
    """`loader(target)`; None where the cached file does not load (a damaged cache file: it is
    deleted, so the next start builds it again)."""
    try:
        return loader(str(target))
    except (OSError, RuntimeError) as e:
        logger.warning("%s does not load (%s): %s runs in torch", target, e, source.name)
        target.unlink(missing_ok=True)
        return None


def _library(
    cc: str | None,
    source: Path,
    flags: tuple[str, ...],
    arch_flags: tuple[tuple[str, ...], ...],
    libraries: tuple[str, ...],
    *what: str,
) -> Path | None:
    """The path of the library built from `source` with `flags` and the first of `arch_flags`
    the compiler takes, built now unless the cache has it; `what`: whatever else the build
    depends on."""
    if cc is None:
        logger.warning("no compiler found for %s: it runs in torch", source.name)
        return None
    try:
        identity = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("compiler %s does not run (%s): %s runs in torch", cc, e, source.name)
        return None
    directory = cache_dir() / "kernels"
    depends = [source.read_text(), cc, identity, _cpu(), *what, *libraries]
    for arch in arch_flags:
        all_flags = (*flags, *arch)
        key = hashlib.sha256("\0".join([*depends, *all_flags]).encode()).hexdigest()[:16]
        target = directory / f"{source.stem}-{key}.so"
        if target.exists() or _compile(cc, all_flags, source, libraries, target):
            return target
    return None


def _compile(
    cc: str, flags: tuple[str, ...], source: Path, libraries: tuple[str, ...], target: Path
) -> bool:
    """Compile into a temporary file beside `target`, then rename: a process that loads the
    library while another builds it sees the whole file or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, str(source), "-o", partial, *libraries],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if result.returncode == 0:
            os.replace(partial, target)
            logger.info("compiled %s with %s %s", source.name, cc, " ".join(flags))
            return True
        logger.warning(
            "%s failed to compile with %s %s: %s", source.name, cc, " ".join(flags), result.stderr
        )
        return False
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("%s failed to compile with %s: %s", source.name, cc, e)
        return False
    finally:
        Path(partial).unlink(missing_ok=True)


def _cpu() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the
    machine and processor names."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
