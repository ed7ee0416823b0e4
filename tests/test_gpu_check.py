"""benchmarks/gpu_check.sh, the one GPU run: its plan fits one device call in the value order, nothing runs
without CUDA (and it says why), results are on disk after every check even when a later one hangs or the
whole call is cut short, the carried wheels cover transformers' floor, and (rehearsed with the GPU tier on the
CPU device) every check's own code runs. No test here needs CUDA."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tiermoe.analysis.gpu_check.plan import (
    CHECKS,
    IMAGE_PACKAGES,
    LIMIT_S,
    NOT_CARRIED,
    RUN_CALL,
    SETUP_S,
    STAGES,
    Check,
    CheckContext,
    read_requirements,
    wheel_files,
)
from tiermoe.analysis.gpu_check.runner import ResultLog, run_plan

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
REQUIREMENTS = REPO / "benchmarks" / "gpu_wheels.txt"
NO_CUDA = not torch.cuda.is_available()
ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\d+(?:\.\d+)?)s\s+(.*)$")


def script(*args, out: Path, wheels: Path, extra_env: dict | None = None, timeout: float = 120):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_WHEELS": str(wheels),
           **(extra_env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_dry_run_prints_every_check_in_value_order_with_budgets_within_the_limit(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pins = read_requirements(REQUIREMENTS)
    for name, version in pins[:1]:  # one downloaded, the others not
        (wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"x" * 1000)
    done = script("--dry-run", out=tmp_path / "out", wheels=wheels)
    assert done.returncode == 0, done.stderr
    rows = [ROW.match(line).groups() for line in done.stdout.splitlines() if ROW.match(line)]
    assert rows[0][1] == "(set-up)" and float(rows[0][3]) == SETUP_S
    checks = rows[1:]
    assert [r[1] for r in checks] == [c.name for c in CHECKS]
    stages = [STAGES.index(r[2]) for r in checks]
    assert stages == sorted(stages) and set(stages) == set(range(len(STAGES)))  # every stage, in value order
    budgets = [float(r[3]) for r in checks]
    assert all(b > 0 for b in budgets)
    assert SETUP_S + sum(budgets) <= LIMIT_S <= 9 * 60
    assert f"total {SETUP_S + sum(budgets):g} s of {LIMIT_S:g} s" in done.stdout
    for name, version in pins:
        assert f"{name}=={version}" in done.stdout
    assert "(not downloaded: run benchmarks/gpu_wheels.sh)" in done.stdout  # the missing ones say how to get them
    assert RUN_CALL in done.stdout
    if NO_CUDA:
        assert all(r[4].startswith("skipped: no CUDA") for r in checks)
        assert "every check is skipped: no CUDA" in done.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_the_gpu_machine_command_and_the_budgets_are_written_where_a_reader_looks():
    """Whoever has a GPU machine runs the check in one command: the exact call is at the top of the script and in
    BENCHMARKS.md, whose table of budgets is the plan's."""
    assert RUN_CALL in SCRIPT.read_text().split("set -uo pipefail")[0]
    benchmarks = (REPO / "BENCHMARKS.md").read_text()
    start = benchmarks.index("## The one GPU run")
    end = benchmarks.find("\n## ", start + 1)
    section = benchmarks[start:end if end > 0 else None]  # its own section: later tables are other figures
    assert RUN_CALL in section and "benchmarks/gpu_wheels.sh" in section
    table = dict(re.findall(r"^\| \d+ \| (\S+) \| (\d+) \|", section, re.M))
    assert table == {"set-up": str(SETUP_S), **{c.name: f"{c.budget_s:g}" for c in CHECKS}}


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_without_cuda_every_check_is_skipped_saying_why_and_each_result_is_written(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    done = script(out=tmp_path, wheels=empty)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["checks"]) == [c.name for c in CHECKS] and report["complete"]
    for result in report["checks"].values():
        assert result["status"] == "skipped" and result["reason"].startswith("no CUDA")
    lines = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert [line["check"] for line in lines] == [c.name for c in CHECKS]
    log = (tmp_path / "gpu_check.log").read_text()
    assert log == done.stdout  # the log is the streamed output
    assert log.index("versions (this Python's own)") < log.index(f"1/{len(CHECKS)} environment")  # versions first
    assert log.count("skipped: no CUDA") == len(CHECKS)


FAKE_CHECKS = '''
import os, time

def check_ok(ctx):
    return {"status": "pass", "device": ctx.device}

def check_hangs(ctx):
    time.sleep(60)
    return {"status": "pass"}

def check_crashes(ctx):
    os._exit(3)
'''


