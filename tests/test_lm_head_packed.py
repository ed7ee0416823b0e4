"""A big bf16 LM head of a CPU-only run is held packed and read by every core (tiermoe.layers.lm_head).

The threshold is lowered so a tiny model's head (2 MiB) counts as big; the default leaves it to torch. The packed
head holds the same bf16 values and accumulates in fp32 (torch's bf16 product rounds differently): its logits are
within a bf16 step of torch's and the greedy tokens are the same.
"""

from __future__ import annotations

import pytest
import torch
from test_lm_head import _large_vocab_checkpoint

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import load_kernels
from tiermoe.experts.threads import physical_cpus
from tiermoe.layers import lm_head
from tiermoe.layers.lm_head import RowsLMHead
from tiermoe.layers.quantized_linear import QuantizedLinear

needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="the CPU kernels are not built here")
PROMPTS = [[5, 9, 14, 3, 77], [300, 12]]


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


@needs_kernels
def test_a_big_untied_bf16_head_is_packed_on_every_core_and_gives_torchs_tokens(tmp_path, monkeypatch):
    path = _large_vocab_checkpoint("qwen3_moe", tmp_path / "untied")
    with LLM(path, progress=False) as llm:
        head = llm.hybrid.model.get_output_embeddings()
        assert type(head) is RowsLMHead  # 2 MiB: below the default threshold
        weight = head.weight.detach().clone()
        want = _greedy(llm)
    monkeypatch.setattr(lm_head, "WIDE_HEAD_MIN_BYTES", 1 << 20)
    with LLM(path, progress=False) as llm:
        head = llm.hybrid.model.get_output_embeddings()
        assert isinstance(head, QuantizedLinear) and head.fmt == "bf16"
        assert head.team().n == len(physical_cpus())  # --cpu-threads not given: every core
        x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
        exact = x.float() @ weight.float().T
        assert (head(x).float() - exact).abs().max() <= 2 ** -8 * exact.abs().max()
        assert _greedy(llm) == want


@needs_kernels
@pytest.mark.parametrize("tied, dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_a_tied_or_fp32_head_stays_in_torch(tied, dtype, tmp_path, monkeypatch):
    """Tied: a packed copy would hold the weight twice. fp32: packing in bf16 would change the logits."""
    monkeypatch.setattr(lm_head, "WIDE_HEAD_MIN_BYTES", 1 << 20)
    with LLM(_large_vocab_checkpoint("qwen3_moe", tmp_path / "m", tied), dtype=dtype, progress=False) as llm:
        assert type(llm.hybrid.model.get_output_embeddings()) is RowsLMHead
