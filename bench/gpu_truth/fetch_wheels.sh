#!/usr/bin/env bash
# Download wheels.txt for the GPU machine (Python 3.12, manylinux x86-64) into .whl/ at the
# repository root (git-ignored through .git/info/exclude); carry .whl with the run.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>"$(git rev-parse --git-path info/exclude)"
PLATFORMS=()
for n in 28 27 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  -r <(grep -v '^#' bench/gpu_truth/wheels.txt)
du -sh .whl
