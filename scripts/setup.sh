#!/usr/bin/env bash
# Create (or reuse) the project venv and install kvpool into it from source.
# torch is pinned to the CPU wheel first: an unpinned resolve on a CPU machine
# would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPOOL_VENV:-.venv}"
EXTRAS="${1:-}"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
"$PY" -m pip install -q "torch==${KVPOOL_TORCH_VERSION:-2.13.0}"
"$PY" -m pip install -q ".${EXTRAS:+[$EXTRAS]}"
