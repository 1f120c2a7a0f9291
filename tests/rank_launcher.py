"""Runs one rank's worker script with a stack dump armed: `python rank_launcher.py SECONDS
WORKER ARGS...` runs WORKER as __main__ with ARGS, and if it is still running after SECONDS,
faulthandler writes every thread's stack to stderr (it keeps running). A rank the harness has
to kill then shows where it was: a hang names its wait, a slow rank its work."""

import faulthandler
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    after, worker = float(sys.argv[1]), sys.argv[2]
    faulthandler.dump_traceback_later(after, exit=False)
    sys.argv = [worker, *sys.argv[3:]]
    sys.path.insert(0, str(Path(worker).resolve().parent))  # as running the script directly would
    runpy.run_path(worker, run_name="__main__")
