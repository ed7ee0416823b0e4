"""Shared fixtures: tiny random checkpoints of every supported architecture, saved with save_pretrained.

Weights use initializer_range 0.1 (instead of 0.02) so the routed experts move the logits by a visible amount:
a placement bug then shows up far above the fp32 tolerance.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU under Triton's interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiermoe.experts.python_arenas import keep_frame_chunks
from tiermoe.testing.presets import TINY, make_config

ARCHS = tuple(TINY)


def pytest_configure(config):
    # every test process (each pytest-xdist worker too) before any test: Triton's interpreter and the engine's
    # steps call deep enough that, at some stack depths, each call mapped and unmapped a frame-stack chunk (a
    # CPython 3.11 defect): the slowest tests took 3-5x as long in the suite as alone
    keep_frame_chunks()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one worker per core already: torch's own intra-op threads (one per core in every worker) only
        # oversubscribe the cores, and its OpenMP threads spin while they wait for one, so a test beside another
        # worker's ran 2-8x as long as alone (test_speculative_decode: 51 s against 11 s beside test_server_fuzz).
        # The tiny models gain nothing from them. The processes a test starts (ranks, servers, children that count
        # allocations) inherit one OpenMP thread too, through the environment, unless the test sets it
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def save_tiny(arch: str, out, seed: int = 0, sizes: dict | None = None, **save_kwargs):
    """A tiny checkpoint of `arch` (fp32; `sizes`: config values in place of the tiny ones)."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(arch, initializer_range=0.1, **(sizes or {}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, **save_kwargs)
    return out


def load_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(arch) -> path of a tiny checkpoint of that architecture (built once per session)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = save_tiny(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


MASKS = ("all_cpu", "all_gpu", "random_half", "single_gpu_expert")


def make_mask(kind: str, spec) -> torch.Tensor:
    """A placement [L, E] of one of the MASKS kinds (True = GPU tier)."""
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    if kind == "all_gpu":
        mask[:] = True
    elif kind == "random_half":
        mask = torch.rand(spec.num_layers, spec.num_experts, generator=torch.Generator().manual_seed(3)) < 0.5
    elif kind == "single_gpu_expert":
        mask[spec.moe_layers[0], 1] = True
    return mask


def logits_on_tier(path, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the checkpoint at `path` loaded with a MASKS placement (the GPU tier on the CPU device)."""
    from tiermoe.arch import detect, load_config
    from tiermoe.model.loader import load_hybrid_model

    mask = make_mask(kind, detect(load_config(path)))
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        return hybrid(input_ids=ids).logits


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: the issue's measure of exactness."""
    return ((a - ref).abs().max() / ref.abs().max()).item()


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def save_char_tokenizer(out) -> None:
    """A character-level tokenizer whose 256 ids cover a tiny model's whole vocabulary (ids 0-2 special)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(161, 256)] + [chr(c) for c in range(256, 319)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    assert len(vocab) == 256
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _captured(run) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `run()` with both streams captured: its return value, or its SystemExit's
    code as the interpreter would turn it into one (None: 0; a message: printed to stderr, 1)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run()
        except SystemExit as exit_:  # argparse: bad flags, --help; a script's sys.exit
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, int | None):
                print(exit_.code, file=sys.stderr)
    return code, out.getvalue(), err.getvalue()


def run_cli(*args: str):
    """Run `tiermoe ARGS` in this process (fast: no second interpreter); returns (returncode, stdout, stderr)."""
    from tiermoe.cli.main import main

    return subprocess.CompletedProcess(["tiermoe", *args], *_captured(lambda: main(list(args))))


def run_script(path, *args: str):
    """Run `python PATH ARGS` in this process (runpy as __main__, its folder first on sys.path): for tests whose
    point is what a script prints, not its process, this saves a second interpreter and its imports of torch and
    transformers. Returns a CompletedProcess, as run_cli does."""
    def script() -> int:
        runpy.run_path(str(path), run_name="__main__")
        return 0

    argv, path_before = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(path), *args], [str(Path(path).parent)]
    try:
        return subprocess.CompletedProcess([sys.executable, str(path), *args], *_captured(script))
    finally:
        sys.argv, sys.path[:] = argv, path_before
