#!/usr/bin/env bash
# Create (or reuse) the project venv and install kvpool into it from source.
# torch is pinned to the CPU wheel first: an unpinned resolve on a CPU machine
# would download a multi-GB CUDA build. One progress line per step on stderr
# (pip's own output too: stdout stays free for the caller).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_progress.sh
VENV="${KVPOOL_VENV:-.venv}"
EXTRAS="${1:-}"
TORCH="${KVPOOL_TORCH_VERSION:-2.13.0}"
if [[ ! -x "$VENV/bin/python" ]]; then
  step "creating the venv $VENV"
  python3 -m venv "$VENV"
else
  step "using the venv $VENV"
fi
PY="$VENV/bin/python"
step "updating pip"
"$PY" -m pip install -q --upgrade pip >&2
if [[ "$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null)" == "$TORCH"* ]]; then
  step "torch $TORCH is installed"
else
  # Minutes on a first install (a ~200 MB wheel): pip's own lines show it going.
  step "installing torch==$TORCH (CPU wheel)"
  "$PY" -m pip install --progress-bar on "torch==$TORCH" >&2
fi
step "building and installing kvpool${EXTRAS:+[$EXTRAS]} (C++ build in an isolated env: a minute or two)"
# The compiler's progress lines ("[ 40%] Building CXX object ...") as they
# come, so a minute of C++ does not look like a hang; the whole log is kept
# and its end shown if the build fails.
LOG="$(mktemp -t kvpool-build.XXXXXX.log)"
set +e
"$PY" -m pip install -v ".${EXTRAS:+[$EXTRAS]}" 2>&1 | tee "$LOG" \
  | grep --line-buffered -E '^ *\[ *[0-9]+(%|/[0-9]+)\] (Building|Linking)' | sed -u -E 's#^ *(\[[^]]*\]) ([A-Za-z]+) .*[ /]([^ /]+)$#    \1 \2 \3#' >&2
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 ]]; then
  tail -n 60 "$LOG" >&2
  step "building kvpool failed (exit $rc); the whole log: $LOG"
  exit "$rc"
fi
rm -f "$LOG"
step "kvpool $("$PY" -c 'import kvpool; print(kvpool.__version__)') is installed in $VENV"
