"""Offline tools: simulated runs, run files, backtests, baselines and evaluation.

Nothing here runs in a live pipeline; it judges recorded or simulated runs
with the same detectors, fusion and policy the workers use.
"""
