# Shared set-up of the device check scripts (moe_check.sh, spec_check.sh, start_check.sh), sourced
# after they set NAME (the log's and work folder's name) and BUDGET (seconds for every step):
#   source "$(dirname "$0")/device_steps.sh" "$@"
# Installs the carried wheels (.whl/) into /tmp/site, exports PYTHONPATH and the run's variables,
# starts $OUT/$NAME.log with the commit, and defines `step NAME LIMIT_S CMD...`: skipped once the
# budget is spent, cut to what is left of it, its output in $W/NAME.log and its tail (STEP_TAIL
# lines, default 25) in the log. KEEP_WORK=1 keeps $W from an earlier call (a check split over two).
set -uo pipefail
OUT=${1:?usage: $NAME.sh OUT}; W=/tmp/$NAME
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$W"
mkdir -p "$OUT" "$W"
START=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "wheels failed to install"
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/$NAME.log"
# The device's copy of .git can be older than the tree it runs: the caller writes the tree's commit
# (`git log -1 --format='%H %s' >.device_commit`) and carries it; results record it (TOKENFORGE_COMMIT).
if [ -s .device_commit ]; then
  echo "commit $(cat .device_commit)" >"$LOG"; export TOKENFORGE_COMMIT=$(cut -d' ' -f1 .device_commit)
else
  git log -1 --format='commit %H %s' >"$LOG" 2>/dev/null || echo "commit unknown" >"$LOG"
fi
step() {   # name limit_s cmd...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 20 )); then echo "== $name skipped (budget spent)" | tee -a "$LOG"; return; fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$W/$name.log" 2>&1
  echo "== $name rc $? $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$LOG"
  grep -vE "it/s\]|INFO" "$W/$name.log" | tail -n "${STEP_TAIL:-25}" >>"$LOG"
}
