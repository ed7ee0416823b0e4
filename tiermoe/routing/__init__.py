"""Routing: what recorded or published traces say about how a model spreads tokens over its experts, and
synthetic routing with the same statistics. It reads the files tiermoe.stats writes; nothing in tiermoe.stats
imports it.

- balance.py: how evenly one layer spreads tokens (Gini, top share, max/min);
  measures.py: the per-token measures that decide how placement fares (skew, hot-set transfer, reuse by lag);
  summary.py: what `tiermoe stats` reports (per-layer skew, dead experts, prefill vs decode).
- generator.py: synthetic per-token routing; fit.py fits its parameters to real traces by simulation, against
  statistics.py (the statistics measured the same way on any traces), from sources.py (per-task trace folders);
  presets.py holds the fitted parameters; write.py writes generated routing as a trace CSV.
- trace_import.py: routing published by other tools (ESFT, route traces, SGLang dumps) read into tiermoe's trace
  dict; trace_convert.py (`tiermoe trace convert`) writes them as the text formats of docs/traces.md.
"""
