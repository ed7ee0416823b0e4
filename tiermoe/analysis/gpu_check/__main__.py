"""`python -m tiermoe.analysis.gpu_check`: the GPU check's command line (main.py)."""

import sys

from tiermoe.analysis.gpu_check.main import main

sys.exit(main())
