"""Benchmarks: scripts that compare configurations side by side in one run and write
their results (with device, date and versions) to `benchmarks/results/`."""
