"""Every LoraConfig field on a hybrid model (fp32, experts on both tiers): honoured for attention, dense and
routed-expert LoRA alike, or refused in one line naming it, by the library's apply_lora as by the CLI.

Honoured: the adapted model's logits equal those of PEFT's model of the unmodified transformers model that loads the
adapter tiermoe saved (1e-5), and those of tiermoe again loading it; the layers whose experts get LoRA are the ones
the config names. Refused: apply_lora raises a TiermoeError of one line that names the field. The table of fields
covers every field of the installed PEFT's LoraConfig.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import load_reference, make_mask, rel_err
from training_reference import one_torch_thread  # noqa: F401 (an autouse fixture)

from tiermoe.arch import detect, load_config
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.adapter_io import expert_loras, load_adapter, save_adapter
from tiermoe.training.lora import apply_lora
from tiermoe.training.lora_fields import FIELDS, check_lora_config

peft = pytest.importorskip("peft")

TOL = 1e-5
V4 = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]  # a common config, written for transformers 4
EXPERTS_2 = ["model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"]

# case: (LoraConfig fields, the MoE layers whose routed experts get LoRA); the tiny qwen3_moe has MoE layers 0, 2
HONOURED = {
    "v4_names": (dict(target_modules=V4), [0, 2]),
    "all_linear_rslora": (dict(target_modules="all-linear", use_rslora=True), [0, 2]),
    "layers_to_transform": (dict(target_modules=[*V4, "gate"], layers_to_transform=[2]), [2]),
    "layers_pattern": (dict(target_modules=V4, layers_to_transform=[0], layers_pattern="layers"), [0]),
    "exclude_modules": (dict(target_modules="all-linear", exclude_modules=["model.layers.0.mlp.experts",
                                                                            "model.layers.2.self_attn.q_proj"]), [2]),
    "exclude_regex": (dict(target_modules=V4, exclude_modules=r".*\.0\.mlp\.experts"), [2]),
    "rank_alpha_patterns": (dict(target_modules=V4, rank_pattern={"model.layers.2.mlp.experts.down_proj": 3,
                                                                  "q_proj": 2},
                                 alpha_pattern={"model.layers.0.mlp.experts.gate_up_proj": 5}), [0, 2]),
    "experts_by_name": (dict(target_modules=["o_proj"], target_parameters=EXPERTS_2), [2]),
    "experts_only": (dict(target_modules=None, target_parameters=["gate_up_proj", "down_proj"],
                          layers_to_transform=[0]), [0]),
    "dropout_on_modules": (dict(target_modules=["q_proj", "v_proj"], lora_dropout=0.1), []),
    "task_and_bias_none": (dict(target_modules=V4, task_type="CAUSAL_LM", bias="none"), [0, 2]),
}

# case: (LoraConfig fields, the field the one-line refusal names)
REFUSED = {
    "dropout_with_expert_lora": (dict(target_modules=V4, lora_dropout=0.05), "lora_dropout"),
    "dropout_all_linear": (dict(target_modules="all-linear", lora_dropout=0.05), "lora_dropout"),
    "dora": (dict(target_modules=V4, use_dora=True), "use_dora"),
    "lora_bias": (dict(target_modules=V4, lora_bias=True), "lora_bias"),
    "bias_all": (dict(target_modules=V4, bias="all"), "bias"),
    "modules_to_save": (dict(target_modules=V4, modules_to_save=["lm_head"]), "modules_to_save"),
    "fan_in_fan_out": (dict(target_modules=V4, fan_in_fan_out=True), "fan_in_fan_out"),
    "pissa": (dict(target_modules=V4, init_lora_weights="pissa"), "init_lora_weights"),
    "olora": (dict(target_modules=["q_proj"], init_lora_weights="olora"), "init_lora_weights"),
    "trainable_tokens": (dict(target_modules=V4, trainable_token_indices=[5]), "trainable_token_indices"),
    "layer_replication": (dict(target_modules=V4, layer_replication=[[0, 2]]), "layer_replication"),
    "alora": (dict(target_modules=V4, task_type="CAUSAL_LM", alora_invocation_tokens=[5]), "alora_invocation_tokens"),
    "qalora": (dict(target_modules=V4, use_qalora=True), "use_qalora"),
    "megatron": (dict(target_modules=V4, megatron_config={"num_layers": 1}), "megatron_config"),
}
SUBCONFIGS = ("velora_config", "monteclora_config", "use_bdlora", "arrow_config", "kasa_config")


def _ids() -> torch.Tensor:
    return torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(4))


def _hybrid(path):
    mask = make_mask("random_half", detect(load_config(path)))
    return load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False, trainable=True)


def _randomise(model) -> None:
    """Every adapter factor random (B too), so each one shows in the logits."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _adapted_attention_layers(model) -> set[int]:
    return {int(n.split("layers.")[1].split(".")[0]) for n, _ in model.named_parameters()
            if ".self_attn." in n and "lora_A" in n}


@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_fields_give_peft_the_same_adapter_both_ways(tiny_dir, tmp_path, case):
    from peft import LoraConfig, PeftModel

    fields, expert_layers = HONOURED[case]
    path, ids = tiny_dir("qwen3_moe"), _ids()
    with _hybrid(path) as hybrid:
        model = apply_lora(hybrid, LoraConfig(r=4, lora_alpha=8, **fields))
        assert sorted(expert_loras(model)) == expert_layers
        if case == "layers_to_transform":
            assert _adapted_attention_layers(model) == {2}
        _randomise(model)
        model.eval()
        with torch.no_grad():
            ours = model(input_ids=ids).logits
        save_adapter(model, tmp_path / "a")
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(load_reference(path), tmp_path / "a")(input_ids=ids).logits
    assert rel_err(theirs, ours) <= TOL
    with _hybrid(path) as hybrid:
        again = load_adapter(hybrid, tmp_path / "a")
        assert sorted(expert_loras(again)) == expert_layers
        with torch.no_grad():
            assert rel_err(again(input_ids=ids).logits, ours) <= TOL


