"""Tests of a stage's training: the loop, methods, checkpoints, data parallelism (vlft.training)."""
