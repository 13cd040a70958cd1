#!/usr/bin/env bash
# The benchmark sweep on a CUDA machine, in about 10 minutes, results under $OUT.
#
#   OUT=/some/dir bash bench/device.sh          (from the repository root)
#
# In-process modes (sequential, interleaved, batched, batched-fast) and ws run with
# device="cuda"; the reference (`pocket-tts serve`) has no device option and stays on the CPU,
# which the results say. Needs a Python with torch (CUDA build), intone's dependencies and
# pocket-tts; no network: the checkpoint is generated here (random weights, released size).
#
# Budget (~10 min): the sweep runs under `timeout` ($SWEEP_SECONDS, default 480 s); results.json
# is rewritten after every mode, so a cut-off sweep still leaves what it measured. Modes run most
# important first. Slow modes get 8 requests per level (--slow-requests 8), the engine modes the
# default counts (up to 64 per level). Also written: nvidia-smi, the per-stage micro-benchmark
# (bench/stages.py) and the logs.
set -uo pipefail

OUT=${OUT:?set OUT to the output directory}
SWEEP_SECONDS=${SWEEP_SECONDS:-480}
MODES=${MODES:-batched,batched-fast,sequential,ws,interleaved,reference}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PATH="$(dirname "$(command -v "$PY")"):$PATH"

echo "== $(date -u) on $(hostname); python: $PY"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi not available"
"$PY" - <<'EOF' || { echo "torch with CUDA is required"; exit 1; }
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF
if ! "$PY" -c "import intone.engine" 2>/dev/null; then
  echo "intone is not installed: trying an offline editable install"
  "$PY" -m pip install --no-deps --no-build-isolation -e . || { echo "install failed"; exit 1; }
fi
"$PY" -c "import pocket_tts" 2>/dev/null || echo "pocket-tts missing: the reference mode will fail"

CKPT="$OUT/checkpoint-full"
if [ ! -f "$CKPT/config.yaml" ]; then
  "$PY" -m intone.provider.cli make-checkpoint --preset full --out "$CKPT" || exit 1
fi

echo "== per-stage costs (cuda)"
timeout 90 "$PY" bench/stages.py --model "$CKPT" --device cuda --threads 1 --batches 1,4,8,16 \
  --repeats 20 --out "$OUT/stages-cuda.json"
timeout 60 "$PY" bench/stages.py --model "$CKPT" --device cuda --threads 1 --batches 1,8,16 \
  --repeats 20 --fast --out "$OUT/stages-cuda-fast.json"

echo "== sweep: $MODES at $CONCURRENCY"
timeout "$SWEEP_SECONDS" "$PY" bench/run.py --model "$CKPT" --device cuda --modes "$MODES" \
  --concurrency "$CONCURRENCY" --slow-requests 8 --warmup 3 --out "$OUT/bench"
status=$?
[ $status -eq 124 ] && echo "sweep cut off after $SWEEP_SECONDS s: partial results"
# The report is written at the end of a sweep; rebuild it from what a cut-off sweep saved.
[ -f "$OUT/bench/results.json" ] && "$PY" bench/report.py "$OUT/bench"
rm -rf "$CKPT"  # 440 MB of random weights: not worth bringing back
echo "== done: $(ls "$OUT/bench" 2>/dev/null | tr '\n' ' ')"
