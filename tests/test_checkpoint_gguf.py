"""GGUF input: a tiny MoE written with the gguf package's writer (Q8_0 and Q4_K tensors) loads and matches the
reference built from the same dequantised values; unsupported GGUF architectures get one clear line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import logits_on_tier, rel_err, run_cli

from tiermoe.arch import detect, load_config
from tiermoe.errors import TiermoeError
from tiermoe.model.gguf_checkpoint import GGUFCheckpoint
from tiermoe.model.inspect import summarize
from tiermoe.model.loader import load_hybrid_model
from tiermoe.testing.presets import make_config

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# llama.cpp's qwen3moe has experts in every layer. Q4_K packs rows in super-blocks of 256 values, so every quantised row length is a multiple of 256.
SHAPE = dict(mlp_only_layers=[], hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_K block (the gguf package only dequantises it): per 256 values, fp16 d and dmin, eight
    6-bit sub-block scales and mins, 4-bit codes; value = d * sc * q - dmin * m. Rows [R, C] -> bytes [R, C/256*144]."""
    rows, cols = x.shape
    b = x.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(b.min(-1), 0)
    scale = (b.max(-1) - lo) / 15
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum((-lo).max(-1), 1e-12) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = (d16.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin16.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round((b + offset) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)  # [blocks, 8, 32]
    scales = np.empty((b.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(b.shape[0], 128)  # low nibble: even sub-block of each pair
    blocks = np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def test_our_q4_k_blocks_decode_with_the_gguf_package_to_within_4_bits():
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(x), Q.Q4_K)
    err = np.abs(back - x).max() / np.abs(x).max()
    assert 0 < err < 0.08  # 4-bit codes over each 32-value sub-block's range


def _add(writer, name: str, w: torch.Tensor, qtype) -> None:
    a = w.detach().to(torch.float32).numpy()
    if qtype == Q.F32:
        writer.add_tensor(name, a)
    elif qtype == Q.Q4_K:
        writer.add_tensor(name, quantize_q4_k(a.reshape(-1, a.shape[-1])).reshape(*a.shape[:-1], -1),
                          raw_dtype=Q.Q4_K)
    else:
        writer.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def add_byte_vocabulary(w) -> None:
    """A byte-level BPE vocabulary of 256 tokens in llama.cpp's metadata: the bytes, except that byte 0x7f's slot
    holds the merge "he" (so the merge list is not empty) and id 2 is the end-of-text control token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    tokens[0x7F] = "he"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i == 2 else 1 for i in range(256)])
    w.add_token_merges(["h e"])


def write_qwen3moe_gguf(path, arch: str = "qwen3moe", seed: int = 0, split_max_tensors: int = 0,
                        vocabulary: bool = False):
    """A tiny qwen3_moe model in a GGUF file: experts Q4_K, attention and embeddings Q8_0, norms and routers F32;
    `vocabulary` adds a tokenizer to its metadata."""
    from transformers import AutoModelForCausalLM

    cfg = make_config("qwen3_moe", initializer_range=0.1, **SHAPE)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = model.state_dict()
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if vocabulary:
        add_byte_vocabulary(w)
    _add(w, "token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    _add(w, "output.weight", sd["lm_head.weight"], Q.Q8_0)
    _add(w, "output_norm.weight", sd["model.norm.weight"], Q.F32)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            t = sd.get(f"model.layers.{i}.{hf}.weight")
            if t is not None:
                _add(w, f"blk.{i}.{gg}.weight", t, Q.F32 if t.dim() == 1 or hf == "mlp.gate" else Q.Q8_0)
        gate_up = sd.get(f"model.layers.{i}.mlp.experts.gate_up_proj")
        if gate_up is not None:
            inter = cfg.moe_intermediate_size
            _add(w, f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter], Q.Q4_K)
            _add(w, f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:], Q.Q4_K)
            _add(w, f"blk.{i}.ffn_down_exps.weight", sd[f"model.layers.{i}.mlp.experts.down_proj"], Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model.eval()


def _dequantised_reference(gguf_path, out):
    """The reference: the GGUF's own values, dequantised to fp32, in a plain transformers checkpoint."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = load_config(gguf_path)
    cfg.dtype = torch.float32
    out.mkdir()
    cfg.save_pretrained(out)
    ckpt = GGUFCheckpoint(gguf_path, cfg)
    save_file({name: ckpt.read(name).contiguous() for name in ckpt.entries}, str(out / "model.safetensors"))
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info  # every weight came from the GGUF
    return model.eval()


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny-q4_k.gguf"
    original = write_qwen3moe_gguf(path)
    ref = _dequantised_reference(path, root / "ref")
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return path, ids, ref(ids).logits, original(ids).logits


def test_gguf_metadata_gives_the_config(gguf_case):
    path, *_ = gguf_case
    cfg = load_config(path)
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.moe_intermediate_size == 256 and cfg.head_dim == 64 and cfg.norm_topk_prob
    assert cfg.mlp_only_layers == [] and detect(cfg).moe_layers == (0, 1, 2)  # from the router tensors present


@pytest.mark.parametrize("tier", ["all_cpu", "all_gpu", "random_half"])
def test_gguf_model_matches_its_dequantised_reference_on_every_tier(gguf_case, tier):
    path, ids, ref, _ = gguf_case
    assert rel_err(logits_on_tier(path, tier, ids), ref) < 1e-5  # converted at load in fp32: no error beyond the GGUF's own


def test_gguf_error_against_the_unquantised_model_is_the_formats_own(gguf_case):
    _, _, ref, original = gguf_case
    err = rel_err(ref, original)
    # Q8_0 attention (8 bits) and Q4_K experts (4.5 bits per weight; 0.18 measured here, through three layers of
    # top-2 routing that a changed weight can flip): the quantisation is the GGUF's, not tiermoe's
    assert 0 < err < 0.3, err


def test_gguf_experts_convert_to_int4_on_the_cpu_tier(gguf_case):
    from tiermoe.config import CPUConfig

    path, ids, ref, _ = gguf_case
    with load_hybrid_model(path, None, gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(expert_dtype="int4")) as hybrid:
        logits = hybrid(input_ids=ids).logits
        spec = hybrid.spec
        # gate_up at 0.55 bytes a parameter, down (a third) int6 at 0.81, and each row's scale
        assert hybrid.tier_bytes().cpu_experts < 0.7 * spec.total_routed_experts * spec.params_per_expert
    assert rel_err(logits, ref) < 0.3  # tiermoe's int4 on top of Q4_K: the error this conversion adds


def test_fit_reads_gguf_headers(gguf_case):
    from tiermoe.fit import model_bytes
    from tiermoe.model.plan_source import placement_target

    path, *_ = gguf_case
    m = model_bytes(path)
    cfg = load_config(path)
    h, v = cfg.hidden_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 2 * cfg.head_dim + 2 * h + cfg.num_experts * h
    assert m.non_expert == (2 * v * h + h + cfg.num_hidden_layers * per_layer) * 2  # bf16 after conversion
    assert m.gpu_bytes_per_expert == 3 * h * cfg.moe_intermediate_size * 2
    target = placement_target(path)  # the --gpu-memory-gb planner counts the same bytes, not the quantised file's
    assert (target.non_expert_bytes, target.bytes_per_expert) == (m.non_expert, m.gpu_bytes_per_expert)


def _write_meta_only(path, arch: str, **extra):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for key, value in extra.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_unsupported_gguf_architecture_gets_one_clear_line(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    _write_meta_only(path, arch)
    with pytest.raises(TiermoeError, match=f"GGUF architecture '{arch}'.*tiermoe reads GGUF MoE models of"):
        load_config(path)
    r = run_cli("inspect", str(path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"'{arch}'" in r.stderr


# ---- the other GGUF MoE families, written the way llama.cpp's converter writes them ----

def _permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows (rotary halves -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_generic_gguf(path, hf_arch: str, gguf_arch: str, meta: dict, seed: int = 0, split_kv_b: bool = False,
                       matrix_type=Q.Q8_0, **shape):
    """A tiny transformers model of `hf_arch` written as a `gguf_arch` GGUF: names from the gguf package's map,
    merged expert tensors, Q8_0 matrices (F32 for vectors and routers), `meta` as {arch}.key -> value."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(hf_arch, initializer_range=0.1, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    for key, value in meta.items():
        if isinstance(value, float):
            w.add_float32(f"{gguf_arch}.{key}", value)
        elif isinstance(value, bool):
            w.add_bool(f"{gguf_arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{gguf_arch}.{key}", value)
        else:
            w.add_uint32(f"{gguf_arch}.{key}", value)
    for name, t in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if base.endswith(".experts"):
            layer = base.split(".")[2]
            if leaf == "gate_up_proj":
                half = t.shape[1] // 2
                _add(w, f"blk.{layer}.ffn_gate_exps.weight", t[:, :half], matrix_type)
                _add(w, f"blk.{layer}.ffn_up_exps.weight", t[:, half:], matrix_type)
            else:
                _add(w, f"blk.{layer}.ffn_down_exps.weight", t, matrix_type)
            continue
        if leaf == "e_score_correction_bias":
            _add(w, f"blk.{base.split('.')[2]}.exp_probs_b.bias", t, Q.F32)
            continue
        if gguf_arch == "llama" and base.endswith("q_proj"):
            t = _permute_rows(t, cfg.num_attention_heads)
        elif gguf_arch == "llama" and base.endswith("k_proj"):
            t = _permute_rows(t, cfg.num_key_value_heads)
        if split_kv_b and base.endswith("kv_b_proj"):  # llama.cpp's newer DeepSeek layout
            per_head = t.view(cfg.num_attention_heads, -1, t.shape[1])
            blk = f"blk.{base.split('.')[2]}"
            _add(w, f"{blk}.attn_k_b.weight", per_head[:, :cfg.qk_nope_head_dim].transpose(1, 2), Q.F32)
            _add(w, f"{blk}.attn_v_b.weight", per_head[:, cfg.qk_nope_head_dim:], Q.F32)
            continue
        gg = name_map.get_name(base)
        assert gg is not None, name
        if t.dim() == 2 and t.shape[0] == 1:  # qwen2moe's shared_expert_gate: a vector in GGUF
            t = t[0]
        vector = t.dim() == 1 or base.endswith("mlp.gate") or t.shape[-1] % 32
        _add(w, f"{gg}.{leaf}", t, Q.F32 if vector else matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model.eval()


FAMILIES = {
    # Mixtral: a `llama` GGUF with experts; q/k rows permuted by the converter
    "mixtral": ("llama", dict(hidden_size=64, intermediate_size=64, num_local_experts=4),
                lambda c: {"block_count": c.num_hidden_layers, "embedding_length": c.hidden_size,
                           "feed_forward_length": c.intermediate_size, "attention.head_count": c.num_attention_heads,
                           "attention.head_count_kv": c.num_key_value_heads, "expert_count": c.num_local_experts,
                           "expert_used_count": c.num_experts_per_tok, "context_length": 256, "vocab_size": 256,
                           "rope.freq_base": float(c.rope_parameters["rope_theta"]),
                           "attention.layer_norm_rms_epsilon": c.rms_norm_eps}),
    # Qwen2-MoE: a gated shared expert, q/k/v biases
    "qwen2_moe": ("qwen2moe", dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64),
                  lambda c: {"block_count": c.num_hidden_layers, "embedding_length": c.hidden_size,
                             "feed_forward_length": c.intermediate_size,
                             "attention.head_count": c.num_attention_heads,
                             "attention.head_count_kv": c.num_key_value_heads, "expert_count": c.num_experts,
                             "expert_used_count": c.num_experts_per_tok,
                             "expert_feed_forward_length": c.moe_intermediate_size,
                             "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
                             "context_length": 256, "vocab_size": 256,
                             "rope.freq_base": float(c.rope_parameters["rope_theta"]),
                             "attention.layer_norm_rms_epsilon": c.rms_norm_eps}),
    # DeepSeek-V3: MLA, a dense first layer, sigmoid gating with a correction bias, groups, a shared expert
    "deepseek_v3": ("deepseek2", dict(hidden_size=64, moe_intermediate_size=32),
                    lambda c: {"block_count": c.num_hidden_layers, "embedding_length": c.hidden_size,
                               "feed_forward_length": c.intermediate_size,
                               "attention.head_count": c.num_attention_heads, "attention.head_count_kv": 1,
                               "attention.key_length_mla": c.qk_nope_head_dim + c.qk_rope_head_dim,
                               "attention.value_length_mla": c.v_head_dim,
                               "attention.key_length": c.kv_lora_rank + c.qk_rope_head_dim,
                               "attention.value_length": c.kv_lora_rank,
                               "attention.q_lora_rank": c.q_lora_rank, "attention.kv_lora_rank": c.kv_lora_rank,
                               "rope.dimension_count": c.qk_rope_head_dim, "expert_count": c.n_routed_experts,
                               "expert_used_count": c.num_experts_per_tok, "expert_shared_count": c.n_shared_experts,
                               "expert_feed_forward_length": c.moe_intermediate_size,
                               "leading_dense_block_count": c.first_k_dense_replace,
                               "expert_weights_scale": float(c.routed_scaling_factor), "expert_weights_norm": True,
                               "expert_gating_func": 2, "expert_group_count": c.n_group,
                               "expert_group_used_count": c.topk_group, "context_length": 256, "vocab_size": 256,
                               "rope.freq_base": float(c.rope_parameters["rope_theta"]),
                               "attention.layer_norm_rms_epsilon": c.rms_norm_eps}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_gguf_moe_families_load_exactly(tmp_path, family):
    gguf_arch, shape, meta = FAMILIES[family]
    cfg = make_config(family, **shape)
    path = tmp_path / f"{family}.gguf"
    # DeepSeek's sigmoid group routing of a tiny random model flips experts under 8-bit error, so its file is F32:
    # then the comparison with the original model is exact, a sharper check of the MLA and kv_b mapping.
    deepseek = family == "deepseek_v3"
    original = write_generic_gguf(path, family, gguf_arch, meta(cfg), split_kv_b=deepseek,
                                  matrix_type=Q.F32 if deepseek else Q.Q8_0, **shape)
    assert load_config(path).model_type == family
    ref = _dequantised_reference(path, tmp_path / "ref")
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    spec = detect(load_config(path))
    mask = torch.rand(spec.num_layers, spec.num_experts, generator=torch.Generator().manual_seed(1)) < 0.5
    with torch.no_grad():
        want = ref(ids).logits
        # the reading is right, not merely self-consistent: Q8_0 of the original model stays within 8-bit error
        # (a wrong q/k permutation or expert split would move the logits by their own size)
        assert rel_err(want, original(ids).logits) < (1e-5 if deepseek else 0.03)
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        assert rel_err(hybrid(input_ids=ids).logits, want) < 1e-5


def test_deepseek2_gguf_yarn_scaling_becomes_transformers_rope_parameters(tmp_path):
    """DeepSeek-V3 ships YaRN (factor 40 over 4096 positions); llama.cpp's converter stores it as rope.scaling.*
    with 0.1 x mscale_all_dim as yarn_log_multiplier. A prompt 3x the original context makes a wrong mapping show."""
    gguf_arch, shape, meta = FAMILIES["deepseek_v3"]
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)
    shape = dict(shape, rope_parameters=dict(make_config("deepseek_v3", **shape).rope_parameters, **yarn))
    scaling = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 16,
               "rope.scaling.yarn_log_multiplier": 0.1}
    path = tmp_path / "yarn.gguf"
    original = write_generic_gguf(path, "deepseek_v3", gguf_arch, {**meta(make_config("deepseek_v3", **shape)),
                                                                  **scaling}, split_kv_b=True, matrix_type=Q.F32, **shape)
    rope = load_config(path).rope_parameters
    assert {k: rope[k] for k in yarn} == yarn
    ids = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = original(ids).logits
    with load_hybrid_model(path, None, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        assert rel_err(hybrid(input_ids=ids).logits, want) < 1e-5
    plain = tmp_path / "plain.gguf"  # the same weights without the scaling metadata: YaRN really changed the output
    write_generic_gguf(plain, "deepseek_v3", gguf_arch, meta(make_config("deepseek_v3", **shape)), split_kv_b=True,
                       matrix_type=Q.F32, **shape)
    with load_hybrid_model(plain, None, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        assert rel_err(hybrid(input_ids=ids).logits, want) > 1e-3


@pytest.mark.slow
def test_a_directory_of_split_gguf_files_loads_like_one_file(tmp_path, gguf_case):
    path, ids, _, _ = gguf_case
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_qwen3moe_gguf(split_dir / "tiny.gguf", split_max_tensors=12)
    files = sorted(split_dir.glob("*.gguf"))
    assert len(files) > 2, files
    with load_hybrid_model(path, None, dtype=torch.float32, progress=False) as one, \
            load_hybrid_model(split_dir, None, dtype=torch.float32, progress=False) as split:
        assert torch.equal(one(input_ids=ids).logits, split(input_ids=ids).logits)
    assert summarize(split_dir).num_files == len(files)  # `tiermoe inspect` counts the split files


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q5_K", "Q6_K", "Q8_0"])
def test_every_supported_tensor_type_reads_whole_and_per_expert_as_the_gguf_package_dequantises_it(tmp_path, kind):
    from tiermoe.checkpoint.gguf_reader import GGUFFiles

    qtype = getattr(Q, kind)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 256)).astype(np.float32)  # [E, rows, cols]
    if kind in ("Q5_K", "Q6_K"):  # the gguf package only decodes K-quants: random blocks with finite fp16 scales
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = rng.integers(0, 256, (3, 4, block_bytes), dtype=np.uint8)
        scale_at = [0, 2] if kind == "Q5_K" else [block_bytes - 2]  # d (and dmin) as fp16
        for at in scale_at:
            raw[..., at:at + 2] = np.full((3, 4, 1), 0.01, dtype=np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(x, qtype)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen3moe")
    w.add_tensor("t.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    files = GGUFFiles(tmp_path / "t.gguf")
    assert files.shape("t.weight") == (3, 4, 256)
    assert torch.equal(files.read("t.weight"), want)
    assert torch.equal(files.read("t.weight", index=2), want[2])


def test_convert_from_gguf_gives_the_cache_a_direct_load_would_build(tmp_path, gguf_case):
    from tiermoe.config import CPUConfig
    from tiermoe.convert import convert_cpu_experts

    path, ids, _, _ = gguf_case
    cache = convert_cpu_experts(path, "int8", tmp_path / "c", progress=False)
    assert (cache / "config.json").is_file()  # the GGUF's metadata, written as a config
    with load_hybrid_model(path, None, progress=False, cpu=CPUConfig(expert_dtype="int8")) as direct, \
            load_hybrid_model(cache, None, progress=False) as cached:
        assert torch.equal(cached(input_ids=ids).logits, direct(input_ids=ids).logits)


def test_a_gguf_brings_its_tokenizer_and_one_without_a_vocabulary_takes_token_ids(tmp_path, gguf_case):
    from tiermoe import LLM, SamplingParams

    path = tmp_path / "with-vocab.gguf"
    write_qwen3moe_gguf(path, vocabulary=True)
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    with LLM(path, progress=False) as llm:
        ids = llm.encode("hello there")
        assert ids[0] == 0x7F and llm.tokenizer.decode(ids) == "hello there"  # the merge applied, text round-trips
        by_text = llm.generate("hello there", greedy)[0]
        assert by_text.token_ids == llm.generate([ids], greedy)[0].token_ids
        assert by_text.text == llm.tokenizer.decode(by_text.token_ids)
    with LLM(gguf_case[0], progress=False) as llm:
        assert llm.tokenizer is None
        with pytest.raises(TiermoeError, match="no tokenizer"):
            llm.generate("hello", greedy)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_tiermoe_decodes_gguf_blocks_bit_for_bit_as_the_gguf_package(kind):
    """The C++ decoder (20x the numpy one: BENCHMARKS.md) against gguf.quants on random codes, with normal,
    subnormal and negative half-precision scales, over thread splits of the block range."""
    from tiermoe.checkpoint.gguf_dequant import dequantize_into
    from tiermoe.experts.kernels import native_library

    if native_library() is None:
        pytest.skip("tiermoe's C++ kernels are not built on this machine")
    qtype = getattr(Q, kind)
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    n = 8 * 1000
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    halves = (rng.standard_normal(n) * 0.01).astype(np.float16)
    halves[::5] = np.float16(-3e-6)  # subnormal in fp16
    for at in ([0] if kind == "Q8_0" else [0, 2] if kind != "Q6_K" else [block_bytes - 2]):
        raw[:, at:at + 2] = np.ascontiguousarray(np.roll(halves, at)).view(np.uint8).reshape(n, 2)
    raw = raw.reshape(8, -1)
    want = torch.empty(8, n // 8 * values)
    dequantize_into(raw, qtype, want, native=False)
    threads_before = torch.get_num_threads()
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            got = dequantize_into(raw, qtype, torch.empty_like(want))
            half = dequantize_into(raw, qtype, torch.empty(want.shape, dtype=torch.bfloat16))
        finally:
            torch.set_num_threads(threads_before)
        assert torch.equal(got, want)
        assert torch.equal(half, want.to(torch.bfloat16))
