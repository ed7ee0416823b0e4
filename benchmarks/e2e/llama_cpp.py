"""llama.cpp for bench_e2e_cpu.py and bench_non_expert_quant.py: the llama-cpp-python wheel (built once from its
sdist and cached), the GGUF converter that sdist vendors, quantisation to Q4_K_M or Q8_0, what a GGUF file reads per
decoded token and the type each of its tensors has.

Cache (TIERMOE_CACHE, default ~/.cache/tiermoe):
    wheels/llama_cpp_python-0.3.36-*.whl       the built wheel (`--build-llama-cpp`: about 15 minutes on 2 cores)
    wheels/llama_cpp_python-0.3.36.tar.gz      its sdist (downloaded by pip when absent)
    llama-cpp-convert-0.3.36/                  vendor/llama.cpp's convert_hf_to_gguf.py, conversion/, gguf-py/
    gguf/<checkpoint name>-<key>/bf16.gguf     a checkpoint converted once (cached_gguf; the key changes with it)
    gguf/<checkpoint name>-<key>/q8_0.gguf     ... quantised from it once (cached_quantized), q4_k_m.gguf likewise
The converter needs only torch, transformers and numpy; quantising needs llama_cpp (its llama_model_quantize).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
CONVERT_WRAPPER = Path(__file__).resolve().parent / "convert_gguf.py"
HASHED_BYTES = 256 << 20  # checkpoint_key hashes the contents of files up to this size


def cache_dir() -> Path:
    return Path(os.environ.get("TIERMOE_CACHE", Path.home() / ".cache" / "tiermoe"))


def wheels_dir() -> Path:
    return cache_dir() / "wheels"


def cached_wheel() -> Path | None:
    found = sorted(wheels_dir().glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    return found[-1] if found else None


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def missing_message() -> str:
    """One line: why the llama.cpp side is skipped and how to get it."""
    wheel = cached_wheel()
    if wheel is not None:
        how = f"a built wheel is cached: `{sys.executable} -m pip install {wheel}` (or rerun with --build-llama-cpp)"
    else:
        how = (f"rerun with --build-llama-cpp to build llama-cpp-python {LLAMA_CPP_VERSION} into {wheels_dir()} "
               "and install it (about 15 minutes on 2 cores)")
    return f"llama.cpp side skipped: llama_cpp is not installed; {how}"


def _pip(*args: str, what: str) -> None:
    """Run pip, its output streaming to the terminal (the build is long: its progress shows)."""
    print(f"[llama.cpp] {what}: pip {' '.join(args)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", *args])
    if done.returncode != 0:
        raise SystemExit(f"[llama.cpp] {what} failed (pip exit status {done.returncode}); see pip's output above")


def sdist_path() -> Path:
    """The cached sdist, downloaded by pip when absent."""
    path = wheels_dir() / SDIST
    if not path.exists():
        wheels_dir().mkdir(parents=True, exist_ok=True)
        _pip("download", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "--no-deps", "--no-binary", ":all:",
             "-d", str(wheels_dir()), what="downloading the sdist")
    return path


def build_and_install() -> None:
    """--build-llama-cpp: build the wheel from the sdist unless cached (verbose, so cmake's progress shows), then
    install it into this interpreter."""
    wheel = cached_wheel()
    if wheel is None:
        _pip("wheel", str(sdist_path()), "--no-deps", "-v", "-w", str(wheels_dir()),
             what=f"building llama-cpp-python {LLAMA_CPP_VERSION} (about 15 minutes on 2 cores)")
        wheel = cached_wheel()
        if wheel is None:
            raise SystemExit(f"[llama.cpp] pip reported success but no wheel is in {wheels_dir()}")
    if not llama_cpp_installed():
        _pip("install", str(wheel), what="installing the cached wheel")


def converter_dir() -> Path:
    """vendor/llama.cpp's converter, unpacked from the cached sdist once."""
    out = cache_dir() / f"llama-cpp-convert-{LLAMA_CPP_VERSION}"
    if (out / "convert_hf_to_gguf.py").exists():
        return out
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    wanted = re.compile(re.escape(prefix) + r"(convert_hf_to_gguf\.py|conversion/.*|gguf-py/.*)$")
    print(f"[llama.cpp] unpacking the GGUF converter from {sdist_path()} into {out}", flush=True)
    with tarfile.open(sdist_path()) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and wanted.match(m.name)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(out, members=members, filter="data")
    return out


def convert_to_gguf(hf_dir: Path, out: Path, work: Path) -> None:
    """The checkpoint as a bf16 GGUF, by llama.cpp's own converter (run in a subprocess, see e2e.convert_gguf; its
    log goes to WORK/convert.log, and the bytes written so far show as progress)."""
    tmp, log = out.with_suffix(".partial"), work / "convert.log"
    total = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    cmd = [sys.executable, str(CONVERT_WRAPPER), str(converter_dir()), str(hf_dir), str(tmp), str(work)]
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            written = tmp.stat().st_size if tmp.exists() else 0
            print(f"\r[llama.cpp] converting {hf_dir} to {out.name}: {written / 1e9:.2f} / ~{total / 1e9:.2f} GB",
                  end="", flush=True)
            time.sleep(1)
    print(flush=True)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"[llama.cpp] converting {hf_dir} to GGUF failed: {tail[0]} (log: {log})")
    tmp.rename(out)


