"""bench_e2e_cpu.py's figures turned into what it prints: derived figures (share of the read probe's floor, the
measured time outside the kernels per layer), the issue's goals with the figure each was judged on, and the
markdown tables. Pure functions over the results dict the benchmark also writes as JSON, so they are tested
without llama.cpp or a model.

results = {"machine": {"read_bandwidth": bytes/s, ...},
           "rows": [{"model", "format" ("bf16" | "4-bit"), "layers", optional "host_bound" (a model of next to no
                     bytes, whose weights sit in cache: the ratio to llama.cpp alone is judged there, the
                     floor goal elsewhere),
                     optional "round_read_rates" [bytes/s: the read probe of each round, on tiermoe's team right
                     after its round],
                     "backends": {label: {"decode_tok_s", "ttft16_s", "prefill512_tok_s" (medians of the rounds;
                                          "rounds" {figure: every value}, "spread" {figure: [min, max]}),
                                          "bytes_per_token",
                                          optional "components_ms" {part: ms per step, "native" and
                                          "outside_native" among them}, "ops_per_layer"}}}],
           "loss": [{"model", "vocab", "tokens", "tiermoe bf16", "tiermoe 4-bit", "llama.cpp bf16",
                     "llama.cpp Q4_K_M"}]}
A backend that did not run is absent; a figure that was not measured is absent or None.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

LLAMA = "llama.cpp"
TIERMOE = "tiermoe"
NO_REPACK = "without its weight repacking"  # a backend's "path" where llama.cpp's repack path failed

# the goals of the issue "Decode at the memory's pace"
FLOOR_SHARE = 0.85  # decode's share of the read probe's floor, on every model whose bytes are not next to nothing
DECODE_VS_LLAMA = 1.2  # judged where llama.cpp reads below LLAMA_FLOOR_SHARE of the floor, and on the thin model
LLAMA_FLOOR_SHARE = 0.70
TTFT_VS_LLAMA = 1.0
PREFILL_VS_LLAMA = 2.0
BATCHED_SHARE = 0.80  # 8 sequences together: the least their step reads, at the probe's rate, over its time
LOSS_MARGIN = 0.01  # nats


@dataclass
class Goal:
    words: str
    measured: str  # the figures it was judged on, one per row
    reached: bool | None  # None: not measured (a side missing)


ROUND_FIGURES = ("decode_tok_s", "ttft16_s", "prefill512_tok_s")  # measured once per round


def keep_round(figures: dict, new: dict) -> None:
    """Add one round's figures: each figure is the median of the rounds so far, its spread [min, max] beside it
    (figures["rounds"][key]: every round's value, in order)."""
    rounds = figures.setdefault("rounds", {})
    for key, value in new.items():
        rounds.setdefault(key, []).append(value)
        figures[key] = statistics.median(rounds[key])
        figures.setdefault("spread", {})[key] = [min(rounds[key]), max(rounds[key])]


def _with_spread(b: dict, key: str, spec: str, scale: float = 1.0) -> str:
    """'median (min-max)' of a figure measured each round; just the figure when there was one round."""
    value, spread = b.get(key), b.get("spread", {}).get(key)
    if value is None:
        return "-"
    text = format(value * scale, spec)
    if spread and len(b["rounds"][key]) > 1:
        text += f" ({format(spread[0] * scale, spec)}-{format(spread[1] * scale, spec)})"
    return text


def floor_tok_s(backend: dict, bandwidth: float) -> float | None:
    """Tokens/s if a decode step only read its weights and KV at the measured read bandwidth."""
    read = backend.get("bytes_per_token")
    return bandwidth / read if read and bandwidth else None


def paired_floor_share(backend: dict, round_rates: list[float] | None) -> float | None:
    """Decode's share of the floor round by round: each round's decode rate against the floor at the read rate
    probed in that same round, the median of the rounds. The machine's read rate moves (33-47 GB/s within a
    minute on the 2-core VMs this was written on), so this is the share at the rate the round saw, where the
    floor of the run's best probe is the conservative one; None where either is missing."""
    decodes, read = backend.get("rounds", {}).get("decode_tok_s"), backend.get("bytes_per_token")
    pairs = [(d, r) for d, r in zip(decodes or [], round_rates or []) if d and r]
    return statistics.median(d * read / r for d, r in pairs) if pairs and read else None


def host_us_per_layer(backend: dict, layers: int) -> float | None:
    """Per layer, the measured part of a decode step outside the kernel library's calls (Python, torch's own ops,
    the engine: components_ms "outside_native", timed by wrapping the library's entries); None where a backend
    was not profiled (llama.cpp)."""
    outside = backend.get("components_ms", {}).get("outside_native")
    return None if outside is None else outside / layers * 1e3


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def batched_share(backend: dict, bandwidth: float) -> tuple[float, float, float] | None:
    """(median step seconds, the bound: its least bytes at `bandwidth`, seconds; bound / step) of the batched
    rounds, or None where none ran."""
    rounds = backend.get("batched_rounds")
    if not rounds or not bandwidth:
        return None
    step = statistics.median(r["step_s"] for r in rounds)
    bound = statistics.median(r["bytes"] for r in rounds) / bandwidth
    return step, bound, bound / step


def _row_name(row: dict) -> str:
    return f"{row['model']} {row['format']}"


def evaluate_goals(results: dict) -> list[Goal]:
    """Each goal of the issue, judged on every row that has both sides; a goal is reached when every row meets it."""
    bandwidth = results["machine"].get("read_bandwidth") or 0.0
    per_goal: dict[str, list[tuple[str, str, bool | None]]] = {}

    def judge(words: str, row: dict, figure: float | None, text: str, ok: bool | None) -> None:
        per_goal.setdefault(words, []).append((_row_name(row), text if figure is not None else "not measured",
                                              ok if figure is not None else None))

    for row in results["rows"]:
        ours, theirs = row["backends"].get(TIERMOE, {}), row["backends"].get(LLAMA, {})
        decode = _ratio(ours.get("decode_tok_s"), theirs.get("decode_tok_s"))
        theirs_share = _ratio(theirs.get("decode_tok_s"), floor_tok_s(theirs, bandwidth))
        words = (f"{row['format']} decode >= {DECODE_VS_LLAMA:.1f}x llama.cpp where llama.cpp reads below "
                 f"{LLAMA_FLOOR_SHARE:.0%} of the floor (on the thin model always)")
        if row.get("host_bound") or theirs_share is None or theirs_share < LLAMA_FLOOR_SHARE:
            judge(words, row, decode, f"{decode:.2f}x" if decode else "", decode is not None and
                  decode >= DECODE_VS_LLAMA)
        else:  # llama.cpp is near the floor: only the floor goal can ask more of this row
            text = f"{decode:.2f}x, not judged: llama.cpp at {theirs_share:.0%} of the floor"
            per_goal.setdefault(words, []).append((_row_name(row), text, None))
        if not row.get("host_bound"):
            share = _ratio(ours.get("decode_tok_s"), floor_tok_s(ours, bandwidth))
            judge(f"decode >= {FLOOR_SHARE:.0%} of the read probe's floor", row, share,
                  f"{share:.0%}" if share else "", share is not None and share >= FLOOR_SHARE)
        batched = batched_share(ours, bandwidth)
        if not row.get("host_bound") and batched is not None:
            judge(f"8 sequences together >= {BATCHED_SHARE:.0%} of their step's bytes-read bound", row, batched[2],
                  f"{batched[2]:.0%}", batched[2] >= BATCHED_SHARE)
        ttft = _ratio(ours.get("ttft16_s"), theirs.get("ttft16_s"))
        judge(f"time to first token (16-token prompt) <= {TTFT_VS_LLAMA}x llama.cpp's", row, ttft,
              f"{ttft:.2f}x" if ttft else "", ttft is not None and ttft <= TTFT_VS_LLAMA)
        prefill = _ratio(ours.get("prefill512_tok_s"), theirs.get("prefill512_tok_s"))
        judge(f"prefill 512 >= {PREFILL_VS_LLAMA}x llama.cpp", row, prefill,
              f"{prefill:.2f}x" if prefill else "", prefill is not None and prefill >= PREFILL_VS_LLAMA)
    for loss in results.get("loss", []):
        ours, theirs = loss_deltas(loss)
        figure = None if ours is None or theirs is None else ours - theirs
        per_goal.setdefault(f"4-bit held-out loss <= llama.cpp Q4_K_M's + {LOSS_MARGIN} nats (vs each bf16)",
                            []).append((loss["model"], "not measured" if figure is None else
                                        f"{ours:+.4f} vs {theirs:+.4f}",
                                        None if figure is None else figure <= LOSS_MARGIN))
    goals = []
    for words, judged in sorted(per_goal.items(), key=lambda item: _goal_order(item[0])):
        verdicts = [ok for _, _, ok in judged]
        reached = None if all(ok is None for ok in verdicts) else all(ok is not False for ok in verdicts)
        goals.append(Goal(words, ", ".join(f"{name} {text}" for name, text, _ in judged), reached))
    return goals


def _goal_order(words: str) -> int:
    """The issue's order: decode bf16, decode 4-bit, floor, batched, first token, prefill, loss."""
    for i, start in enumerate(("bf16 decode", "4-bit decode", "decode >=", "8 sequences", "time to first",
                               "prefill")):
        if words.startswith(start):
            return i
    return 6


def loss_deltas(loss: dict) -> tuple[float | None, float | None]:
    """(tiermoe 4-bit - tiermoe bf16, Q4_K_M - llama.cpp bf16) in nats; None where a side is missing."""
    def delta(quant, full):
        return loss[quant] - loss[full] if loss.get(quant) is not None and loss.get(full) is not None else None
    return delta("tiermoe 4-bit", "tiermoe bf16"), delta("llama.cpp Q4_K_M", "llama.cpp bf16")


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    """A ratio against llama.cpp as the table shows it ("-" where a side is missing)."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def speed_table(results: dict) -> list[str]:
    bandwidth = results["machine"].get("read_bandwidth") or 0.0
    lines = ["| model | format | backend | decode tok/s | vs llama.cpp | of floor | of its round's probe | TTFT 16 ms | "
             "vs llama.cpp | prefill 512 tok/s | vs llama.cpp | outside the kernels, us/layer | torch ops/layer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        ref = row["backends"].get(LLAMA, {})
        for label, b in row["backends"].items():
            host = host_us_per_layer(b, row["layers"])
            ttft = b.get("ttft16_s")
            shown = f"{label} ({b['path']})" if b.get("path") else label
            lines.append(
                f"| {row['model']} | {row['format']} | {shown} | {_with_spread(b, 'decode_tok_s', '.1f')} | "
                f"{_times(_ratio(b.get('decode_tok_s'), ref.get('decode_tok_s')))} | "
                f"{_fmt(_ratio(b.get('decode_tok_s'), floor_tok_s(b, bandwidth)), '.0%')} | "
                f"{_fmt(paired_floor_share(b, row.get('round_read_rates')), '.0%')} | "
                f"{_with_spread(b, 'ttft16_s', '.1f', 1e3)} | {_times(_ratio(ttft, ref.get('ttft16_s')))} | "
                f"{_with_spread(b, 'prefill512_tok_s', '.0f')} | "
                f"{_times(_ratio(b.get('prefill512_tok_s'), ref.get('prefill512_tok_s')))} | "
                f"{_fmt(host, '.0f')} | "
                f"{_fmt(b.get('ops_per_layer'), '.0f')} |")
    return lines


def component_table(results: dict) -> list[str]:
    """ms per decode step of one sequence by part, for the backends that reported parts (tiermoe's)."""
    parts = ("lm_head", "attention", "experts", "fused_layers", "rest", "native", "outside_native")
    lines = ["| model | format | backend | step ms | LM head | attention | experts (MoE blocks) | whole layers (one "
             "native call: attention + experts) | rest (norms, embedding, engine, sampling) | inside the kernels | "
             "outside the kernels |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        for label, b in row["backends"].items():
            comp = b.get("components_ms")
            if comp:
                lines.append(f"| {row['model']} | {row['format']} | {label} | {comp['step']:.2f} | "
                             + " | ".join(f"{comp.get(p, 0.0):.2f}" for p in parts) + " |")
    return lines


def batched_table(results: dict) -> list[str]:
    """tiermoe's 8 sequences decoding together against the least their step reads."""
    bandwidth = results["machine"].get("read_bandwidth") or 0.0
    lines = ["| model | format | backend | step ms (8 sequences) | experts per MoE layer (union) | MB read at least | "
             "bound ms (at the probe's rate) | of the bound |", "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        for label, b in row["backends"].items():
            figures = batched_share(b, bandwidth)
            if figures is None:
                continue
            rounds = b["batched_rounds"]
            steps = [r["step_s"] * 1e3 for r in rounds]
            experts = statistics.median(r["experts_per_layer"] for r in rounds)
            megabytes = statistics.median(r["bytes"] for r in rounds) / 1e6
            lines.append(f"| {row['model']} | {row['format']} | {label} | {figures[0] * 1e3:.1f} "
                         f"({min(steps):.1f}-{max(steps):.1f}) | {experts:.1f} | {megabytes:.0f} | "
                         f"{figures[1] * 1e3:.1f} | {figures[2]:.0%} |")
    return lines


def loss_table(results: dict) -> list[str]:
    lines = ["| model | scored tokens | log(vocab) | tiermoe bf16 | tiermoe 4-bit | change | llama.cpp bf16 | "
             "Q4_K_M | change |", "|---|---|---|---|---|---|---|---|---|"]
    for loss in results.get("loss", []):
        ours, theirs = loss_deltas(loss)
        lines.append(f"| {loss['model']} | {loss.get('tokens', '-')} | {math.log(loss['vocab']):.4f} | "
                     f"{_fmt(loss.get('tiermoe bf16'), '.4f')} | {_fmt(loss.get('tiermoe 4-bit'), '.4f')} | "
                     f"{_fmt(ours, '+.4f')} | {_fmt(loss.get('llama.cpp bf16'), '.4f')} | "
                     f"{_fmt(loss.get('llama.cpp Q4_K_M'), '.4f')} | {_fmt(theirs, '+.4f')} |")
    return lines


def goal_table(goals: list[Goal]) -> list[str]:
    verdict = {True: "yes", False: "**no**", None: "not measured"}
    return ["| goal | measured | reached |", "|---|---|---|"] + [
        f"| {g.words} | {g.measured} | {verdict[g.reached]} |" for g in goals]


def report(results: dict) -> str:
    """Every table, markdown."""
    sections = [("Speed (median of the alternating rounds, min-max in brackets; ratios of the medians against "
                 "llama.cpp on the same model)", speed_table(results)),
                ("Time per part of one decode step", component_table(results)),
                ("Batched decode: 8 sequences together against the least their step reads (median of the rounds)",
                 batched_table(results))]
    if results.get("loss"):
        sections.append(("Held-out loss (nats), each 4-bit form against its own bf16 model", loss_table(results)))
    sections.append(("Goals", goal_table(evaluate_goals(results))))
    return "\n\n".join(title + "\n\n" + "\n".join(lines) for title, lines in sections if len(lines) > 2)
