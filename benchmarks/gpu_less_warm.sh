#!/usr/bin/env bash
# On a GPU machine with its GPUs hidden (CUDA_VISIBLE_DEVICES=""), as on a GPU-less host with torch
# built for CUDA: the demo's first stage and its evaluation through Snakemake with warm starts on, to
# show whether each job ran warm and whether any said "Cannot re-initialize CUDA in forked
# subprocess" (a warm process that started CUDA before forking it). Run from a tree of the code to
# try (this checkout by default). Writes to $1:
#   gpu_less_warm.txt   each job's first lines, the count of warm jobs and of CUDA re-initialization errors
set -uo pipefail
out=$(realpath -m "${1:?an output directory}")
tree=$(realpath "${2:-.}")
mkdir -p "$out"
work=$(mktemp -d)
(cd "$tree" && cp -r Snakefile workflow config scripts profiles vlft pyproject.toml "$work")
cd "$work"
export PYTHONPATH="$work:${PYTHONPATH:-}" CUDA_VISIBLE_DEVICES="" VLFT_WARM_START=1
timeout 480 python -m snakemake results/eval/exp1/main/val/metrics.json --cores 8 > snakemake.log 2>&1
status=$?
{
    echo "snakemake exit status: $status ($tree)"
    for log in results/logs/*/*.log results/logs/*/*/*.log results/logs/*/*/*/*.log; do
        [ -f "$log" ] || continue
        case $log in *.attempts.log) continue ;; esac
        echo "$log: $(head -2 "$log" | tr '\n' ' ')"
    done
    echo "jobs run by a warm process: $(grep -l 'run by a warm process' -r results/logs | wc -l)"
    echo "jobs that said 'Cannot re-initialize CUDA': $(grep -l 'Cannot re-initialize CUDA' -r results/logs snakemake.log | wc -l)"
    tail -5 snakemake.log
} > "$out/gpu_less_warm.txt"
tail -4 "$out/gpu_less_warm.txt"
