#!/usr/bin/env bash
# The GPU truth: run once where a GPU is at hand, under 8 minutes; every part writes
# OUT/<part>.json (device, driver, torch, time; targets with met: true/false; its errors).
#
#   bash bench/gpu_truth.sh                         # all parts on the GPU -> bench/results/gpu
#   bash bench/gpu_truth.sh --cpu --out /tmp/x env kv:60 overhead:5   # no GPU: labelled simulated
#
# A part is NAME[:TIMEOUT_S][&] (a module bench/gpu_truth/NAME.py); '&' runs it in the
# background (the demo: its jobs run on CPU, on the upper half of the cores), waited for at
# the end. A part that fails or outruns its timeout is recorded in its JSON and the next runs.
# Wheels in .whl/ (the project's deps the GPU image lacks) are installed to /tmp/site first.
set -u

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$REPO/bench/results/gpu
CPU=()
PY=${PYTHON:-python3}
BUDGET_S=${GPU_TRUTH_BUDGET_S:-465}
DEFAULT_PARTS=("demo:460&" env:60 nvml:90 overhead:150 matmul:120 kv:90)
PARTS=()
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) CPU=(--cpu) ;;
    --out) OUT=$2; shift ;;
    *) PARTS+=("$1") ;;
  esac
  shift
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=("${DEFAULT_PARTS[@]}")
cd "$REPO" || exit 1
mkdir -p "$OUT/logs"
START=$(date +%s)

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

NCPU=$(nproc 2>/dev/null || echo 1)
FG_PIN=() BG_PIN=()
if [ "$NCPU" -ge 8 ] && command -v taskset >/dev/null; then
  FG_PIN=(taskset -c "0-$((NCPU / 2 - 1))") BG_PIN=(taskset -c "$((NCPU / 2))-$((NCPU - 1))")
fi

left_s() { echo $((BUDGET_S - ($(date +%s) - START))); }

# run_part NAME TIMEOUT PIN...: the part's module under timeout; on failure its JSON says why.
run_part() {
  local name=$1 limit=$2; shift 2
  local log=$OUT/logs/$name.log rc
  echo "[gpu_truth] $(date -u +%H:%M:%S) $name (timeout ${limit}s)"
  "$@" timeout -k 10 "$limit" "$PY" -m "bench.gpu_truth.$name" --out "$OUT" "${CPU[@]}" \
    >"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    "$PY" -m bench.gpu_truth._record "$name" "$rc" "$log" --out "$OUT" "${CPU[@]}" \
      >>"$log" 2>&1 ||
      printf '{"part": "%s", "errors": {"process": "exit %s; the recorder failed too"}}\n' \
        "$name" "$rc" >"$OUT/$name.json"
  fi
  echo "[gpu_truth] $(date -u +%H:%M:%S) $name done (exit $rc)"
}

BG=()
for spec in "${PARTS[@]}"; do
  background=0
  case $spec in *'&') background=1; spec=${spec%&} ;; esac
  name=${spec%%:*}
  limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=120
  left=$(left_s)
  if [ "$left" -lt 10 ]; then
    "$PY" -m bench.gpu_truth._record "$name" 124 /dev/null --out "$OUT" "${CPU[@]}" >/dev/null
    echo "[gpu_truth] $name skipped: the ${BUDGET_S}s budget is spent"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ $background -eq 1 ]; then
    run_part "$name" "$limit" "${BG_PIN[@]}" &
    BG+=($!)
  else
    run_part "$name" "$limit" "${FG_PIN[@]}"
  fi
done
for pid in "${BG[@]}"; do wait "$pid"; done
"$PY" -m bench.gpu_truth.summary --out "$OUT" "${CPU[@]}"
echo "[gpu_truth] finished in $(($(date +%s) - START))s; results in $OUT"