def fake(name: str, budget: float, fn: str) -> Check:
    return Check(name, "exactness", budget, f"fake_gpu_checks:{fn}", "a fake")


@pytest.fixture
def fake_checks(tmp_path, monkeypatch):
    (tmp_path / "fake_gpu_checks.py").write_text(FAKE_CHECKS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path))
    return CheckContext("cuda:0", str(tmp_path / "out"), str(tmp_path), False, 0.0)


def read_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def test_a_check_that_hangs_is_stopped_at_its_budget_with_its_stacks_and_the_others_still_run(fake_checks, capfd):
    out = Path(fake_checks.out_dir)
    checks = (fake("first", 20, "check_ok"), fake("hangs", 1.5, "check_hangs"), fake("crashes", 20, "check_crashes"),
              fake("last", 20, "check_ok"))
    start = time.time()
    report = run_plan(checks, fake_checks, ResultLog(out, {}), time.time() + 100, log=print)
    assert time.time() - start < 30  # the hang cost its budget (and the kill grace at most), not 60 s
    assert [(line["check"], line["status"]) for line in read_lines(out)] == [
        ("first", "pass"), ("hangs", "timeout"), ("crashes", "fail"), ("last", "pass")]
    assert report["failed"] == ["hangs", "crashes"] and report["complete"]
    assert "exit code 3" in report["checks"]["crashes"]["error"]
    err = capfd.readouterr().err
    assert "Timeout" in err and "fake_gpu_checks.py" in err and "check_hangs" in err  # where it hung


def test_results_written_before_a_hang_survive_the_run_being_killed(fake_checks, tmp_path):
    """The device call's time runs out mid-check: what ended before is on disk, the report says incomplete."""
    out = Path(fake_checks.out_dir)
    program = f"""
import time
from tiermoe.analysis.gpu_check.plan import Check, CheckContext
from tiermoe.analysis.gpu_check.runner import ResultLog, run_plan
ctx = CheckContext.from_json({fake_checks.to_json()!r})
checks = (Check("first", "exactness", 20, "fake_gpu_checks:check_ok", ""),
          Check("hangs", "exactness", 60, "fake_gpu_checks:check_hangs", ""),
          Check("never", "exactness", 20, "fake_gpu_checks:check_ok", ""))
run_plan(checks, ctx, ResultLog(ctx.out_dir, {{}}), time.time() + 200)
"""
    done = subprocess.run(["timeout", "4", sys.executable, "-c", program], capture_output=True, text=True,
                          env=os.environ, timeout=60)
    assert done.returncode == 124  # killed by the outer timeout, as the device call's limit would
    assert [(line["check"], line["status"]) for line in read_lines(out)] == [("first", "pass")]
    report = json.loads((out / "gpu_check.json").read_text())
    assert list(report["checks"]) == ["first"] and not report["complete"]


def test_the_run_deadline_skips_the_checks_that_no_longer_fit(fake_checks):
    out = Path(fake_checks.out_dir)
    checks = (fake("first", 5, "check_ok"), fake("too_long", 500, "check_ok"), fake("small", 1, "check_ok"))
    report = run_plan(checks, fake_checks, ResultLog(out, {}), time.time() + 30, in_process=True, log=print)
    assert report["checks"]["first"]["status"] == "pass"
    assert report["checks"]["too_long"]["status"] == "pass"  # shortened to what was left (30 s), not skipped
    assert report["checks"]["too_long"]["budget_s"] <= 30
    report = run_plan(checks, fake_checks, ResultLog(out, {}), time.time() + 3, in_process=True, log=print)
    assert report["checks"]["too_long"]["status"] == "skipped"
    assert report["checks"]["too_long"]["reason"].startswith("time budget spent")
    assert report["checks"]["small"]["status"] == "pass"  # a check within what is left still runs


def project_dependencies() -> list[Requirement]:
    """pyproject.toml's [project] dependencies (read without tomllib: Python 3.10 is supported)."""
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return [Requirement(r) for r in re.findall(r'^\s*"([^"]+)"', block, re.M)]


def test_the_carried_wheels_cover_transformers_floor_and_every_missing_dependency():
    pins = dict(read_requirements(REQUIREMENTS))
    dependencies = project_dependencies()
    floor = next(d for d in dependencies if d.name == "transformers")
    assert Version(pins["transformers"]) >= Version("5.20") and pins["transformers"] in floor.specifier
    assert IMAGE_PACKAGES["transformers"] not in floor.specifier  # the image's is too old: why it is carried
    for dep in dependencies:
        name = dep.name.lower()
        if name in pins:
            assert pins[name] in dep.specifier, dep
        elif name in IMAGE_PACKAGES:
            assert IMAGE_PACKAGES[name] is None or IMAGE_PACKAGES[name] in dep.specifier, dep
        else:
            assert name in NOT_CARRIED, f"{dep}: neither carried, nor in the device image, nor declared not needed"


