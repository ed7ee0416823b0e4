"""The multi-GPU workflow example (examples/multi_gpu_workflow.py) runs end to end with 2 ranks under torchrun."""

from __future__ import annotations

from pathlib import Path

from conftest import run_script

ROOT = Path(__file__).resolve().parents[1]


def test_multi_gpu_workflow_two_ranks_generate_what_one_process_does(tmp_path, capfd):
    # the example's own steps run in this process (no second interpreter to start); the ranks it launches with
    # torchrun print to the inherited file descriptors, which capfd reads
    out = run_script(ROOT / "examples/multi_gpu_workflow.py", "--max-tokens", "12", "--workdir", str(tmp_path))
    ranks = capfd.readouterr()
    assert out.returncode == 0, out.stdout + out.stderr + ranks.out + ranks.err
    out.stdout += ranks.out
    lines = out.stdout.splitlines()
    one = next(line for line in lines if line.startswith("1 rank :")).split(":", 1)[1]
    two = next(line for line in lines if line.startswith("2 ranks:")).split(":", 1)[1]
    assert one == two and len(one) > 20  # token ids of both prompts, identical
    for step in ("1. collect statistics", "2. generate masks", "3. partition per rank", "4. place parameters",
                 "5. CPU buffers: KExpertsCPUBuffer", "6. launch ranks with torchrun", "7. serve"):
        assert any(line.startswith(step) for line in lines), step
    assert "every rank maps the same bytes: True" in out.stdout
    assert "2-rank output equals 1-rank output: True" in out.stdout
    assert (tmp_path / "activation_freq.pt").exists() and (tmp_path / "plan.json").exists()
    rank_lines = [line.split(", ") for line in lines if line.startswith("   rank ") and "MiB" in line]
    assert [r[-1] != "0.0 MiB" for r in rank_lines] == [True, False]  # only rank 0 computes the CPU experts
