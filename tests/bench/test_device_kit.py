"""The GPU device kit (bench/device_kit.sh, bench/device.sh): scripts that parse, a wheel list
that covers the project's dependencies, and, where a wheelhouse was built
(`bash bench/device_kit.sh`, which needs PyPI: CI does not build it), the offline install into a
fresh Python 3.12 venv (`bench/device.sh --dry-run`, about a minute)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "bench" / "device_kit.sh", ROOT / "bench" / "device.sh"]
REQUIREMENTS = ROOT / "bench" / "device-requirements.txt"
WHEELHOUSE = ROOT / "bench" / "wheelhouse"
# What the GPU machine brings (torch), and what the kit leaves out on purpose (see
# device_kit.sh): the packages of the `dev` extra that `pytest -m cuda` and the device sweep
# do not import.
NOT_IN_KIT = {"torch"}
TEST_PACKAGES = {"pytest", "pytest-asyncio", "hypothesis"}


def name(requirement: str) -> str:
    """A requirement's normalised project name."""
    project = re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", project).lower()


def kit_packages() -> set[str]:
    lines = REQUIREMENTS.read_text().splitlines()
    return {name(line) for line in lines if line.strip() and not line.startswith("#")}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_kit_scripts_parse(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_kit_holds_every_runtime_and_cuda_test_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {name(r) for r in project["dependencies"]} - NOT_IN_KIT
    missing = (runtime | TEST_PACKAGES) - kit_packages()
    assert not missing, f"bench/device-requirements.txt lacks {sorted(missing)}"


@pytest.mark.skipif(not WHEELHOUSE.is_dir(), reason="no wheelhouse: bash bench/device_kit.sh")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_wheelhouse_installs_offline_into_python_3_12() -> None:
    result = subprocess.run(
        ["bash", str(SCRIPTS[1]), "--dry-run"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every dependency imports" in result.stdout
    assert "dry run passed" in result.stdout
