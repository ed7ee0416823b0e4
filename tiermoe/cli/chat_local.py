"""`tiermoe chat --local [DIR]`: replies from a model loaded in this process (the bundled demo model without DIR).

Imported only with --local (tiermoe.cli.chat_cmd's BACKENDS): it loads torch and transformers, which a chat with a
server never needs. The engine runs in this thread, one step at a time, so a stop asked for (Ctrl-C sets `stop`)
takes effect between two steps, and the reply's speed is read off the same loop.
"""

from __future__ import annotations

import sys
import threading
import time

from tiermoe.cli.chat_backends import Delta, ReplyStats
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.config import check_device
from tiermoe.engine.llm import LLM
from tiermoe.engine.text_stream import TextStream
from tiermoe.errors import TiermoeError


class LocalChat:
    """The model loaded in this process."""

    stops_between_tokens = True  # Ctrl-C sets a flag read between engine steps (tiermoe.cli.chat_terminal)

    def __init__(self, args):
        self.llm = LLM(args.local or None, gpu_device=check_device(args.gpu_device), progress=sys.stderr.isatty(),
                       cpu=cpu_from_args(args))
        self.args = args
        self.model = self.llm.model_dir.name
        self.stats: ReplyStats | None = None

    def connect(self) -> str:
        return self.model

    def reply(self, messages: list[dict], stop: threading.Event):
        """Text deltas of the reply to `messages`, until it ends or `stop` is set; then `self.stats` holds its
        speed (prompt tokens, time to the first token, decode tokens and time)."""
        # top_p and top_k from the checkpoint's generation_config.json; temperature is kt chat's (-t, 0.7)
        sampling = self.llm.default_sampling(max_tokens=self.args.max_tokens, temperature=self.args.temperature)
        prompt_ids = self.llm.chat_prompt_ids(messages)
        engine = self.llm.engine
        self.stats = None
        started = time.monotonic()
        seq = engine.add(prompt_ids, sampling)
        text = TextStream(engine.decoded_text(seq), sampling.stop)
        first = None
        try:
            while not seq.finished and not stop.is_set():
                if seq in engine.step():
                    first = first or time.monotonic()
                    delta = text.delta(seq.output_ids, seq.finished, seq.stop_text_end)
                    if delta:
                        yield Delta(delta)
            if seq.finish_reason == "error":
                raise (TiermoeError if seq.error_from_request else RuntimeError)(f"generation failed: {seq.error}")
            if first is not None:
                self.stats = ReplyStats(len(prompt_ids), first - started, len(seq.output_ids) - 1,
                                        time.monotonic() - first)
        finally:
            if not seq.finished:
                engine.abort(seq)

    def describe(self) -> str:
        return f"{self.model} in this process"

    def close(self):
        self.llm.close()
