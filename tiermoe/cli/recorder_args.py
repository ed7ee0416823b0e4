"""The expert distribution recorder the recorder flags ask for (tiermoe.cli.recorder_flags), checked against this
machine's memory. Run-side: imports the recorders (torch).
"""

from __future__ import annotations

from tiermoe.errors import TiermoeError
from tiermoe.fit import available_ram
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder

# bytes a buffered pass takes per (layer, expert): the stat recorder's int32 prefill and decode counts
BYTES_PER_PASS_CELL = 8


def recorder_from_args(args, spec):
    """The recorder these flags ask for; `spec` is the model's ArchSpec (or a tiermoe.stats ModelShape)."""

    shape = spec if isinstance(spec, ModelShape) else ModelShape.of(spec)
    check_buffer_memory(args, shape)
    return make_recorder(args.recorder_mode, shape, args.recorder_buffer_size, args.record_gpu_masks)


def check_buffer_memory(args, shape: ModelShape) -> None:
    """A circular buffer of N passes is allocated whole on the first pass: refuse an N whose buffer this
    machine's free memory cannot hold (per_token buffers grow with the tokens instead)."""
    size, free = args.recorder_buffer_size or 0, available_ram()
    if args.recorder_mode is None or free is None or size <= 0 or (
            args.recorder_mode == "per_token" and not args.record_gpu_masks):
        return
    needed = size * shape.num_layers * shape.num_experts * BYTES_PER_PASS_CELL
    if needed > free:
        raise TiermoeError(f"--expert-distribution-recorder-buffer-size {size} keeps {size} passes of "
                           f"[{shape.num_layers}, {shape.num_experts}] counts: {needed / 2**30:,.1f} GiB, more than "
                           f"the {free / 2**30:,.1f} GiB available; use fewer passes or -1 (unbounded: grows as it "
                           "records)")
