"""Regression benchmarks: matrices, the baseline-vs-memascend runner, comparison, golden files, planner."""
