#!/usr/bin/env bash
# Install kvpool with its test extras into the project venv and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec "${KVPOOL_VENV:-.venv}/bin/pytest" "$@"
