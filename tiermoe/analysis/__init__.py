"""Analysis above the core: everything that replays, sweeps, benchmarks and fits, and the `tiermoe bench ...`
commands' engines (tables and plots). Nothing in the core imports it. The one cost model they all time with, and
that the adaptive policy decides with, is core: tiermoe.placement.pass_cost; here are only its measurements and fits.

- trace_replay.py: a recorded per_token trace replayed pass by pass through a placement policy;
  dynamic_bench.py: `tiermoe bench dynamic` (every policy at every GPU ratio).
- strategy_sweep.py: every placement strategy's hit rate by GPU ratio (what `tiermoe stats` shows).
- placement_bench.py: `tiermoe bench placement`, with its workloads (placement_workload), timed serving
  (workload_runs, placement_live, placement_lockstep), exact traffic of a placement (placement_traffic), the
  measurements the cost model is fitted on (tier_time_fit, host_cost_fit, model_op_count, device_profile,
  core_split), and its output (placement_result, placement_report).
- gpu_check/: `python -m tiermoe.analysis.gpu_check` (benchmarks/gpu_check.sh), the one GPU run.
"""
