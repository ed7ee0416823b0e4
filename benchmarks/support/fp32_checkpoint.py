"""A checkpoint loaded in fp32: `tiermoe serve` has no --dtype and loads the dtype config.json names, so this is
a directory that links every file of the source but a config.json naming float32 (the loader casts the weights).
In fp32, batching changes a greedy token only on a near tie, so a request gives the same tokens alone and in a batch.
"""

from __future__ import annotations

import json
from pathlib import Path


def fp32_view(source: Path, parent: Path) -> Path:
    view = parent / f"{source.name}-fp32"
    view.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    (view / "config.json").write_text(json.dumps(config, indent=2))
    return view
