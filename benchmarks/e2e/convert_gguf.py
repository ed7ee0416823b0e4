"""Run llama.cpp's convert_hf_to_gguf.py on a `tiermoe make-model` checkpoint (bench_e2e_cpu.py calls this in a
subprocess; the converter is the one the llama-cpp-python sdist vendors, see e2e.llama_cpp.converter_dir).

Two things a make-model checkpoint lacks that the converter insists on, given without touching the checkpoint:
- config.json has no "architectures" (tiermoe reads model_type): the converter reads a copy of the directory
  (links to its files) whose config.json names transformers' causal-LM class for the model_type;
- the byte-level debug tokenizer (tiny configs) is not in the converter's table of known pre-tokenizers, which it
  recognises by hashing what they make of a test text. That tokenizer splits with GPT-2's byte-level regex, so an
  unknown one is written as llama.cpp's "gpt-2" pre-tokenizer; and it has no merges (bytes only), which llama.cpp
  refuses to load, so it gets one that no text makes (two NUL bytes; a merge whose token is not in the
  vocabulary falls back to bytes anyway). A released tokenizer (Qwen's) is converted as it is.

    python benchmarks/e2e/convert_gguf.py CONVERTER_DIR HF_DIR OUT.gguf WORK_DIR
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def converter_input(hf_dir: Path, work: Path) -> Path:
    """WORK/convert-input: links to hf_dir's files, and a config.json with "architectures"."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = work / "convert-input"
    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        link = out / f.name
        if f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    config = json.loads((hf_dir / "config.json").read_text())
    config.setdefault("architectures", [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    converter, hf_dir, out, work = (Path(a) for a in sys.argv[1:5])
    source = converter_input(hf_dir, work)
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    import conversion.base as base
    import gguf

    add_vocab = gguf.SpecialVocab.add_to_gguf

    def add_vocab_with_a_merge(self, gw, quiet: bool = False) -> None:
        if self.load_merges and not self.merges:
            self.merges = ["\u0100 \u0100"]  # byte 0 twice, in byte-level BPE's alphabet
        add_vocab(self, gw, quiet)

    gguf.SpecialVocab.add_to_gguf = add_vocab_with_a_merge

    recognised = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"  # make-model's byte-level tokenizer: GPT-2's byte-level split

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", str(source), "--outtype", "bf16", "--outfile", str(out)]
    runpy.run_path(str(converter / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
