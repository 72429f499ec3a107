"""Benchmark helpers: baselines and timing utilities for cpindex."""
