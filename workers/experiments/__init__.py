"""Experiments: grids of runs over modes, policies, scenarios and seeds, their reports
and plots. Drives the launching layer (real or virtual runs)."""
