"""Tests of records, importers, prompts, answers, clicks, rewards (vlft.data)."""
