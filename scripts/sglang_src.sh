#!/usr/bin/env bash
# Unpack SGLang's Python source (its wheel, without its dependencies) into a
# cache outside the checkout, for the plugin's checks against SGLang's real
# classes (tests/test_adapter_sglang_plugin.py). Prints the directory; its
# PYTHONPATH is "$DIR/src:$DIR/deps:$DIR/stubs", used with the vLLM venv's
# Python (scripts/vllm_venv.sh), which already holds the CPU torch and most of
# SGLang's pure-Python dependencies (transformers, pydantic, zmq, triton...).
#
# SGLang cannot be pip-installed here (its source runs: the server starts on
# CPU with --attention-backend torch_native): it pins torch==2.14.1 (a CUDA
# build, GBs), flashinfer, sglang-kernel (CUDA kernels; no CPU wheel on
# PyPI) and more. So: its wheel (~40 MB) --no-deps, without its .so files; the
# five small dependencies the vLLM venv lacks, --no-deps into deps/; and a
# torchvision stand-in (tests/sglang_support/stubs: torchvision's wheels are
# CUDA-linked and fail to load beside the CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_progress.sh
VERSION="${1:-${KVPOOL_SGLANG_SRC_VERSION:-0.5.23}}"
PY="${2:-${KVPOOL_VLLM_PYTHON:-python3}}"  # deps/ holds compiled wheels (orjson): for this Python
DEST="${KVPOOL_SGLANG_SRC:-$HOME/.cache/kvpool/sglang-src-$VERSION}"
MARK="$DEST/.kvpool-sglang-src-ready"
if [[ -f "$MARK" ]]; then
  step "using the cached SGLang $VERSION source $DEST"
else
  step "unpacking SGLang $VERSION's Python source into $DEST (a ~40 MB wheel, --no-deps; once, cached after)"
  rm -rf "$DEST" "$DEST.partial"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP" "sglang==$VERSION" >&2
  WHEEL="$(ls "$TMP"/sglang-"$VERSION"-*.whl)"
  mkdir -p "$DEST.partial/src"
  "$PY" - "$WHEEL" "$DEST.partial/src" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    # Not the compiled extensions (Rust helpers the checks do not import); the
    # JIT kernels' headers stay: sglang.kernels.jit looks for its directory.
    z.extractall(dest, [n for n in z.namelist() if not n.endswith(".so")])
EOF
  step "installing the small dependencies the vLLM venv lacks into $DEST/deps (--no-deps)"
  "$PY" -m pip install -q --no-deps --target "$DEST.partial/deps" \
    orjson==3.13.0 ipython==9.19.1 traitlets==5.16.1 gguf==0.19.0 soundfile==0.14.0 >&2
  cp -r tests/sglang_support/stubs "$DEST.partial/stubs"
  mv "$DEST.partial" "$DEST"
  touch "$MARK"
fi
echo "$DEST"
