"""Chat conversations as supervised fine-tuning examples: the chat template's tokens, loss on the replies only.

A conversation is rendered with the tokenizer's own chat template. Its labels are -100 (no loss) everywhere but on
the assistant turns: each reply's content and the end-of-turn token after it. Which tokens those are is found by
rendering growing prefixes of the conversation (the messages before reply i with the generation prompt, then the
messages up to and including it): the tokens between the two renderings are reply i. That works for any template,
without the `{% generation %}` markers TRL's assistant-only loss needs; the template must render a conversation's
prefixes as prefixes of it (a template that rewrites earlier turns is a one-line error). Within a reply's tokens,
what follows its last special token (ChatML's newline after <|im_end|>) belongs to the template, not the reply.

Examples are cut to `max_length` tokens (a conversation whose replies all lie past the cut is skipped); batches
are padded on the right (labels -100, attention mask 0). `SFTBatches` walks the conversations in a seeded order,
one permutation per epoch, and encodes only what the steps reach; its position is all a resumed run needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.errors import TiermoeError

IGNORE_INDEX = -100  # labels PyTorch's cross-entropy (and transformers) skip


@dataclass(frozen=True)
class ChatExample:
    input_ids: list[int]
    labels: list[int]  # the token at the same position, or IGNORE_INDEX

    @property
    def num_target_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


class ChatEncoder:
    """A tokenizer's chat template applied to conversations, with assistant-only labels, cut to max_length."""

    def __init__(self, tokenizer, max_length: int):
        if not getattr(tokenizer, "chat_template", None):
            raise TiermoeError("the model's tokenizer has no chat template; chat fine-tuning needs one")
        if max_length < 2:
            raise TiermoeError(f"max length must be at least 2 tokens, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def render_ids(self, messages: list[dict], generation_prompt: bool, name: str) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja raises its own errors, and templates raise on purpose (raise_exception)
            raise TiermoeError(f"conversation {name}: the chat template cannot render it: {err}") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, messages: list[dict], name: str = "?") -> ChatExample | None:
        """The example of one conversation; None when no reply token is left within max_length."""
        ids = self.render_ids(messages, False, name)
        labels = [IGNORE_INDEX] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render_ids(messages[:i], True, name) if i else []
            if len(before) >= self.max_length:
                break
            through = self.render_ids(messages[: i + 1], False, name)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise TiermoeError(f"conversation {name}: the chat template does not render the conversation's "
                                   "first turns as a prefix of it, so its replies' tokens cannot be found")
            start, end = len(before), len(through)
            last_special = max((p for p in range(start, end) if ids[p] in self.special_ids), default=None)
            if last_special is not None:
                end = last_special + 1
            labels[start:end] = ids[start:end]
        example = ChatExample(ids[: self.max_length], labels[: self.max_length])
        return example if example.num_target_tokens else None


def collate(examples: list[ChatExample], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels [B, T] padded on the right to the longest example."""
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        attention_mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pad_id_of(tokenizer) -> int:
    """The tokenizer's padding id (its end-of-sequence id when it has none; padding is masked anyway)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


class SFTBatches:
    """Batches of `batch_size` examples in a seeded order: epoch e visits the conversations in
    randperm(n, seed + e); conversations that encode to nothing are passed over. Encoded examples are kept for
    the life of this object (later epochs reuse them)."""

    def __init__(self, conversations: list[dict], encoder: ChatEncoder, batch_size: int, seed: int = 0):
        if not conversations:
            raise TiermoeError("no conversations to train on")
        if batch_size < 1:
            raise TiermoeError(f"batch size must be >= 1, got {batch_size}")
        self.conversations = conversations
        self.encoder = encoder
        self.batch_size = batch_size
        self.seed = seed
        self.position = 0  # conversations visited so far, over all epochs
        self.pad_id = pad_id_of(encoder.tokenizer)
        self._examples: dict[int, ChatExample | None] = {}
        self._order: tuple[int, list[int]] = (-1, [])

    def _index_at(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.conversations))
        if self._order[0] != epoch:
            order = torch.randperm(len(self.conversations), generator=torch.Generator().manual_seed(self.seed + epoch))
            self._order = (epoch, order.tolist())
        return self._order[1][offset]

    def example(self, index: int) -> ChatExample | None:
        if index not in self._examples:
            conv = self.conversations[index]
            self._examples[index] = self.encoder.encode(conv["messages"], conv.get("id", str(index)))
        return self._examples[index]

    def next_batch(self) -> dict[str, torch.Tensor]:
        examples: list[ChatExample] = []
        skipped_in_a_row = 0
        while len(examples) < self.batch_size:
            example = self.example(self._index_at(self.position))
            self.position += 1
            if example is None:
                skipped_in_a_row += 1
                if skipped_in_a_row > len(self.conversations):
                    raise TiermoeError(f"no conversation has a reply within the first {self.encoder.max_length} "
                                       "tokens (raise --max-length)")
                continue
            skipped_in_a_row = 0
            examples.append(example)
        return collate(examples, self.pad_id)

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "conversations": len(self.conversations)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "conversations"):
            if state.get(key) != mine[key]:
                raise TiermoeError(f"the checkpoint was made with {key} {state.get(key)}, this run has {mine[key]}: "
                                   "resume with the same dataset, --seed and --batch-size")
        self.position = int(state["position"])


def encode_all(conversations: list[dict], encoder: ChatEncoder) -> list[ChatExample]:
    """Every conversation that encodes to something (the held-out set, scored whole)."""
    examples = (encoder.encode(c["messages"], c.get("id", str(i))) for i, c in enumerate(conversations))
    return [e for e in examples if e is not None]