def checkpoint_key(hf_dir: Path) -> str:
    """A short hash of what a checkpoint directory holds: each file's name and size, the contents of files up to
    HASHED_BYTES, the modification time of larger ones (hashing a 60 GB checkpoint would take minutes)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in hf_dir.iterdir() if p.is_file()):
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        if size <= HASHED_BYTES:
            digest.update(f.read_bytes())
        else:
            digest.update(str(f.stat().st_mtime_ns).encode())
    return digest.hexdigest()[:16]


def cached_gguf(hf_dir: Path) -> Path:
    """hf_dir as a bf16 GGUF (convert_to_gguf), converted on first use and kept under the cache; a changed
    checkpoint has another key, so it is converted anew."""
    work = cache_dir() / "gguf" / f"{hf_dir.resolve().name}-{checkpoint_key(hf_dir)}"
    out = work / "bf16.gguf"
    if not out.exists():
        work.mkdir(parents=True, exist_ok=True)
        convert_to_gguf(hf_dir, out, work)
    return out


# llama.cpp's file types by the names its quantize tool takes (llama_cpp.LLAMA_FTYPE_MOSTLY_<name>)
QUANT_TYPES = ("Q8_0", "Q4_K_M")


def quantize(src: Path, out: Path, kind: str, threads: int) -> None:
    """src (a bf16 GGUF) as `kind` (one of QUANT_TYPES), by llama.cpp's llama_model_quantize (in a subprocess: it
    prints a line per tensor to stdout, which becomes a progress count here)."""
    if kind not in QUANT_TYPES:
        raise ValueError(f"llama.cpp quantisation {kind!r} is not one of {', '.join(QUANT_TYPES)}")
    tmp = out.with_suffix(".partial")
    code = ("import ctypes, sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{kind}\n"
            f"p.nthread = {threads}\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(src), str(tmp)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if m := re.match(r"\[\s*(\d+)/\s*(\d+)\]", line):
            print(f"\r[llama.cpp] quantizing {out.name}: tensor {m[1]}/{m[2]}", end="", flush=True)
    print(flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"[llama.cpp] quantizing {src.name} to {kind} failed: " + " / ".join(tail[-3:]))
    tmp.rename(out)


def cached_quantized(hf_dir: Path, kind: str, threads: int) -> Path:
    """hf_dir as a `kind` GGUF, quantised from its cached bf16 GGUF on first use and kept beside it."""
    bf16 = cached_gguf(hf_dir)
    out = bf16.with_name(f"{kind.lower()}.gguf")
    if not out.exists():
        quantize(bf16, out, kind, threads)
    return out


def tensor_types(path: Path) -> dict[str, list[str]]:
    """The GGUF type of each kind of tensor in `path` (its name without the layer number: blk.N.attn_q.weight ->
    attn_q.weight), with every type the kind has where layers differ (llama.cpp's mixes, and its fallbacks for rows
    whose width is not a multiple of its block)."""
    from gguf import GGUFReader

    kinds: dict[str, list[str]] = {}
    for t in GGUFReader(path).tensors:
        kind = re.sub(r"^blk\.\d+\.", "", t.name)
        name = t.tensor_type.name
        if name not in kinds.setdefault(kind, []):
            kinds[kind].append(name)
    return kinds


def gguf_bytes_per_token(path: Path, context: float) -> int:
    """Bytes one decode token reads from a GGUF model: every tensor but the embedding table (a row of it; all of it
    when there is no separate output matrix), the routed experts' tensors scaled by top-k / experts, and the f16
    KV cache (llama.cpp's default) of `context` tokens."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(name: str, default=None):
        f = reader.fields.get(f"{arch}.{name}")
        return default if f is None else int(f.parts[-1][0])

    used, experts = field("expert_used_count", 0), field("expert_count", 0)
    names = {t.name for t in reader.tensors}
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += t.n_bytes * (used / experts if "_exps." in t.name and experts else 1.0)
    heads_kv, layers = field("attention.head_count_kv"), field("block_count")
    head_dim = field("attention.key_length") or field("embedding_length") // field("attention.head_count")
    value_dim = field("attention.value_length", head_dim)
    return int(total + context * 2 * layers * heads_kv * (head_dim + value_dim))
