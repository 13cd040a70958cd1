"""Native kernels: C++ torch operators compiled on the machine that runs them, cached, and
loaded with `torch.ops.load_library` (`load_torch_library`).

Why compile here: a kernel built with `-march=native` uses the vector units this CPU has
(AVX-512 on one machine, AVX2 or NEON on another) without shipping a binary per target. An
operator library includes torch's headers and takes ~6 s to build (2-core AMD EPYC), once per
source (and the headers it shares), compiler, CPU and torch build; later starts load the cached
library. Where nothing builds, it returns False and the caller keeps its torch path.

Why operators: torch releases the GIL around an operator called from Python, and a TorchScript
trace records and replays them like aten's own (traces.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from intone.engine.cache_dir import cache_dir

logger = logging.getLogger(__name__)

# No -ffast-math: the kernels say with `omp simd` or vector types where a reduction may be
# reordered.
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC", "-std=c++20")
# Tried in order: the operators' GCC vector types are one register of the target wide
# (vector_math.h), and on AVX-512 GCC uses its 512-bit registers only when told to; a compiler
# that does not take -march=native (some clang builds on ARM) still builds a portable library.
ARCH_FLAGS = (("-march=native", "-mprefer-vector-width=512"), ("-march=native",), ())
BUILD_TIMEOUT_S = 120.0


def cxx_compiler() -> str | None:
    """$CXX, else the first of c++, g++, clang++ on the PATH."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


@functools.cache
def load_torch_library(source: Path, headers: tuple[Path, ...] = ()) -> bool:
    """Whether the torch operators of `source` (C++ against the installed torch's headers,
    registered with TORCH_LIBRARY_FRAGMENT; `headers`: the project's headers it includes) are
    loaded: compiled unless the cache has them for this source, these headers, compiler, CPU
    and torch build, then `torch.ops.load_library`. False where they cannot be built: torch's
    headers ship with its wheels, so what can be missing is a C++ compiler."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    library_dir = root / "lib"
    flags = (
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}",
        f"-L{library_dir}",
        f"-Wl,-rpath,{library_dir}",
    )
    libraries = ("-lc10", "-ltorch_cpu")
    depends = (*(header.read_text() for header in headers), torch.__version__)
    # Where the headers are does not change the build (their text does): no part of the key.
    includes = tuple(dict.fromkeys(f"-I{header.parent}" for header in headers))
    target = _library(cxx_compiler(), source, flags, libraries, depends, includes)
    return target is not None and _load(target, source)


def _load(target: Path, source: Path) -> bool:
    """Whether the library at `target` loads into torch's operator registry; a cached file that
    does not (a damaged one) is deleted, so the next start builds it again."""
    try:
        torch.ops.load_library(str(target))
        return True
    except (OSError, RuntimeError) as e:
        logger.warning("%s does not load (%s): %s runs in torch", target, e, source.name)
        target.unlink(missing_ok=True)
        return False


def _library(
    cc: str | None,
    source: Path,
    flags: tuple[str, ...],
    libraries: tuple[str, ...],
    depends: tuple[str, ...],
    includes: tuple[str, ...],
) -> Path | None:
    """The path of the library built from `source` with `flags` (and `includes`) and the first
    of `ARCH_FLAGS` the compiler takes, built now unless the cache has it; `depends`: whatever
    else the build depends on."""
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
    known = [source.read_text(), cc, identity, _cpu(), *depends, *libraries]
    for arch in ARCH_FLAGS:
        all_flags = (*flags, *arch)
        key = hashlib.sha256("\0".join([*known, *all_flags]).encode()).hexdigest()[:16]
        target = directory / f"{source.stem}-{key}.so"
        if target.exists() or _compile(cc, (*all_flags, *includes), source, libraries, target):
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
