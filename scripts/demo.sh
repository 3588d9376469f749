#!/usr/bin/env bash
# The main job: install kvpool (CPU) and run `kvpool demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_progress.sh
scripts/setup.sh
step "running kvpool demo $*"
exec "${KVPOOL_VENV:-.venv}/bin/kvpool" demo "$@"
