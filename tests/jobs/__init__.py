"""Tests of a job's life: warm starts, GPUs, signals, SLURM (vlft.jobs)."""
