#!/usr/bin/env bash
# The device kit's run on a CUDA machine that has Python 3.12 and torch but no package registry:
# installs intone and its dependencies offline from bench/wheelhouse/ (built beforehand, where
# PyPI is reachable, by bench/device_kit.sh, and carried with the tree), then, in at most 8
# minutes, writes under $OUT:
#   cuda-tests.txt       `pytest -m cuda` (each stage against the CPU, tests/engine/test_engine_cuda.py)
#   stages-*.json        bench/stages.py at batch 1, 8, 16, 64: full size and 2M
#   sweep-*/             bench/run.py, mode batched, c = 1, 8, 64, 256: full size and 2M
#   device.log, nvidia-smi.txt, pip-freeze.txt
#
#   OUT=/some/dir bash bench/device.sh              (from the repository root, on the GPU)
#   bash bench/device.sh --dry-run                  (here, no GPU: see below)
#
# Each part runs under its own `timeout`, so a slow part cuts itself short and the others still
# run; the sweeps write results.json after every level, so a cut-off sweep keeps what it
# measured. Checkpoints are generated (random weights at the released sizes): no model hub.
#
# --dry-run makes a fresh venv of Python 3.12 ($DRY_RUN_PYTHON), installs the wheelhouse and
# intone into it with --no-index (no registry is reached), and checks that every dependency
# imports. Torch comes from $TORCH_FIND_LINKS (default /opt/wheels) where that holds a wheel for
# this Python (the GPU machine has its own torch); with torch it also imports intone, collects
# `pytest -m cuda` and runs the bench scripts' --help. It runs no test and needs no GPU.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
WHEELHOUSE=${WHEELHOUSE:-$ROOT/bench/wheelhouse}
REQUIREMENTS=$ROOT/bench/device-requirements.txt
# Python modules the wheelhouse must provide (import names of device-requirements.txt's packages).
MODULES="numpy safetensors sentencepiece tokenizers huggingface_hub soxr soundfile yaml pydantic
prometheus_client starlette uvicorn websockets num2words audiotsm pytest pytest_asyncio hypothesis
psutil setuptools"

offline_install() {  # $1: python; installs the wheelhouse and intone (editable), no registry
  local py=$1
  [ -d "$WHEELHOUSE" ] || { echo "no $WHEELHOUSE: run bench/device_kit.sh first"; return 1; }
  # No pip configuration: nothing but the wheelhouse is looked at. A throwaway GPU machine's
  # system Python may be marked externally managed (PEP 668): installed into all the same.
  export PIP_BREAK_SYSTEM_PACKAGES=1
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$py" -m pip install -q --no-index --find-links "$WHEELHOUSE" -r "$REQUIREMENTS" || return 1
  # intone's torch requirement is the machine's own torch: not resolved against the wheelhouse.
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
}

check_imports() {  # $1: python
  local py=$1 module failed=0
  for module in $MODULES; do
    "$py" -c "import $module" 2>/dev/null || { echo "missing: $module"; failed=1; }
  done
  [ $failed -eq 0 ] && echo "every dependency imports"
  return $failed
}

if [ "${1:-}" = "--dry-run" ]; then
  # The GPU machine's Python: 3.12 (the wheelhouse is cp312).
  PY312=${DRY_RUN_PYTHON:-}
  if [ -z "$PY312" ]; then
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3; do
      if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY312=$candidate
        break
      fi
    done
  fi
  [ -n "$PY312" ] || { echo "no Python 3.12 found: set DRY_RUN_PYTHON"; exit 1; }
  TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}
  VENV=$(mktemp -d)/venv
  trap 'rm -rf "$(dirname "$VENV")"' EXIT
  echo "== dry run: $PY312 ($("$PY312" --version 2>&1)), venv $VENV"
  "$PY312" -m venv "$VENV" || exit 1
  PY="$VENV/bin/python"
  offline_install "$PY" || { echo "offline install failed"; exit 1; }
  check_imports "$PY" || exit 1
  # The GPU machine brings torch; here, a local wheel for this Python if there is one.
  if env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --no-index \
    --find-links "$TORCH_FIND_LINKS" torch 2>/dev/null; then
    "$PY" -c "import intone.engine, intone.provider.server.app" || exit 1
    "$PY" -m pytest -q -m cuda --collect-only tests/engine/test_engine_cuda.py | tail -1 || exit 1
    "$PY" bench/stages.py --help >/dev/null && "$PY" bench/run.py --help >/dev/null || exit 1
    echo "== dry run passed (with torch)"
  else
    echo "no torch wheel for $("$PY" --version) under $TORCH_FIND_LINKS: intone's imports and" \
      "the cuda tests' collection need torch and were not checked"
    echo "== dry run passed (wheelhouse only)"
  fi
  exit 0
