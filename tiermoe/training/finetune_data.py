"""Which conversations a fine-tuning run trains on and which it measures itself on.

- The bundled demo model: `sharegpt` and `demo` both mean the demo's own training split (the ShareGPT and
  Chit-Chat conversations it was trained on: training on other ShareGPT conversations would put some of its
  held-out ones into training), a FILE means that file; the held-out set is always the demo's held-out split,
  the one its model card reports, so the before / after losses compare with the card's.
- Any other model: the dataset (`demo` is the demo's training split there too, with its held-out split), with a
  seeded slice of its conversations held out: whole conversation groups, about 5% of them and at most
  HELDOUT_MAX conversations, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiermoe.bundled import BUNDLED_MODEL_DIR
from tiermoe.data.chat_conversations import chat_conversations
from tiermoe.data.demo_split import demo_conversations, split_conversations
from tiermoe.errors import TiermoeError

HELDOUT_SHARE = 0.05
HELDOUT_MAX = 200
HELDOUT_SEED = 0  # the held-out slice does not move with --seed: runs with different seeds compare


@dataclass(frozen=True)
class FinetuneData:
    train: list[dict]
    heldout: list[dict]
    heldout_name: str  # what the held-out set is, in words


def is_demo_model(model_dir: str | Path) -> bool:
    return Path(model_dir).resolve() == BUNDLED_MODEL_DIR.resolve()


def finetune_data(model_dir: str | Path, dataset: str) -> FinetuneData:
    if is_demo_model(model_dir) or dataset == "demo":
        train = demo_conversations("train") if dataset in ("sharegpt", "demo") else chat_conversations(dataset)
        return FinetuneData(train, demo_conversations("heldout"), "the demo model's held-out split")
    conversations = chat_conversations(dataset)
    if len(conversations) < 2:
        raise TiermoeError(f"dataset '{dataset}' has {len(conversations)} conversation(s); fine-tuning holds one "
                           "out to measure itself on, so it needs at least 2")
    n_heldout = min(HELDOUT_MAX, max(1, round(HELDOUT_SHARE * len(conversations))))
    train, heldout = split_conversations(conversations, n_heldout, HELDOUT_SEED)
    if not train:
        raise TiermoeError(f"dataset '{dataset}': every conversation shares its group or first prompt with the "
                           "held-out ones; nothing is left to train on")
    return FinetuneData(train, heldout, f"{len(heldout)} held-out conversations of the dataset")
