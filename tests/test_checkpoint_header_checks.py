"""A checkpoint is not trusted: every safetensors header entry and every GGUF count and tensor offset is checked
when the file is opened, and a bad one is refused with one line naming the file and the tensor, by every command
that reads it (inspect, fit, generate, convert), never a traceback, a hang or silently wrong weights."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from conftest import run_cli, save_char_tokenizer, save_tiny

from tiermoe.checkpoint.expert_cache import MANIFEST
from tiermoe.checkpoint.safetensors import read_header
from tiermoe.errors import TiermoeError

gguf = pytest.importorskip("gguf")


def commands(model, tmp_path) -> dict[str, tuple[str, ...]]:
    return {
        "inspect": ("inspect", str(model)),
        "fit": ("fit", "--model", str(model)),
        "generate": ("generate", "--model", str(model), "--prompt", "hi", "--gpu-device", "cpu", "--max-tokens", "2"),
        "convert": ("convert", "--model", str(model), "--cpu-expert-dtype", "int8", "--out", str(tmp_path / "out")),
    }


def assert_refused(result, *fragments: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # progress bars aside
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---- safetensors ----

@pytest.fixture(scope="module")
def tiny_safetensors(tmp_path_factory):
    model = save_tiny("qwen3_moe", tmp_path_factory.mktemp("st"))
    save_char_tokenizer(model)  # so that `generate` on the good model runs to the end
    return model


def rewrite_header(file, edit) -> None:
    """The file with its JSON header replaced by `edit(header)` (a dict, or raw bytes), the data section kept."""
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = edit(json.loads(raw[8:8 + length]))
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:])


NORM = "model.layers.0.input_layernorm.weight"  # [64] fp32: 256 bytes
OTHER_NORM = "model.layers.0.post_attention_layernorm.weight"  # the same size
EXPERT = "model.layers.0.mlp.experts.2.up_proj.weight"


def _set(name, **fields):
    def edit(header):
        header[name].update(fields)
        return header
    return edit


def _past_the_end(header):
    data_end = max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__")
    begin, end = header[EXPERT]["data_offsets"]
    header[EXPERT]["data_offsets"] = [data_end - (end - begin) + 64, data_end + 64]
    return header


def _overlapping(header):
    header[OTHER_NORM]["data_offsets"] = list(header[NORM]["data_offsets"])
    return header


HEADER_CASES = {  # what is wrong -> (edit, the tensor the error names, a fragment of what it says)
    "negative offset": (_set(NORM, data_offsets=[-8, 248]), NORM, "negative"),
    "past the data section": (_past_the_end, EXPERT, "past the end"),
    "overlapping": (_overlapping, NORM, "overlap"),
    "wrong length": (lambda h: _set(EXPERT, shape=[32, 63])(h), EXPERT, "bytes"),
    "unknown dtype": (lambda h: _set(EXPERT, dtype="F7")(h), EXPERT, "dtype"),
    "offsets not two integers": (lambda h: _set(EXPERT, data_offsets=[0, "x"])(h), EXPERT, "data_offsets"),
    "negative dimension": (lambda h: _set(EXPERT, shape=[-32, -64])(h), EXPERT, "shape"),
    "entry not an object": (lambda h: {**h, EXPERT: [1, 2]}, EXPERT, "object"),
    "header not an object": (lambda h: b"[1, 2, 3]", None, "JSON object"),
    "header not JSON": (lambda h: b"{\"a\": ", None, "not a valid safetensors file"),
    "duplicate name": (lambda h: json.dumps(h).replace("{", '{"' + NORM + '": ' + json.dumps(h[NORM]) + ", ", 1
                                                     ).encode(), NORM, "twice"),
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_a_bad_safetensors_header_entry_is_refused_naming_the_file_and_tensor(tiny_safetensors, tmp_path, case):
    model = tmp_path / "m"
    shutil.copytree(tiny_safetensors, model)
    edit, tensor, says = HEADER_CASES[case]
    file = model / "model.safetensors"
    rewrite_header(file, edit)
    with pytest.raises(TiermoeError, match=says) as err:
        read_header(file)
    assert str(file) in str(err.value) and (tensor is None or tensor in str(err.value))
    for argv in commands(model, tmp_path).values():
        assert_refused(run_cli(*argv), str(file), says, *([tensor] if tensor else []))
    assert not (tmp_path / "out").exists()  # convert refused before writing anything


def test_a_header_length_beyond_the_file_is_refused(tiny_safetensors, tmp_path):
    file = tmp_path / "model.safetensors"
    raw = (tiny_safetensors / "model.safetensors").read_bytes()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    with pytest.raises(TiermoeError, match="header length .* is larger than the file"):
        read_header(file)


def test_the_same_tensor_in_two_shards_is_refused(tiny_safetensors, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_safetensors, model)
    shutil.copy(model / "model.safetensors", model / "model-copy.safetensors")
    assert_refused(run_cli("inspect", str(model)), "model-copy.safetensors", "lm_head.weight", "also in")


def test_a_valid_checkpoint_still_opens(tiny_safetensors, tmp_path):
    entries = read_header(tiny_safetensors / "model.safetensors")
    assert entries[EXPERT].nbytes == 32 * 64 * 4 and entries[EXPERT].shape == (32, 64)
    for name, argv in commands(tiny_safetensors, tmp_path).items():
        assert run_cli(*argv).returncode == 0, name


# ---- GGUF ----

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from test_checkpoint_gguf import write_qwen3moe_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_qwen3moe_gguf(path, vocabulary=True)
    return path


def _file_offset(reader, part) -> int:
    """Where a part the gguf package parsed lies in the file (parts are views of its memory map)."""
    return part.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]


def _patched(raw: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def gguf_corruptions(good) -> dict[str, tuple[bytes, str]]:
    """What is wrong -> (the file's bytes, a fragment of the one line that must name it)."""
    raw = good.read_bytes()
    reader = gguf.GGUFReader(good)
    at = lambda part: _file_offset(reader, part)
    first, second = reader.tensors[0], reader.tensors[1]
    token_types = reader.fields["tokenizer.ggml.token_type"]
    return {
        "huge tensor count": (_patched(raw, 8, "<Q", 2**60), "tensor count"),
        "huge metadata count": (_patched(raw, 16, "<Q", 2**60), "metadata count"),
        "truncated in the header": (raw[:200], "not a valid GGUF file"),
        "truncated in the data": (raw[:len(raw) // 2], "not a valid GGUF file"),
        "huge array length": (_patched(raw, at(token_types.parts[4]), "<Q", 2**60), "longer than the file"),
        "huge string length": (_patched(raw, at(reader.fields["general.architecture"].parts[3]), "<Q", 2**60),
                               "not a valid GGUF file"),
        "tensor data outside the file": (_patched(raw, at(second.field.parts[5]), "<Q", 2**40), "not a valid GGUF"),
        "overlapping tensors": (_patched(raw, at(second.field.parts[5]), "<Q", int(first.field.parts[5][0])),
                                second.name),
        "unknown tensor type": (_patched(raw, at(second.field.parts[4]), "<I", 9999), "9999"),
        "huge dimension": (_patched(raw, at(second.field.parts[3]), "<Q", 2**40), "not a valid GGUF file"),
        "huge block count": (_patched(raw, at(reader.fields["qwen3moe.block_count"].parts[3]), "<I", 2**31),
                             "qwen3moe.block_count"),
        "huge head size": (_patched(raw, at(reader.fields["qwen3moe.attention.key_length"].parts[3]), "<I", 2**31 - 1),
                           "qwen3moe.attention.key_length"),
        "more experts used than exist": (
            _patched(raw, at(reader.fields["qwen3moe.expert_used_count"].parts[3]), "<I", 99), "expert_used_count"),
    }


GGUF_CASES = ("huge tensor count", "huge metadata count", "truncated in the header", "truncated in the data",
              "huge array length", "huge string length", "tensor data outside the file", "overlapping tensors",
              "unknown tensor type", "huge dimension", "huge block count", "huge head size",
              "more experts used than exist")


@pytest.mark.parametrize("case", GGUF_CASES)
def test_a_corrupt_gguf_is_one_line_in_every_command(tiny_gguf, tmp_path, case):
    data, says = gguf_corruptions(tiny_gguf)[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(data)
    for argv in commands(bad, tmp_path).values():
        assert_refused(run_cli(*argv), str(bad), says)
    assert not (tmp_path / "out").exists()


def test_the_valid_gguf_still_opens(tiny_gguf):
    assert run_cli("inspect", str(tiny_gguf)).returncode == 0


@pytest.fixture
def converted(tiny_safetensors, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_safetensors, model)
    cache = tmp_path / "cache"
    assert run_cli("convert", "--model", str(model), "--cpu-expert-dtype", "int8", "--out", str(cache)).returncode == 0
    return cache


def test_a_converted_cache_with_a_bad_layer_header_is_refused(converted):
    cache = converted
    layer = cache / "layer-000.safetensors"
    rewrite_header(layer, lambda h: {**h, "1.down.codes": {**h["1.down.codes"], "data_offsets": h["0.down.codes"][
        "data_offsets"]}})
    result = run_cli("generate", "--model", str(cache), "--prompt", "hi", "--gpu-device", "cpu", "--max-tokens", "2")
    assert_refused(result, str(layer), "1.down.codes", "overlap")


def test_a_converted_cache_with_a_damaged_manifest_is_refused(converted):
    manifest_file = converted / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    del manifest["matrices"]["down"]["segments"]
    manifest["source"] = 3
    manifest_file.write_text(json.dumps(manifest))
    for argv in (("inspect", str(converted)), ("fit", "--model", str(converted)),
                 ("generate", "--model", str(converted), "--prompt", "hi", "--gpu-device", "cpu")):
        assert_refused(run_cli(*argv), str(manifest_file), "matrices.down.segments, source", "convert` again")
