"""Tests of the pixel and vision caches, and damaged files found where read (vlft.caches, vlft.integrity)."""
