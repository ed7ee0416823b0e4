"""One architecture of the zoo (tiermoe.arch.zoo) against transformers: tiny random weights, three placements, the
engine's batched greedy decoding, and the layout of a release's checkpoint.

The model is transformers' own, built from the architecture's default config shrunk by tiermoe.testing.tiny_configs
and saved in transformers' module layout (`save_original_format=False`: the names discovery reads). The reference
is that same model: its greedy continuation of each prompt (a full forward per token, no cache; the last forward's
rows are the rows every check compares with). tiermoe loads the checkpoint once; each placement (all experts on
the CPU tier, half, all on the GPU tier, whose device is the CPU here) is applied by moving experts, and each
prompt goes through the hybrid model in one forward: max |a - b| / max |b| over the continuation's rows, and
whether each row's argmax is the reference's (its row's: same tokens in). Then the engine, at the half placement:
the prompts together (chunked prefill, decode rows beside chunks) and each alone must give the reference's
tokens, and the pool's bytes per token and per sequence must be what `tiermoe fit` counts; an engine that
refuses the model (an attention or state kind its pool lacks) is recorded with its one-line error instead. Last,
the same weights as transformers writes a release's checkpoint (per-expert tensors under the release's names,
through its conversion mapping), loaded at the half placement, for one prompt.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tiermoe.arch import detect, load_config
from tiermoe.engine.engine import Engine, EngineConfig
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.placement.kv_layout import kv_layout
from tiermoe.testing.tiny_configs import tiny_config

PROMPT_LENGTHS = (1, 6, 11, 3)  # mixed: a one-token prompt, and one past the tiny sliding window (8)
NEW_TOKENS = 3
PLACEMENTS = ("all_cpu", "half", "all_gpu")
INIT_RANGE = 0.1  # larger than the usual 0.02, so the routed experts move the logits visibly (as tests/conftest's)


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (7 * i + 11 * salt) % 240 for i in range(n)]


@dataclass
class ZooResult:
    model_type: str
    worst_rel_err: dict[str, float] = field(default_factory=dict)  # placement -> over every continuation row
    tokens_equal: dict[str, bool] = field(default_factory=dict)  # placement -> every row's argmax is the reference's
    batched_equals_alone: bool | None = None
    batched_equals_reference: bool | None = None
    engine_refused: str | None = None  # the engine's one-line error, when it refuses the model
    kv_counted: bool | None = None  # tiermoe.placement.kv_layout's bytes are what the engine's pool holds
    engine_error: str | None = None  # the first error a sequence ended with (a step that failed inside the engine)
    released_rel_err: float | None = None  # the released layout's checkpoint, half placement
    released_error: str | None = None  # why tiermoe could not load the released layout

    @property
    def placements_pass(self) -> bool:
        return all(e <= 1e-5 for e in self.worst_rel_err.values()) and all(self.tokens_equal.values())


def write_tiny(model_type: str, out: Path, seed: int = 0, released: Path | None = None) -> torch.nn.Module:
    """Save a tiny random `model_type` to `out` in transformers' module layout (and to `released` in the layout of
    its released checkpoints, as transformers writes them back); returns the (fp32) model."""
    torch.manual_seed(seed)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, initializer_range=INIT_RANGE),
                                                 dtype=torch.float32).eval()
        with torch.no_grad():  # weights a family starts at zero (routers, expert biases) are drawn too: tested
            for param in model.parameters():
                if param.is_floating_point() and not param.any():
                    param.normal_(0, INIT_RANGE)
        model.save_pretrained(out, save_original_format=False)
        if released is not None:
            model.save_pretrained(released)
    return model


def reference_rows(model: torch.nn.Module, ids: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """(greedy continuation of `ids` by `new` tokens, the logits rows [new, V] that chose them)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(new):  # the last forward is over the prompt and all but the last token: its rows are the rows
            logits = model(torch.tensor([tokens])).logits[0]
            tokens.append(int(logits[-1].argmax()))
    return tokens[len(ids):], logits[len(ids) - 1:].float()


