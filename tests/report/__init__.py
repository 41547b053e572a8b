"""Tests of the report: its tables, charts, statistics and the page in a browser (vlft.report)."""
