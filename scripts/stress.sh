#!/usr/bin/env bash
# Run the whole test suite (scripts/test.sh "$@") with N CPU-bound processes
# beside it, N = $KVPOOL_STRESS_PROCS (default 4): the suite must pass on a busy
# machine, where no test may assume how much happens in a given time (issue 10,
# item 12). The burners are killed when this script exits (also on Ctrl-C, and
# each burner ends by itself if this script is SIGKILLed). Prints the elapsed
# time; exits with the suite's status.
#   scripts/stress.sh -x -q                      # the whole suite, 4 burners
#   KVPOOL_STRESS_PROCS=8 scripts/stress.sh tests/test_pool.py
set -euo pipefail
cd "$(dirname "$0")/.."
procs="${KVPOOL_STRESS_PROCS:-4}"
if [[ ! "$procs" =~ ^[0-9]+$ ]]; then
  echo "stress: KVPOOL_STRESS_PROCS must be a whole number, got '$procs'" >&2
  exit 2
fi

burners=()
cleanup() {
  if ((${#burners[@]})); then
    kill "${burners[@]}" 2>/dev/null || true
    wait "${burners[@]}" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

parent=$$
for ((i = 0; i < procs; i++)); do
  # Pure CPU, no memory, no I/O; checks every ~0.1 s of work that this script still lives.
  ( while kill -0 "$parent" 2>/dev/null; do for ((j = 0; j < 20000; j++)); do :; done; done ) &
  burners+=("$!")
done
echo "stress: $procs CPU-bound processes beside the suite (${burners[*]:-none}) on $(nproc) cores" >&2

start=$(date +%s%N)
set +e
scripts/test.sh "$@"
rc=$?
set -e
end=$(date +%s%N)
elapsed=$(awk -v ns="$((end - start))" 'BEGIN { printf "%.1f", ns / 1e9 }')
echo "stress: suite exit status $rc after ${elapsed} s with $procs CPU-bound processes beside it" >&2
exit "$rc"
