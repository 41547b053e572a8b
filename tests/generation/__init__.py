"""Tests of the generation engine, sampling, evaluation and predictions (vlft.generation)."""
