"""C kernels compiled on the machine that runs them, cached, and called through ctypes.

Why compile here: a kernel built with `-march=native` uses the vector units this CPU has
(AVX-512 on one machine, AVX2 or NEON on another) without shipping a binary per target. The
kernels are plain C with no torch headers, so a build takes well under a second; it happens once
per source, compiler and CPU, and later starts load the cached library. Where no C compiler works
`build` returns None and the caller keeps its torch path.
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
from pathlib import Path

from intone.engine.cache_dir import cache_dir

logger = logging.getLogger(__name__)

# No -ffast-math: the kernels say with `omp simd` where a reduction may be reordered.
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
# Tried in order: a compiler that does not take -march=native (some clang builds on ARM) still
# builds a portable library.
ARCH_FLAGS = (("-march=native",), ())
BUILD_TIMEOUT_S = 120.0


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on the PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


@functools.cache
def build(source: Path) -> ctypes.CDLL | None:
    """The library compiled from `source`, from the cache when this source, compiler and CPU
    built it before; None (logged once per source) where it cannot be built."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found ($CC, cc, gcc, clang): %s runs in torch", source.name)
        return None
    try:
        identity = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("C compiler %s does not run (%s): %s runs in torch", cc, e, source.name)
        return None
    directory = cache_dir() / "kernels"
    what = [source.read_text(), cc, identity, _cpu()]  # what a build depends on, but its flags
    for arch in ARCH_FLAGS:
        flags = (*FLAGS, *arch)
        key = hashlib.sha256("\0".join([*what, *flags]).encode()).hexdigest()[:16]
        target = directory / f"{source.stem}-{key}.so"
        if target.exists() or _compile(cc, flags, source, target):
            try:
                return ctypes.CDLL(str(target))
            except OSError as e:  # a damaged cache file: the next start builds it again
                logger.warning("%s does not load (%s): %s runs in torch", target, e, source.name)
                target.unlink(missing_ok=True)
                return None
    return None


def _compile(cc: str, flags: tuple[str, ...], source: Path, target: Path) -> bool:
    """Compile into a temporary file beside `target`, then rename: a process that loads the
    library while another builds it sees the whole file or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, str(source), "-o", partial],
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
