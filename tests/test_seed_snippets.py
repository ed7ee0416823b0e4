"""The seed documents' launch lines and Python snippets run on tiermoe as written (tests/data/seed_commands.md
holds them verbatim, with their origin). Only these are replaced: the `/path/to` placeholders (a folder with a tiny
checkpoint and an activation_stats.pt in KTransformers' collector format), the program and module names
(`python -m sglang.server` / `sglang.launch_server` -> `python -m tiermoe.serve`, `kt run` -> `tiermoe serve`,
`kt_kernel` / `kt_kernel.sft.arch` / `ktransformers` -> `tiermoe.compat`) and, on a machine without CUDA, the CUDA
devices (flags and `device=` arguments) by the CPU device. Each server also gets a free `--port`, so tests can run
side by side: SGLang's 30000 may be taken. Each server: start, wait for /health, the seed's own request, stop."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import save_char_tokenizer

from tiermoe.distributed.launch import free_port
from tiermoe.placement.global_topk import generate_gpu_experts_masks
from tiermoe.testing.presets import make_config

SEEDS = Path(__file__).parent / "data" / "seed_commands.md"
BLOCK = re.compile(r"<!-- seed (?P<seed>\S+), (?P<section>.*?) -->\n```(?P<kind>\w+)\n(?P<body>.*?)```", re.S)
PROGRAMS = {("python", "-m", "sglang.server"): ["-m", "tiermoe.serve"],
            ("python", "-m", "sglang.launch_server"): ["-m", "tiermoe.serve"],
            ("python3", "-m", "sglang.launch_server"): ["-m", "tiermoe.serve"],
            ("kt", "run"): ["-m", "tiermoe.cli.main", "serve"]}
MODULES = re.compile(r"^(\s*(?:from|import)\s+)(kt_kernel\.sft\.arch|kt_kernel|ktransformers)\b", re.M)
CUDA = not torch.cuda.is_available()
E = 16  # experts per layer of the tiny model: the seeds' 8 GPU experts per layer are then a real choice


def blocks(kind: str) -> list[dict]:
    found = [m.groupdict() for m in BLOCK.finditer(SEEDS.read_text(encoding="utf-8")) if m["kind"] == kind]
    assert found, f"no {kind} block in {SEEDS}"
    return found


@pytest.fixture(scope="module")
def path_to(tmp_path_factory):
    """What the seeds' /path/to stands for: a tiny qwen3_moe (3 layers, layer 1 dense, 16 experts, top-2) and
    KTransformers' activation_stats.pt for it."""
    root = tmp_path_factory.mktemp("path_to")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("qwen3_moe", num_experts=E, initializer_range=0.1),
                                             dtype=torch.float32)
    model.save_pretrained(root / "model")
    save_char_tokenizer(root / "model")
    counts = torch.zeros(3, E)
    counts[[0, 2]] = torch.randint(1, 1000, (2, E), generator=torch.Generator().manual_seed(1)).float()
    torch.save({"activation_counts": counts, "logical_count": counts[None], "num_layers": 3, "num_experts": E,
                "num_samples": 100}, root / "activation_stats.pt")
    return root, model, counts


def to_tiermoe(command: str, path_to: Path) -> list[str]:
    argv = shlex.split(re.sub(r"\\\s+", " ", command.replace("/path/to", str(path_to))))
    for program, replacement in PROGRAMS.items():
        if tuple(argv[:len(program)]) == program:
            argv = [sys.executable, *replacement, *argv[len(program):]]
            break
    else:
        raise AssertionError(f"no tiermoe program for {argv[:3]}")
    return ["cpu" if CUDA and re.fullmatch(r"cuda(:\d+)?", a) else a for a in argv]


def launch_lines(body: str) -> list[str]:
    lines = [line for line in re.sub(r"\\\s*\n", " ", body).splitlines() if line.strip()]
    return [line.strip() for line in lines if not line.lstrip().startswith("#")]


def seed_request() -> tuple[str, dict]:
    """The seed's curl request: its URL path, and its JSON body with the quotes its page lost put back."""
    (block,) = blocks("request")
    url = re.search(r"http://localhost:30000(\S+)", block["body"])[1]
    body = re.search(r"-d (\{.*\})", block["body"])[1]
    quoted = re.sub(r"([{,\[]\s*)(\w+):", r'\1"\2":', body)  # keys
    quoted = re.sub(r':\s*([A-Za-z][\w!-]*)(?=\s*[,}\]])', lambda m: ": " + (m[1] if m[1] == "true" else
                                                                           json.dumps(m[1])), quoted)
    return url, json.loads(quoted)


