"""The main job: `python -m benchmarks` runs the decode benchmark (GPU, or the CPU
simulation on a machine without one) and writes its results to benchmarks/results/."""

from .decode import main

main()
