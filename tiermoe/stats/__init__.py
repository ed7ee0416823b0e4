"""Expert activation statistics: recording them while the engine runs, and the files they are kept in.

- recording.py: the recorder protocol the engine and HybridMoE blocks drive (PassInfo, NO_RECORDER);
  pass_transaction.py holds a pass's records until the pass succeeded.
- recorders.py: make_recorder(mode, shape, buffer_size, record_gpu_masks), SGLang's modes; RecorderGroup.
  stat_recorder.py (stat, stat_approx), per_pass_recorder.py, traces.py (per_token), gpu_mask_recorder.py
  (GPU-tier snapshots), pass_buffer.py and pass_rows.py (their shared parts), model_shape.py; tier_hits.py
  counts the GPU tier's share while serving.
- control.py: SGLang's start / stop / dump semantics for the server.
- The files: io.py (load_counts for the placement planner, load_stats / save_stats / dump_recorder, the output
  directory); stat_header.py (the fields every dump starts with); expert_stats.py (one ExpertStats from tiermoe's,
  SGLang's and KTransformers' files, merging); sglang_files.py / sglang_records.py (SGLang's per-mode layouts);
  text_files.py (the text formats of docs/traces.md, told apart by content): trace_csv.py (seq,pos,layer,experts)
  and heat_csv.py (layer,e0,...).
What the statistics say about routing (measures, summaries, the generator, other tools' traces) is
tiermoe.routing. See docs/statistics.md.
"""
