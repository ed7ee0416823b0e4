"""Keep the objects a server starts with out of Python's garbage collections.

CPython's cyclic collector stops every thread of the process while it runs (it holds the GIL), and a collection of
the oldest generation walks every object that generation holds. Once a model, its tokenizer and the web framework
are loaded that is some 400,000 objects (the shrunk Qwen3-30B-A3B checkpoint of benchmarks/soak_adversarial.py),
and under load such a collection came every 10-20 s and took 0.26-0.76 s, during which the engine thread made no
step and no token went out: the largest inter-token gaps the soak measured. `gc.freeze()` moves everything alive
into a permanent generation that collections skip, so they walk only what serving created since. vLLM
(`freeze_gc_heap`, after the server's start-up) and SGLang (`freeze_gc`) do the same.

Freezing keeps collecting what is created later (cycles made while serving are still reclaimed); what it gives up
is reclaiming start-up objects that become garbage later, which in a server live as long as the process anyway.
The collection before it keeps the garbage of loading from being frozen for good.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now (call once start-up is done, before traffic). Returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
