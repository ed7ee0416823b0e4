"""Expert activation statistics: record them while the engine runs, save and load them, summarise them.

- recording.py: the recorder protocol the engine and HybridMoE blocks drive (PassInfo, NO_RECORDER).
- recorders.py: make_recorder(mode, shape, buffer_size, record_gpu_masks), SGLang's modes; RecorderGroup.
  stat_recorder.py (stat, stat_approx), per_pass_recorder.py, traces.py (per_token trace format),
  gpu_masks.py (GPU-tier snapshots), pass_buffer.py and pass_rows.py (their shared parts), model_shape.py.
- control.py: SGLang's start / stop / dump semantics for the server.
- io.py: load_counts (placement planner), load_stats / save_stats / dump_recorder, the output directory;
  expert_stats.py: one ExpertStats from tiermoe's, SGLang's and KTransformers' files, merging;
  sglang_files.py / sglang_records.py: dumps written in, and read back from, SGLang's per-mode file layouts.
- text_files.py: the text formats (docs/traces.md), told apart by content: trace_csv.py (seq,pos,layer,experts)
  and heat_csv.py (layer,e0,...); trace_import.py reads other tools' layouts, trace_convert.py writes them as text.
- summary.py, plot.py, routing_summary.py: what `tiermoe stats` reports (the strategies' hit rates it shows come
  from tiermoe.analysis.strategy_sweep: statistics record and read, they do not place).
See docs/statistics.md.
"""
