#!/usr/bin/env bash
# Builds, here (PyPI reachable), the wheelhouse bench/device.sh installs from on a GPU machine
# that has Python 3.12 and torch but no package registry: every runtime, test and benchmark
# dependency except torch and its own, as cp312 manylinux x86_64 wheels.
#
#   bash bench/device_kit.sh            # -> bench/wheelhouse/ (git-ignored; carry it with the tree)
#
# The list is `bench/device-requirements.txt`; pip resolves its closure. Left out on purpose:
# torch (the machine has its CUDA build) and matplotlib (~20 MB with its deps: bench/report.py
# writes results.md without plots). A package with no wheel on PyPI (docopt, num2words'
# dependency, is an sdist) is built into a pure-Python wheel here. The wheelhouse must stay small
# enough to travel with the tree (64 MiB in all); the script fails past WHEELHOUSE_MAX_MB.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELHOUSE=${WHEELHOUSE:-$ROOT/bench/wheelhouse}
REQUIREMENTS=$ROOT/bench/device-requirements.txt
WHEELHOUSE_MAX_MB=${WHEELHOUSE_MAX_MB:-45}
PY=${PYTHON:-python3}
# The target: what the GPU machine runs. manylinux_2_28 as well as 2014: newer releases ship
# only the former, and a machine with torch >= 2.6's wheels has glibc >= 2.28.
TARGET=(--python-version 3.12 --implementation cp --abi cp312
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux_2_28_x86_64)

rm -rf "$WHEELHOUSE"
mkdir -p "$WHEELHOUSE"
# Packages whose only distribution is an sdist (pure Python): wheels built here, then offered to
# the binary-only resolution below as local files.
SDIST_ONLY=(docopt==0.6.2)
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$WHEELHOUSE" "${SDIST_ONLY[@]}"

"$PY" -m pip download -q --only-binary=:all: "${TARGET[@]}" --find-links "$WHEELHOUSE" \
  -d "$WHEELHOUSE" -r "$REQUIREMENTS"

size_mb=$(du -sm "$WHEELHOUSE" | cut -f1)
count=$(ls "$WHEELHOUSE"/*.whl | wc -l)
echo "wheelhouse: $count wheels, $size_mb MB in $WHEELHOUSE"
if [ "$size_mb" -gt "$WHEELHOUSE_MAX_MB" ]; then
  echo "the wheelhouse is over $WHEELHOUSE_MAX_MB MB: it must travel with the tree (64 MiB)" >&2
  exit 1
fi
