#!/usr/bin/env bash
# One benchmark run twice on one GPU, back to back: at an earlier commit's code and at this checkout's,
# so that a refactor can be shown to change no speed. The earlier code is a tree of that commit
# (`git archive <commit> vlft benchmarks workflow config | tar -x -C <dir>`); each side runs its own
# copy of the benchmark script, so the two may differ in their imports.
#   benchmarks/before_after.sh <before dir> <out dir> <script> [its arguments...]
# e.g. benchmarks/before_after.sh /tmp/before $OUT train_speed.py --arch qwen3-vl-8b --skip reference ...
# Each side's output goes to <out dir>/{before,after}.log and its result JSON under <out dir>/{before,after}/.
set -uo pipefail
before=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); script=$3; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
for side in before after; do
    tree=$here; [ "$side" = before ] && tree=$before
    mkdir -p "$out/$side"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 "benchmarks/$script" "$@" --out "$out/$side" > "$out/$side.log" 2>&1)
    echo "$side: exit $?"
    tail -n 5 "$out/$side.log"
done
