"""The main job: `python -m benchmarks` runs the serving-trace benchmark (GPU, or the CPU
simulation on a machine without one) and writes its table, JSON and plot to
benchmarks/results/."""

from .serving import main

main()