fi

OUT=${OUT:?set OUT to the output directory}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
PY=${PYTHON:-python3}
started=$SECONDS
echo "== $(date -u) on $(hostname); python: $PY"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi not available"
"$PY" - <<'EOF' || { echo "torch with CUDA is required"; exit 1; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF
if ! "$PY" -c "import intone.engine, pytest_asyncio, soundfile" 2>/dev/null; then
  echo "== offline install from $WHEELHOUSE"
  offline_install "$PY" || { echo "install failed"; exit 1; }
fi
check_imports "$PY"
"$PY" -m pip freeze > "$OUT/pip-freeze.txt" 2>/dev/null
export HF_HUB_OFFLINE=1

# Each part's limit in seconds; a part is skipped once the run has spent BUDGET_S.
BUDGET_S=${BUDGET_S:-470}
left() { echo $((BUDGET_S - (SECONDS - started))); }
limit() {  # $1: the part's own limit; prints it, or less where the budget has less left
  local l; l=$(left)
  [ "$l" -lt "$1" ] && echo "$l" || echo "$1"
}

echo "== pytest -m cuda ($((SECONDS - started)) s)"
timeout 120 "$PY" -m pytest -q -m cuda tests/engine/test_engine_cuda.py -rs > "$OUT/cuda-tests.txt" 2>&1
echo "pytest exit $?: $(tail -1 "$OUT/cuda-tests.txt")"

declare -A PRESET=([full]=full [2m]=english_2m_2026-10)
# Closed-loop levels and requests per level: one round at 256 (a level is at least 2 rounds
# elsewhere in bench/, which does not fit the 8 minutes here).
LEVELS=${LEVELS:-"1:4 8:16 64:64 256:256"}
for model in full 2m; do
  [ "$(left)" -gt 20 ] || { echo "out of time: $model skipped"; continue; }
  ckpt="$OUT/checkpoint-$model"
  "$PY" -m intone.provider.cli make-checkpoint --preset "${PRESET[$model]}" --out "$ckpt" \
    > /dev/null || { echo "make-checkpoint $model failed"; continue; }
  echo "== stages, $model ($((SECONDS - started)) s)"
  timeout "$(limit 40)" "$PY" bench/stages.py --model "$ckpt" --device cuda --threads 1 \
    --batches 1,8,16,64 --repeats 20 --out "$OUT/stages-$model.json"
  # One level per run, merged into one results.json: a level cut off loses only itself. Rows
  # and KV pages for every stream of the largest level at once (the engine's defaults are sized
  # for a CPU).
  sweep="$OUT/sweep-$model"
  for level in $LEVELS; do
    c=${level%%:*}
    [ "$(left)" -gt 10 ] || { echo "out of time: $model c=$c skipped"; continue; }
    echo "== sweep, $model: batched at c=$c ($((SECONDS - started)) s)"
    merge=()
    [ -f "$sweep/results.json" ] && merge=(--merge-from "$sweep")
    timeout "$(limit 45)" "$PY" bench/run.py --model "$ckpt" --device cuda --modes batched \
      --concurrency "$c" --requests "${level##*:}" --max-active 256 --kv-memory-mb 4096 \
      --warmup 2 --out "$sweep" ${merge[@]+"${merge[@]}"}
    [ $? -eq 124 ] && echo "sweep $model c=$c cut off"
  done
  rm -rf "$ckpt"  # random weights: not worth bringing back
done
echo "== done in $((SECONDS - started)) s: $(ls "$OUT" | tr '\n' ' ')"
