#!/usr/bin/env bash
# `make test`'s two tiers, side by side: the slow tier (stacks, real model; mostly waiting on the processes it
# starts) starts at once in the background, its output kept in a file; the fast tier (unit, contract, policy) runs
# in the foreground and prints as it goes. A fast-tier failure stops the slow tier at once and fails the run (so
# a broken build still fails in about a minute and a half); otherwise the slow tier's output follows, and its
# result is the run's. The slow tier waits on the processes it starts more than it computes (1.65 of 2 cores busy):
# the fast tier's CPU fills what it leaves idle.
#
# usage: tools/test_tiers.sh PYTEST FAST_WORKERS SLOW_WORKERS [pytest args...]
set -uo pipefail
pytest=$1 fast_workers=$2 slow_workers=$3
shift 3
slow_log=$(mktemp)
# Its own session (process group), so that stopping it stops its workers and every stack they started; niced, so
# that while both run the fast tier's timing-sensitive tests keep the CPU they need (beside an un-niced slow tier
# three of them failed: a supervisor's back-off, a warm start's time bound) and the slow tier takes what is left.
setsid nice -n 10 "$pytest" -q -rs -m slow --durations=10 -n "$slow_workers" --dist loadfile --no-loadscope-reorder "$@" \
    >"$slow_log" 2>&1 &
slow=$!
stop_slow() { kill -TERM -- "-$slow" 2>/dev/null; sleep 10; kill -KILL -- "-$slow" 2>/dev/null; }
trap 'stop_slow; rm -f "$slow_log"; exit 130' INT TERM

"$pytest" -q -rs -m "not slow" -n "$fast_workers" "$@"
fast=$?
if [ "$fast" -ne 0 ] && [ "$fast" -ne 5 ]; then  # 5: no test collected (the args selected the other tier only)
    echo "fast tier failed (exit $fast): the slow tier is stopped"
    stop_slow
    rm -f "$slow_log"
    exit "$fast"
fi
echo "--- slow tier (started beside the fast tier) ---"
tail -n +1 --pid="$slow" -f "$slow_log"
wait "$slow"
rc=$?
rm -f "$slow_log"
[ "$rc" -eq 5 ] && rc=0
exit "$rc"
