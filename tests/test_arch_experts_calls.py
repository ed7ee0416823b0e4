"""Experts modules outside transformers' experts interface (tiermoe.arch.spec.EXPERTS_CALLS): Ergo's, whose own
forward works around the interface's call (a learned norm per expert on each route), and Llama-4's, called with
every expert's copy of every token. Both compute on the two tiers, exactly, and record the block's own routing;
a module whose numbers are not what discovery reads is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.activations import SiLUActivation

from tiermoe.arch import detect
from tiermoe.arch.experts_form import experts_form
from tiermoe.errors import TiermoeError
from tiermoe.layers.trace_routing import TraceRouting, install_trace_routing
from tiermoe.model.hybrid_experts import HybridEveryExpert, HybridExperts
from tiermoe.model.loader import load_hybrid_model
from tiermoe.testing.tiny_configs import tiny_config
from tiermoe.testing.zoo_exactness import write_tiny

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])


class ListRecorder:
    """The routed ids [T, K] each MoE layer hands the recorder."""

    enabled = True

    def __init__(self):
        self.ids: list[tuple[int, torch.Tensor]] = []

    def record(self, layer: int, ids_TK: torch.Tensor, on_gpu_E: torch.Tensor) -> None:
        self.ids.append((layer, ids_TK.clone()))


def loaded(model_type: str, tmp_path):
    """(transformers' fp32 model, tiermoe's at half the experts on each tier)."""
    reference = write_tiny(model_type, tmp_path)
    spec = detect(tiny_config(model_type))
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[:, ::2] = True
    return reference, load_hybrid_model(tmp_path, mask, gpu_device="cpu", dtype=torch.float32, progress=False)


def test_ergo_keeps_its_own_experts_forward_and_norm_with_its_call_on_the_tiers(tmp_path):
    reference, hybrid_cm = loaded("ergo", tmp_path)
    routed = []
    for layer in reference.model.layers:  # the block's own routing, as transformers computes it
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, i, out: routed.append(out[2].clone()))
    with torch.no_grad():
        want = reference(IDS).logits
    with hybrid_cm as hybrid:
        experts = hybrid.model.model.layers[1].mlp.experts
        assert type(experts).__name__ == "HybridErgoExperts" and isinstance(experts.tiers, HybridExperts)
        assert hybrid.blocks[1] is experts.tiers and not experts.post_expert_norm.weight.is_meta
        assert "down_proj" not in experts._parameters  # the tiers hold the fused weights
        recorder = ListRecorder()
        for block in hybrid.blocks.values():
            block.recorder = recorder
        with torch.no_grad():
            got = hybrid(input_ids=IDS).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert [ids.shape for _, ids in recorder.ids] == [r.shape for r in routed]  # [T, K] once a layer, not [T*K, 1]
    assert all(torch.equal(ids.sort(-1).values, r.long().sort(-1).values) for (_, ids), r in zip(recorder.ids, routed))


def test_llama4_computes_only_the_picked_rows_of_its_every_expert_call(tmp_path):
    reference, hybrid_cm = loaded("llama4_text", tmp_path)
    picked = []
    for layer in reference.model.layers:
        layer.feed_forward.router.register_forward_hook(lambda m, i, out: picked.append(out[0] > 0))
    with torch.no_grad():
        want = reference(IDS).logits
    with hybrid_cm as hybrid:
        assert all(isinstance(b, HybridEveryExpert) for b in hybrid.blocks.values())
        recorder = ListRecorder()
        for block in hybrid.blocks.values():
            block.recorder = recorder
        with torch.no_grad():
            got = hybrid(input_ids=IDS).logits
        routing = TraceRouting(torch.zeros(1, 1, 1), torch.zeros(1), torch.zeros(1), [0])
        with pytest.raises(TiermoeError, match="experts call: every_expert"):
            install_trace_routing(hybrid, routing)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    for (_, ids_TK), picked_TE in zip(recorder.ids, picked):  # the router's top-1 of each token
        assert torch.equal(picked_TE.float().argmax(-1), ids_TK[:, 0])


class EveryExpertModule(nn.Module):
    """A Llama-4-shaped experts module: act(gate) * up as Llama-4's, or (swapped) act(up) * gate."""

    def __init__(self, swapped: bool):
        super().__init__()
        self.hidden_size, self.act_fn, self.swapped = 16, SiLUActivation(), swapped
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 2 * 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 16))

    def forward(self, hidden_states):
        x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        if self.swapped:
            gate, up = up, gate
        return torch.bmm(self.act_fn(gate) * up, self.down_proj).view(-1, self.hidden_size)


def test_an_every_expert_module_is_read_from_its_numbers_and_refused_in_one_line_when_they_differ():
    form = experts_form(EveryExpertModule(swapped=False).to("meta"), "toy")
    assert (form.call, form.activation, form.transposed, form.num_experts, form.hidden_size,
            form.intermediate_size) == ("every_expert", "silu_glu", True, 4, 16, 8)
    with pytest.raises(TiermoeError, match="checked on numbers") as err:
        experts_form(EveryExpertModule(swapped=True).to("meta"), "toy")
    assert "\n" not in str(err.value)


class OtherCallModule(nn.Module):
    """Fused-looking weights behind a call that is neither the interface's nor every expert's copy."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 16, 16))
        self.down_proj = nn.Parameter(torch.zeros(4, 8, 16))

    def forward(self, hidden_states, router_scores):
        return hidden_states


def test_an_experts_module_with_another_call_is_refused_in_one_line():
    with pytest.raises(TiermoeError, match="toy: its experts module OtherCallModule does not take the experts "
                                           "interface") as err:
        experts_form(OtherCallModule().to("meta"), "toy")
    assert "\n" not in str(err.value)
