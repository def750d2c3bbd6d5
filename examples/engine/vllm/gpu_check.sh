#!/usr/bin/env bash
# The device path of inferscale_vllm on a GPU machine, in one command (from the repository root):
#   bash examples/engine/vllm/gpu_check.sh
# Builds the extension with CUDA (INFERSCALE_VLLM_CUDA=ON, sm_90 only) into a temporary folder,
# then runs tests/test_cuda_path.py against it with pytest, and prints PASS or FAIL. A skipped test
# (no GPU visible to torch) counts as FAIL here: this script is for machines with a GPU.
# Needs: a Python with torch (CUDA build), nanobind and pytest (INFERSCALE_GPU_PYTHON, else the first
# of python3 and /opt/torch/.venv/bin/python3 that has them), CMake >= 3.25, nvcc >= 12.1, a C++17
# compiler; ninja if present. No network.
# INFERSCALE_GPU_CHECK_PIP=1 also builds the package the pip way (scikit-build-core, no isolation,
# -C cmake.define.INFERSCALE_VLLM_CUDA=ON) and runs the test against that wheel.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { printf 'gpu_check: %s\n' "$*"; }
fail() { say "FAIL: $*"; exit 1; }
t0=$SECONDS

PY=${INFERSCALE_GPU_PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3 /opt/torch/.venv/bin/python3; do
    p=$(command -v "$c" 2>/dev/null) || continue
    if "$p" -c 'import torch, nanobind, pytest' 2>/dev/null; then PY=$p; break; fi
  done
fi
[ -n "$PY" ] || fail "no Python with torch, nanobind and pytest (set INFERSCALE_GPU_PYTHON)"
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || fail "nvcc not found (PATH, /usr/local/cuda*/bin)"
say "python $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")'))"
say "$(nvcc --version | tail -n 2 | head -n 1)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/inferscale-gpu-check.XXXXXX")
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)

run_test() {  # $1: PYTHONPATH holding inferscale_vllm, $2: a label
  local xml="$tmp/junit-$2.xml"
  (cd "$here/tests" && PYTHONPATH="$1" "$PY" -m pytest -v -rs -p no:cacheprovider \
     --junitxml="$xml" test_cuda_path.py)
  local rc=$?
  local counts
  counts=$("$PY" - "$xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
s = r if r.tag == "testsuite" else r.find("testsuite")
print(s.get("tests"), s.get("failures"), s.get("errors"), s.get("skipped"))
EOF
)
  read -r tests failures errors skipped <<<"$counts"
  say "$2: $tests tests, $failures failed, $errors errors, $skipped skipped (pytest rc $rc)"
  [ "$rc" -eq 0 ] && [ "${skipped:-1}" = 0 ] && [ "${tests:-0}" -gt 0 ]
}

say "building the CUDA extension in $tmp/build (sm_90)"
cmake -S "$here" -B "$tmp/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PY" -DINFERSCALE_VLLM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  >"$tmp/configure.log" 2>&1 || { tail -n 40 "$tmp/configure.log"; fail "configure (log: $tmp/configure.log)"; }
cmake --build "$tmp/build" -j16 >"$tmp/build.log" 2>&1 \
  || { tail -n 60 "$tmp/build.log"; fail "build (log: $tmp/build.log)"; }
say "built in $((SECONDS - t0)) s"
"$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); from inferscale_vllm import _inferscale as m; assert m.HAS_CUDA, "built without CUDA"' \
  "$tmp/build/python" || fail "the built extension does not have the device path"

run_test "$tmp/build/python" cmake || fail "tests/test_cuda_path.py (cmake build); $((SECONDS - t0)) s"

if [ "${INFERSCALE_GPU_CHECK_PIP:-0}" = 1 ]; then
  say "building the wheel the pip way (scikit-build-core, INFERSCALE_VLLM_CUDA=ON)"
  "$PY" -m pip wheel --no-build-isolation --no-deps -w "$tmp/wheel" \
    -C cmake.define.INFERSCALE_VLLM_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 \
    -C build-dir="$tmp/pip-build" "$here" >"$tmp/pip.log" 2>&1 \
    || { tail -n 60 "$tmp/pip.log"; fail "pip wheel (log: $tmp/pip.log)"; }
  "$PY" -m pip install --no-deps --no-index --target "$tmp/site" "$tmp"/wheel/*.whl \
    >>"$tmp/pip.log" 2>&1 || { tail -n 20 "$tmp/pip.log"; fail "installing the wheel"; }
  run_test "$tmp/site" pip || fail "tests/test_cuda_path.py (pip wheel); $((SECONDS - t0)) s"
fi

say "PASS ($((SECONDS - t0)) s; build folder $tmp)"
