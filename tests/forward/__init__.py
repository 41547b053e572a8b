"""Tests of what the model computes on a batch: packing, image groups, prefix attention, the loss (vlft.forward)."""
