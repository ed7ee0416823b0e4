"""`python -m tiermoe.analysis.gpu_check`: the GPU check's command line (main.py)."""

import sys

from tiermoe.analysis.gpu_check.main import main

# guarded: the environment check imports every tiermoe module, this one included, and must not start a run
if __name__ == "__main__":
    sys.exit(main())
