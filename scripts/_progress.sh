# Sourced by the set-up scripts: `step WHAT` prints one progress line on
# stderr, "[kvpool   42s] WHAT", timed from the first script of the run
# (KVPOOL_T0 is exported, so nested scripts share one clock). stderr, so that
# `scripts/demo.sh --json` keeps stdout for the JSON.
export KVPOOL_T0="${KVPOOL_T0:-$(date +%s)}"
step() {
  printf '[kvpool %4ds] %s\n' "$(($(date +%s) - KVPOOL_T0))" "$*" >&2
}
