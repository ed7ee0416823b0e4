"""tiermoe make-model's run: the architecture from --arch or the preset, the layer count bounded, the checkpoint
written."""

from __future__ import annotations

from tiermoe.errors import TiermoeError
from tiermoe.testing.make_model import make_model
from tiermoe.testing.presets import PRESETS

MAX_TINY_LAYERS = 128  # a debug model deeper than any released one is a typo (and a billion layers fill memory)


def run(args) -> int:
    arch = architecture(args.arch, args.preset)
    limit = PRESETS[args.preset][1]["num_hidden_layers"] if args.preset in PRESETS else MAX_TINY_LAYERS
    if args.layers is not None and args.layers > limit:
        what = f"preset {args.preset} has {limit} layers" if args.preset else f"at most {limit} layers"
        raise TiermoeError(f"--layers {args.layers}: {what} (--layers keeps the first N)")
    overrides = {} if args.top_k is None else {"num_experts_per_tok": args.top_k}
    out = make_model(arch, args.out, preset=args.preset, layers=args.layers, dtype=args.dtype, seed=args.seed,
                     shard_bytes=int(args.shard_gb * 1e9), tokenizer=not args.no_tokenizer, config_overrides=overrides)
    print(f"wrote {out}")
    return 0


def architecture(arch: str | None, preset: str | None) -> str:
    """The model_type to build: --arch, else the preset's; the two must agree when both are given."""
    if preset is None:
        if arch is None:
            raise TiermoeError("give --preset NAME (a released model's shapes) or --arch ARCH (a tiny debug model)")
        return arch
    preset_arch = PRESETS[preset][0]
    if arch is not None and arch != preset_arch:
        raise TiermoeError(f"preset '{preset}' is a {preset_arch} model, not {arch}; leave --arch out")
    return preset_arch
