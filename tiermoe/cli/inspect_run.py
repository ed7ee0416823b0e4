"""tiermoe inspect's run: a checkpoint's summary from its headers, or the architectures page."""

from __future__ import annotations

import json

from tiermoe.bundled import resolve_model
from tiermoe.model.catalogue import catalogue_markdown
from tiermoe.model.inspect import format_summary, summarize


def run(args) -> int:
    if args.architectures:
        print(catalogue_markdown(), end="")
        return 0
    summary = summarize(resolve_model(args.model_dir))
    print(json.dumps(summary.as_dict(), indent=2) if args.json else format_summary(summary))
    return 0