WHEELS = REPO / "benchmarks" / "gpu_wheels"


@pytest.mark.skipif(not any(WHEELS.glob("*.whl")), reason="wheels not downloaded (benchmarks/gpu_wheels.sh)")
def test_the_downloaded_wheels_are_the_pins_fit_the_call_and_need_nothing_else():
    pins = read_requirements(REQUIREMENTS)
    found = wheel_files(pins, WHEELS)
    assert all(found.values()), found
    assert len(list(WHEELS.glob("*.whl"))) == len(pins)  # two versions of one package would stop the install
    wheel_bytes = sum(p.stat().st_size for p in found.values())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    tree_bytes = sum((REPO / f).stat().st_size for f in tracked.stdout.split("\0") if f and (REPO / f).is_file())
    assert wheel_bytes < 32 << 20 and tree_bytes + wheel_bytes < 64 << 20  # what one device call carries
    carried = {name.lower(): version for name, version in pins}
    with zipfile.ZipFile(found["transformers"]) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            req = Requirement(line.split(":", 1)[1].strip())
            name = req.name.lower()
            version = carried.get(name, IMAGE_PACKAGES.get(name, "missing"))
            assert version != "missing", f"transformers needs {req}: neither carried nor in the image"
            assert version is None or version in req.specifier, req


def test_carried_wheels_install_offline_first_on_the_path(tmp_path):
    """A wheel in GPU_CHECK_WHEELS is installed with pip --no-index into a target folder that wins over this
    Python's own packages (here a metadata-only gguf wheel of another version)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dist = "gguf-0.19.0.post99.dist-info"
    with zipfile.ZipFile(wheels / "gguf-0.19.0.post99-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: gguf\nVersion: 0.19.0.post99\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", f"{dist}/METADATA,,\n{dist}/WHEEL,,\n{dist}/RECORD,,\n")
    done = script(out=tmp_path / "out", wheels=wheels, extra_env={"TMPDIR": str(tmp_path)})
    assert "installed 1 wheel(s)" in done.stdout, done.stdout[-2000:]
    own = next(line for line in done.stdout.splitlines() if "versions (this Python's own)" in line)
    used = next(line for line in done.stdout.splitlines() if "versions (in use)" in line)
    assert "gguf 0.19.0.post99" not in own and "gguf 0.19.0.post99" in used


def test_importing_the_command_line_module_starts_no_run():
    """The environment check imports every tiermoe module, `python -m tiermoe.analysis.gpu_check`'s own included:
    imported, it must not start a run (here it would print the plan)."""
    code = "import sys; sys.argv = ['gpu_check', '--dry-run']; import tiermoe.analysis.gpu_check.__main__"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and not done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_every_check_rehearses_with_the_gpu_tier_on_the_cpu_device(tmp_path):
    """--rehearse runs each check's code on tiny models (the one GPU run must not be the first time it runs)."""
    done = script("--rehearse", "--in-process", out=tmp_path, wheels=tmp_path / "none", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert list(checks) == [c.name for c in CHECKS]
    assert not [name for name, r in checks.items() if r["status"] in ("fail", "timeout")], checks
    env = checks["environment"]
    assert env["tiermoe_file"].startswith(str(REPO)) and not env["imports"]["failed"]
    for name in ("engine_vs_transformers", "attention_in_place", "exactness_fp32", "greedy_concurrency",
                 "dynamic_vs_static", "layerwise_prefill", "fp8_gpu_tier"):
        assert checks[name]["status"] == "pass", name
    assert checks["engine_vs_transformers"]["gpt_oss"]["greedy_tokens_equal"]
    assert checks["dynamic_vs_static"]["adaptive"]["swaps_landed"] > 0
    assert checks["dynamic_vs_static"]["kt-dynamic"]["swaps_landed"] > 0
    assert min(checks["layerwise_prefill"]["chunks_by_layer"].values()) >= 3
    assert (tmp_path / "decode_profile.txt").read_text().count("aten::") > 5
    back = list(tmp_path.iterdir())  # what a device call returns: at most 8 plain files, plain names
    assert len(back) <= 8 and all(p.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in back)
    if NO_CUDA:
        for name in ("pinned_copies", "auto_memory_budget"):
            assert checks[name] == {**checks[name], "status": "skipped", "reason": "no CUDA"}