def placement_mask(kind: str, spec) -> torch.Tensor:
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    if kind == "all_gpu":
        mask[:] = True
    elif kind == "half":
        mask = torch.rand(spec.num_layers, spec.num_experts, generator=torch.Generator().manual_seed(3)) < 0.5
    return mask


def check_architecture(model_type: str, out: Path) -> ZooResult:
    """Every check of the module docstring for `model_type`, its checkpoint written under `out`."""
    released = out / "released"
    reference = write_tiny(model_type, out / "modules", released=released)
    prompts = [prompt(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    expected = [reference_rows(reference, p, NEW_TOKENS) for p in prompts]
    result = ZooResult(model_type)
    with load_hybrid_model(out / "modules", None, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        for kind in PLACEMENTS:
            hybrid.apply_mask(placement_mask(kind, hybrid.spec))
            result.worst_rel_err[kind], result.tokens_equal[kind] = _against(hybrid, prompts, expected)
        hybrid.apply_mask(placement_mask("half", hybrid.spec))
        _check_engine(hybrid, prompts, [tokens for tokens, _ in expected], result)
    mask = placement_mask("half", detect(load_config(released)))
    try:
        with load_hybrid_model(released, mask, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
            result.released_rel_err = _against(hybrid, prompts[-1:], expected[-1:])[0]
    except TiermoeError as err:
        result.released_error = str(err)
    return result


def _against(hybrid, prompts: list[list[int]], expected) -> tuple[float, bool]:
    """(max rel err over every continuation row, whether each row's argmax is the reference's) of one forward per
    prompt through `hybrid`."""
    worst, equal = 0.0, True
    for ids, (tokens, rows) in zip(prompts, expected):
        got = hybrid(input_ids=torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].float()
        worst = max(worst, float((got - rows).abs().max() / rows.abs().max()))
        # the reference's argmax over the same tokens (a sparse indexer's choice of keys makes transformers' own
        # rows depend on the forward's length, so its one-token-at-a-time greedy is not the reference)
        equal &= got.argmax(-1).tolist() == rows.argmax(-1).tolist()
    return worst, equal


def _check_engine(hybrid, prompts: list[list[int]], expected: list[list[int]], result: ZooResult) -> None:
    config = EngineConfig(max_running=len(prompts), prefill_chunk=4, max_total_tokens=256, page_size=4,
                          prefix_cache=False)
    try:
        engine = Engine(hybrid, (), None, config)
    except TiermoeError as err:
        result.engine_refused = str(err)
        return
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        together = [engine.add(p, greedy) for p in prompts]
        engine.run_to_completion()
        alone = []
        for p in prompts:
            alone.append(engine.add(p, greedy))
            engine.run_to_completion()
        result.kv_counted = pool_bytes(engine.pool) == counted_bytes(kv_layout(hybrid.model.config, 4))
    finally:
        engine.close()
    result.engine_error = next((s.error for s in together + alone if s.finish_reason == "error"), None)
    batched = [s.output_ids for s in together]
    result.batched_equals_alone = batched == [s.output_ids for s in alone]
    result.batched_equals_reference = batched == expected


def pool_bytes(pool) -> tuple[int, int, int]:
    """(bytes per token of the full-attention pages, of the sliding-window pages, linear-attention state bytes per
    sequence) the engine's KV pool holds, every layer reserved."""
    pages = pool.pages
    full = pages.bytes_per_token(None) if None in pages.num_pages else 0
    sliding = sum(pages.bytes_per_token(w) for w in pages.num_pages if w is not None)
    linear = pool.linear.nbytes() // pool.linear.num_slots if pool.linear is not None else 0
    return full, sliding, linear


def counted_bytes(layout) -> tuple[int, int, int]:
    """The same three as `tiermoe fit` and the planner count them (tiermoe.placement.kv_layout)."""
    return layout.full_per_token, layout.sliding_per_token, layout.linear_state
