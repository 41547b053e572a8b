#!/usr/bin/env bash
# One benchmark run twice on one GPU, back to back: at an earlier commit's code and at this checkout's,
# so that a refactor can be shown to change no speed. The earlier code is a tree of that commit
# (`git archive <commit> vlft benchmarks workflow config | tar -x -C <dir>`); each side runs its own
# copy of the benchmark script, so the two may differ in their imports.
#   benchmarks/before_after.sh <before dir> <out dir> <script> [its arguments...]
# e.g. benchmarks/before_after.sh /tmp/before $OUT train_speed.py --arch qwen3-vl-8b --skip reference ...
# Each run's output goes to <out dir>/<n>-<side>.log and its result JSON under <out dir>/<n>-<side>/.
# SIDES="after before after before" runs them in that order (default: before after), to see the noise.
set -uo pipefail
before=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); script=$3; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
n=0
for side in ${SIDES:-before after}; do
    n=$((n + 1)); run="$n-$side"
    tree=$here; [ "$side" = before ] && tree=$before
    mkdir -p "$out/$run"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 "benchmarks/$script" "$@" --out "$out/$run" > "$out/$run.log" 2>&1)
    echo "$run: exit $?"
    tail -n 5 "$out/$run.log"
done
