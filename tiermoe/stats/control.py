"""SGLang's recorder controls over a tiermoe recorder: what /start_, /stop_ and /dump_expert_distribution_record do.

- start: forget what was recorded, then record (SGLang resets on start);
- stop: stop recording, keep what was recorded;
- dump: write the files in SGLang's layout (to $TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR, else
  $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp), then forget what was recorded; returns the paths written
  (the counts file, then `gpu_expert_distribution_{time}.pt` when GPU-tier snapshots are recorded).
As in SGLang, a server's recorder starts stopped (`recording=False`) until /start is called. These calls should
run between engine steps (e.g. on the engine's own thread) so a pass is never half counted.
"""

from __future__ import annotations

from pathlib import Path

from tiermoe.stats.io import default_dump_path, write_dump


class RecorderControl:
    def __init__(self, recorder, recording: bool = False, output_dir: str | Path | None = None):
        self.recorder = recorder
        self.output_dir = Path(output_dir) if output_dir is not None else None
        if not recording:
            recorder.stop()

    def start(self) -> None:
        self.recorder.reset()
        self.recorder.start()

    def stop(self) -> None:
        self.recorder.stop()

    def dump(self) -> list[Path]:
        dump = self.recorder.dump()
        path = default_dump_path(mode=dump.get("mode"))
        if self.output_dir is not None:
            path = self.output_dir / path.name
        written = write_dump(dump, path)
        self.recorder.reset()
        return written