def test_the_seed_request_is_reconstructed():
    assert seed_request() == ("/v1/chat/completions", {"model": "model-name", "stream": True,
                                                       "messages": [{"role": "user", "content": "Hello!"}]})


def test_seed_launch_lines_serve_the_seed_request(path_to):
    root, _, counts = path_to
    commands = []
    for block in blocks("bash"):
        for line in launch_lines(block["body"]):
            argv = to_tiermoe(line, root)
            if argv not in commands:  # seed 000's two lines differ only in their CUDA device
                commands.append(argv)
    assert len(commands) == 4
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    servers = []
    try:
        for argv in commands:  # all at once: their start-up (interpreter, imports, loading) overlaps
            port = free_port()
            servers.append((argv, port, subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.PIPE,
                                                         stderr=subprocess.STDOUT, text=True, env=env)))
        url_path, request = seed_request()
        for argv, port, proc in servers:
            base = f"http://127.0.0.1:{port}"
            wait_for_health(base, proc, argv)
            with httpx.stream("POST", base + url_path, json=request, timeout=60) as reply:
                assert reply.status_code == 200, reply.read()
                events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and len(events) > 2
            chunks = [json.loads(e) for e in events[:-1]]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            placement = httpx.get(base + "/placement", timeout=10).json()
            mask = torch.tensor(placement["assignment"]) >= 0
            assert placement["gpu_experts_per_layer"] == [8, 0, 8]  # --kt-num-gpu-experts 8 per MoE layer
            if "frequency" in argv:  # the activation_stats.pt that /path/to/activation_stats.pt stood for
                assert torch.equal(mask, generate_gpu_experts_masks(counts, 16))
    finally:
        for _, _, proc in servers:
            proc.terminate()
        for _, _, proc in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for_health(base: str, proc: subprocess.Popen, argv: list[str], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{shlex.join(argv)} exited:\n{proc.stdout.read()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{shlex.join(argv)} did not answer /health in {timeout:.0f} s")


def run_snippet(block: dict, namespace: dict) -> str:
    code = MODULES.sub(r"\1tiermoe.compat", block["body"])
    if CUDA:
        code = re.sub(r'device=f?"cuda[^"]*"', 'device="cpu"', code)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{block['seed']}: {block['section']}", "exec"), namespace)  # noqa: S102
    return out.getvalue()


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
def test_seed_python_snippets_run(path_to, tmp_path, monkeypatch):
    _, model, counts = path_to
    snippets = {(b["seed"][:3], b["section"]): b for b in blocks("python")}
    assert len(snippets) == 4

    # seed 000's two fragments use the user's own act_freq and model
    ns = {"act_freq": counts}
    run_snippet(snippets["000", "Generating Expert Placement Masks"], ns)
    assert ns["mask"].dtype == torch.bool and int(ns["mask"].sum()) == 8
    assert torch.equal(ns["mask"], generate_gpu_experts_masks(counts, 8))
    run_snippet(snippets["000", "Moving Non-Expert Parameters to GPU"], {"model": model})

    # seed 000's complete example reads activation_freq.pt and my_moe_model.pt from the current directory; the
    # whole pickled model needs torch's pre-2.6 torch.load, which the seed was written for
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    torch.save(counts, "activation_freq.pt")
    torch.save(model, "my_moe_model.pt")
    ns = {}
    run_snippet(snippets["000", "Complete Multi-GPU Setup Example"], ns)
    assert int(ns["mask"].sum()) == 8 and not ns["gpu_mask"][:, 4:].any()  # rank 0 keeps experts 0-3
    assert torch.equal(ns["model"].gpu_expert_mask, ns["gpu_mask"])

    # seed 001 prints the mask its comment shows, and builds the device map from it
    ns = {}
    printed = run_snippet(snippets["001", "Complete Implementation Example"], ns)
    assert ns["gpu_mask"].tolist() == [[False, True, False, True], [False, False, True, False]]
    assert "tensor([[False,  True, False,  True]," in printed
    assert ns["device_map"][(0, 3)] == "cuda" and ns["device_map"][(1, 0)] == "cpu" and len(ns["device_map"]) == 8
