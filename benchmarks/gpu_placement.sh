#!/usr/bin/env bash
# On a machine with two or more GPUs: the demo's training and evaluation jobs through Snakemake with
# `--resources gpu=2`, sampling once a second which process runs on which GPU (nvidia-smi), to show
# that concurrent GPU jobs get GPUs of their own (vlft.jobs.gpus). Writes to $1 (default: benchmarks/results):
#   gpu_placement.log    Snakemake's output (tail)
#   gpu_placement.txt    each GPU job's first log line, and the sampled (time, pid, GPU, script) rows
set -euo pipefail
out=$(realpath -m "${1:-benchmarks/results}")
mkdir -p "$out"
work=$(mktemp -d)
cp -r Snakefile workflow config scripts profiles vlft pyproject.toml "$work"
cd "$work"
export PYTHONPATH="$work:${PYTHONPATH:-}"
targets="results/eval/exp1/main/val/metrics.json results/eval/exp2/main/val/metrics.json results/eval/exp3/stage1/val/metrics.json"
python -m snakemake $targets --cores 16 --resources gpu=2 --set-threads train=4 evaluate=4 > snakemake.log 2>&1 &
driver=$!
: > samples.txt
while kill -0 $driver 2>/dev/null; do
    now=$(date +%H:%M:%S)
    nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader 2>/dev/null | while IFS=', ' read -r pid bus; do
        echo "$now pid=$pid gpu=$bus $(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -o 'scripts/[a-z_]*.py' || true)"
    done >> samples.txt
    sleep 1
done
wait $driver && status=0 || status=$?
tail -40 snakemake.log > "$out/gpu_placement.log"
{
    echo "snakemake exit status: $status"
    nvidia-smi --query-gpu=index,pci.bus_id,name --format=csv,noheader
    for log in results/logs/train/*/*.log results/logs/evaluate/*/*/*.log; do
        case $log in *.attempts.log) continue ;; esac
        echo "$log: $(head -1 "$log")"
    done
    echo "samples (time, pid, GPU bus, script):"
    sort -u samples.txt
} > "$out/gpu_placement.txt"
echo "GPU jobs seen on each GPU bus (samples):"
awk '/scripts\// {split($3, g, "="); n[g[2]]++} END {for (b in n) print "  " b ": " n[b]}' samples.txt
echo "seconds with GPU jobs on two different GPUs at once:"
grep scripts/ samples.txt | awk '{print $1, $3}' | sort -u | awk '{c[$1]++} END {n = 0; for (t in c) if (c[t] > 1) n++; print "  " n}'
exit $status
