#!/usr/bin/env bash
# Long reliability runs. OFF BY DEFAULT: scripts/test.sh (and so CI) runs only the fast part of
# the reliability suite (tests/reliability, a few minutes); this script is run by hand, as root,
# on a host with nothing else important running (the capacity cliff fills it with sandboxes).
#
#   bash scripts/reliability-long.sh [PART...]      PART: storm cliff leak crash noisy (default: all)
#
#   storm  bench/storm.py create storm, concurrency 1,2,5,10,25,50       (~2 min)
#   cliff  bench/storm.py capacity cliff, +CLIFF_STEP live per step until creates fail, a step
#          takes more than CONVERGE_S, CLIFF_MAX is reached or host memory runs low (~10-30 min)
#   leak   tests/reliability/test_leak.py with AGENTBOX_LEAK_CYCLES cycles (~1 s per cycle)
#   crash  tests/reliability/test_crash.py, CRASH_REPEAT times
#   noisy  tests/reliability/test_noisy_neighbour.py with NOISY_SAMPLES samples per condition
#
# Knobs (environment): AGENTBOX_LEAK_CYCLES=400 AGENTBOX_LEAK_SEED=<random> CLIFF_STEP=50
# CLIFF_MAX=2000 CLIFF_CONCURRENCY=10 CONVERGE_S=120 CRASH_REPEAT=5 NOISY_SAMPLES=2000.
# Long API fuzzing lives with the fuzz tests, not here.
#
# Output: bench/results/storm.json, bench/results/cliff.json and a log per part in
# bench/results/reliability-long-<part>.log; the exit status is non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(storm cliff leak crash noisy)
out=bench/results
mkdir -p "$out"
py=.venv/bin/python
failed=()

run() {  # run PART CMD...: tee the output to the part's log, remember failures
  local part=$1
  shift
  echo "=== $part: $*"
  local t0=$SECONDS
  if "$@" 2>&1 | tee "$out/reliability-long-$part.log"; then
    echo "=== $part: ok after $((SECONDS - t0)) s"
  else
    echo "=== $part: FAILED after $((SECONDS - t0)) s"
    failed+=("$part")
  fi
}

for part in "${parts[@]}"; do
  case "$part" in
    storm)
      run storm "$py" bench/storm.py --no-cliff --json "$out/storm.json" ;;
    cliff)
      run cliff "$py" bench/storm.py --no-storm --cliff-step "${CLIFF_STEP:-50}" \
        --cliff-max "${CLIFF_MAX:-2000}" --cliff-concurrency "${CLIFF_CONCURRENCY:-10}" \
        --converge-s "${CONVERGE_S:-120}" --json "$out/cliff.json" ;;
    leak)
      AGENTBOX_LEAK_CYCLES=${AGENTBOX_LEAK_CYCLES:-400} \
        run leak "$py" -m pytest -q -s -p no:cacheprovider -o timeout=0 \
        tests/reliability/test_leak.py ;;
    crash)
      for i in $(seq 1 "${CRASH_REPEAT:-5}"); do
        run "crash-$i" "$py" -m pytest -q -s -p no:cacheprovider tests/reliability/test_crash.py
      done ;;
    noisy)
      AGENTBOX_NOISY_SAMPLES=${NOISY_SAMPLES:-2000} \
        run noisy "$py" -m pytest -q -s -p no:cacheprovider -o timeout=0 \
        tests/reliability/test_noisy_neighbour.py ;;
    *)
      echo "unknown part $part (storm cliff leak crash noisy)" >&2
      exit 2 ;;
  esac
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all parts passed: ${parts[*]}"