# adapters PEFT trained on transformers: (LoraConfig fields, the MoE layers PEFT put expert LoRA on); PEFT applies
# target_parameters to every layer whatever layers_to_transform says, and the adapter is loaded as PEFT laid it out
FROM_PEFT = {
    "layers_to_transform": (dict(target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"],
                                 layers_to_transform=[2]), [0, 2]),
    "experts_by_name_own_ranks": (dict(target_modules=["v_proj"], target_parameters=EXPERTS_2,
                                       rank_pattern={"down_proj": 2}, alpha_pattern={"gate_up_proj": 3}), [2]),
    "v4_names_rslora": (dict(target_modules=V4, use_rslora=True), [0, 2]),
}


@pytest.mark.parametrize("case", sorted(FROM_PEFT))
def test_adapters_peft_saved_load_where_peft_put_them(tiny_dir, tmp_path, case):
    from peft import LoraConfig, get_peft_model

    fields, expert_layers = FROM_PEFT[case]
    path, ids = tiny_dir("qwen3_moe"), _ids()
    torch.manual_seed(0)
    ref = get_peft_model(load_reference(path), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **fields))
    ref.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        theirs = ref.eval()(input_ids=ids).logits
    with _hybrid(path) as hybrid:
        model = load_adapter(hybrid, tmp_path / "a")
        assert sorted(expert_loras(model)) == expert_layers
        with torch.no_grad():
            assert rel_err(model(input_ids=ids).logits, theirs) <= TOL


def test_per_layer_ranks_and_alphas_reach_the_expert_lora(tiny_dir):
    from peft import LoraConfig

    fields, _ = HONOURED["rank_alpha_patterns"]
    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        experts = expert_loras(apply_lora(hybrid, LoraConfig(r=4, lora_alpha=8, **fields)))
        assert experts[0].ranks == (8, 4) and experts[2].ranks == (8, 3)  # PEFT doubles the fused gate_up's rank
        assert experts[0].alphas == (5.0, 8.0) and experts[2].alphas == (16.0, 8.0)


@pytest.mark.parametrize("init, b_zero", [(True, True), (False, False), ("gaussian", True)])
def test_expert_lora_is_initialised_as_peft_initialises_its_parameter_wrappers(tiny_dir, init, b_zero):
    from peft import LoraConfig

    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        lora = expert_loras(apply_lora(hybrid, LoraConfig(r=4, lora_alpha=8, target_modules=V4,
                                                          init_lora_weights=init)))[0]
        assert bool((lora.down_B == 0).all()) == b_zero
        a = lora.down_A
        if init == "gaussian":  # normal, std 1 / r
            assert abs(a.std().item() - 1 / 4) < 0.05 and a.abs().max() > 1 / a.shape[-1] ** 0.5
        else:  # nn.Linear's Kaiming-uniform: |a| <= 1 / sqrt(fan_in)
            assert a.abs().max() <= 1 / a.shape[-1] ** 0.5
        if not b_zero:  # nn.Linear(r * E, out)'s default
            E, _, r = lora.down_B.shape
            assert lora.down_B.abs().max() <= 1 / (r * E) ** 0.5


def test_inference_mode_freezes_expert_lora_too(tiny_dir):
    from peft import LoraConfig

    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        model = apply_lora(hybrid, LoraConfig(target_modules=V4, inference_mode=True))
        assert expert_loras(model) and not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_fields_tiermoe_cannot_honour_are_refused_in_one_line_naming_them(tiny_dir, case):
    from peft import LoraConfig

    fields, field = REFUSED[case]
    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        with pytest.raises(TiermoeError) as err:
            apply_lora(hybrid, LoraConfig(r=4, lora_alpha=8, **fields))
        assert f"{field}=" in str(err.value) and "\n" not in str(err.value)
        assert not expert_loras(hybrid.model)  # nothing was added before the refusal


@pytest.mark.parametrize("field", SUBCONFIGS)
def test_lora_variants_given_as_sub_configs_are_refused(field):
    from peft import LoraConfig

    config = LoraConfig(target_modules=V4)
    setattr(config, field, object())  # any value but None asks for the variant
    with pytest.raises(TiermoeError, match=f"{field}="):
        check_lora_config(config, adapts_parameters=True)


def test_one_projection_of_the_experts_alone_is_refused(tiny_dir):
    from peft import LoraConfig

    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        with pytest.raises(TiermoeError, match="alone"):
            apply_lora(hybrid, LoraConfig(target_modules=None, target_parameters=["mlp.experts.down_proj"]))


def test_the_table_names_every_field_of_the_installed_lora_config():
    from peft import LoraConfig

    assert {f.name for f in dataclasses.fields(LoraConfig)} <= set(FIELDS)


def test_a_field_the_table_does_not_know_is_refused_unless_left_at_its_default():
    from peft import LoraConfig

    @dataclasses.dataclass
    class NewerLoraConfig(LoraConfig):
        new_option: int = 0

    check_lora_config(NewerLoraConfig(target_modules=V4), adapts_parameters=True)
    with pytest.raises(TiermoeError, match="new_option=3"):
        check_lora_config(NewerLoraConfig(target_modules=V4, new_option=3), adapts_parameters=True)
