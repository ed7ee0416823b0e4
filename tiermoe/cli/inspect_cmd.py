"""tiermoe inspect: a checkpoint's MoE structure and sizes, from headers only (or from its config.json alone), or the
page of every architecture the installed transformers defines (--architectures). The flags; the run is
inspect_run."""

from __future__ import annotations

from tiermoe.cli.flags import add_command


def add_parser(sub) -> None:
    p = add_command(
        sub, "inspect",
        "Show a checkpoint's architecture, MoE layers, experts, top-k and expert vs non-expert bytes. Reads "
        "config.json and safetensors headers only, so it works on checkpoints larger than memory. Without "
        "MODEL_DIR it shows the bundled demo model.",
        "tiermoe inspect",
        "tiermoe inspect /models/Qwen3-30B-A3B",
        "tiermoe inspect /models/DeepSeek-V3 --json",
        "tiermoe inspect /models/MiniMax-M2/config.json",
        "tiermoe inspect --architectures > docs/architectures.md",
    )
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory, GGUF model, or a config.json alone (default: the bundled demo model)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--architectures", action="store_true",
                   help="print the page of every MoE architecture of the installed transformers (markdown): who "
                        "computes each part, and whether the engine serves it")
