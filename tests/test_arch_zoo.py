"""Every MoE causal LM of the installed transformers against transformers itself (tiermoe.testing.zoo_exactness).

The architectures are read from transformers (tiermoe.arch.zoo: its causal-LM mapping and modeling files), never
listed here; each default config is shrunk by rules on field names (tiermoe.testing.tiny_configs). For each: the
three placements give transformers' logits (rel err <= 1e-5) and argmax, and the engine's four mixed-length
sequences batched equal each alone and transformers' greedy tokens; and the same weights saved as transformers
writes a release's checkpoint load under the release's names (where transformers' conversion mapping only renames
and merges per-expert tensors). Where the engine serves the model, the KV bytes `tiermoe fit` counts are the pool's;
and `tiermoe inspect` and `tiermoe fit` read every architecture's config.json alone. The only exceptions are the
reviewed lists below, each checked to still hold (so a list that goes stale fails). Marked `zoo` (about 40 s of CPU
with one torch thread; at most 120 s on 2 cores), run in its own invocation (`pytest -m zoo`), beside the default
suite's 8-minute budget.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from transformers import AutoModelForCausalLM

from tiermoe.arch import SUPPORTED_MODEL_TYPES, detect
from tiermoe.arch.discover import discover
from tiermoe.arch.disk_names import released_names
from tiermoe.arch.zoo import moe_causal_lm_types
from tiermoe.layers.pool_kinds import pool_lacks
from tiermoe.model.catalogue import catalogue_markdown
from tiermoe.testing.tiny_configs import tiny_config
from tiermoe.testing.zoo_exactness import check_architecture

pytestmark = pytest.mark.zoo
ZOO = moe_causal_lm_types()
DOCS_PAGE = "docs/architectures.md"

# Reviewed: transformers itself cannot build or run the architecture's tiny config (its default config, shrunk).
TRANSFORMERS_CANNOT = {
    "lfm2_moe": "its default config leaves layer_types None, which its decoder layers index (at any size)",
    "qwen4_exp_text": "its indexer layers divide indexer_budget by indexer_compress_ratio, both None by default",
    "granitemoehybrid": "its default layer pattern is Mamba only, and its mask code asks the cache for an "
                        "attention layer (get_mask_sizes); its Mamba-2 state is also a kind the KV pool lacks",
}
# Reviewed: an attention or state kind the engine's KV pool lacks (each its own later issue). The engine refuses,
# naming it; every placement still matches transformers through transformers' own caches.
POOL_LACKS = {
    "axk2": "indexed_attention",
    "deepseek_v32": "indexed_attention",
    "dots3_note_text": "indexed_attention",
    "glm_moe_dsa": "indexed_attention",
    "hy_v4": "indexed_attention",
    "kolibri1_1": "indexed_attention",
    "deepseek_v4": "heavily_compressed_attention",
    "jamba": "linear_attention:JambaMambaMixer",
    "minimax": "linear_attention:MiniMaxLightningAttention",
    "inkling_text": "hybrid_sliding:InklingAttention",
    "inkling2_text": "hybrid_sliding:Inkling2SlidingAttention",
    "inkling2_loop_text": "hybrid_sliding:Inkling2LoopSlidingAttention",
    "zaya": "hybrid:ZayaAttention",
    "llama4_text": "chunked_attention",
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: torch's second OpenMP thread costs more than it computes, and many times more when other
    processes share the cores (measured: 0.2 s an architecture with one thread, up to 15 s with two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_zoo_is_read_from_transformers_and_every_reviewed_name_is_in_it():
    assert set(SUPPORTED_MODEL_TYPES) <= set(ZOO) and len(ZOO) >= 50
    for listed in (TRANSFORMERS_CANNOT, POOL_LACKS):
        assert set(listed) <= set(ZOO), set(listed) - set(ZOO)


@pytest.mark.parametrize("model_type", ZOO)
def test_every_moe_architecture_matches_transformers_at_every_placement_and_batched(model_type, tmp_path):
    if model_type in TRANSFORMERS_CANNOT:
        with pytest.raises((TypeError, ValueError)):  # still true: transformers' own build or forward fails
            model = AutoModelForCausalLM.from_config(tiny_config(model_type))
            model(torch.tensor([[3, 4, 5]]))
        return
    result = check_architecture(model_type, tmp_path)
    assert result.placements_pass, result
    if not released_names(model_type).computed:  # its releases' names are renames and per-expert merges only
        assert result.released_error is None and result.released_rel_err <= 1e-5, result
    if model_type in POOL_LACKS:
        assert result.engine_refused is not None and POOL_LACKS[model_type] in result.engine_refused, result
        assert "\n" not in result.engine_refused
    else:
        assert result.engine_refused is None and result.engine_error is None, result
        assert result.batched_equals_alone and result.batched_equals_reference, result
        assert result.kv_counted, result  # `tiermoe fit` counts what the pool holds


@pytest.mark.parametrize("model_type", ZOO)
def test_inspect_and_fit_read_every_architectures_config_json_alone(model_type, tmp_path):
    """Sizes from the modules (tiny ones: the same code reads a release's), no weights; a kind the engine's pool
    lacks is named in fit's KV line, not counted."""
    tiny_config(model_type).save_pretrained(tmp_path)
    shown = run_cli("inspect", str(tmp_path / "config.json"))
    fit = run_cli("fit", "--model", str(tmp_path), "--dtype", "bf16", "--gpu-memory-gb", "24", "--ram-gb", "64")
    if model_type in TRANSFORMERS_CANNOT and model_type != "granitemoehybrid":  # its skeleton builds; its run fails
        assert shown.returncode == fit.returncode == 2 and "transformers cannot build" in shown.stderr
        return
    assert shown.returncode == 0 and fit.returncode == 0, shown.stderr + fit.stderr
    spec = detect(tiny_config(model_type))
    assert f"{spec.num_experts} per MoE layer, top-{spec.top_k}" in shown.stdout
    assert f"{spec.num_moe_layers} MoE layers x {spec.num_experts} experts" in fit.stdout and "verdict  " in fit.stdout
    # the kinds fit leaves out are the ones the engine's pool refuses (tiermoe.layers.pool_kinds)
    lacking = {k.split("+")[0] for k in discover(tiny_config(model_type)).layer_kinds if pool_lacks(k)}
    uncounted = fit.stdout.partition("not counted: ")[2].partition(" (a kind")[0]
    assert set(filter(None, uncounted.split(", "))) == lacking, fit.stdout


def test_the_architectures_page_is_the_one_the_code_generates(request):
    page = request.config.rootpath / DOCS_PAGE
    assert page.read_text() == catalogue_markdown(), f"regenerate: tiermoe inspect --architectures > {DOCS_PAGE}"
