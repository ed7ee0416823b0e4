"""Every heap allocation of a child process, counted: tests/alloc_tracker.c built with the system C compiler and
preloaded into `python -m <module>` (LD_PRELOAD), so the counts include every thread and every library (torch's CPU
allocator, the kernel library's own scratch), which no in-process hook sees.

In the child, `Tracker()` opens the preloaded library; `with tracker.span(min_bytes) as span:` counts what runs inside:
`span.big` the allocations of at least min_bytes (their sizes, and the symbols of the frames that asked for them, as
`dladdr` names them), `span.peak` the most bytes held at once beyond what was held when the span began (frees of
older blocks count against it).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("alloc_tracker.c")
LIBRARY_ENV = "TIERMOE_TEST_ALLOC_TRACKER"  # the child finds the preloaded library's path here


def build_tracker(out_dir: Path) -> Path:
    """The preloadable library (skips the test where there is no C compiler or no glibc)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not sys.platform.startswith("linux"):
        pytest.skip("counting allocations needs a C compiler and glibc")
    lib = out_dir / "libtm_alloc_tracker.so"
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(lib)], check=False,
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"the allocation tracker does not build here: {done.stderr.strip()[:200]}")
    return lib


def run_tracked(lib: Path, module: str, *args: str, timeout: float = 300) -> dict:
    """Run `python -m module args...` from the tests directory with `lib` preloaded; its last stdout line is JSON."""
    here = Path(__file__).parent
    env = {**os.environ, "LD_PRELOAD": str(lib), LIBRARY_ENV: str(lib),
           "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", module, *args], check=False, cwd=here, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass
class Span:
    big: list[dict] = field(default_factory=list)  # {"bytes": n, "stack": [symbol, ...]}
    peak: int = 0


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def _symbol(dladdr, address: int) -> str:
    info = _DlInfo()
    if not address or not dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return "?"
    return (info.dli_sname or b"?").decode(errors="replace")


class Tracker:
    """The preloaded counter, seen from the child process."""

    def __init__(self):
        self.lib = ctypes.CDLL(os.environ[LIBRARY_ENV])
        self.lib.tm_track_start.argtypes = [ctypes.c_size_t]
        self.lib.tm_track_peak.restype = ctypes.c_long
        self.lib.tm_track_big_count.restype = ctypes.c_long
        self.lib.tm_track_big.restype = ctypes.c_size_t
        self.lib.tm_track_frame.restype = ctypes.c_void_p
        self.dladdr = ctypes.CDLL(None).dladdr
        self.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]

    @contextmanager
    def span(self, min_bytes: int):
        found = Span()
        self.lib.tm_track_start(min_bytes)
        try:
            yield found
        finally:
            self.lib.tm_track_stop()
            found.peak = self.lib.tm_track_peak()
            found.big = [{"bytes": self.lib.tm_track_big(i),
                          "stack": [_symbol(self.dladdr, self.lib.tm_track_frame(i, j)) for j in range(12)]}
                         for i in range(min(self.lib.tm_track_big_count(), 64))]
