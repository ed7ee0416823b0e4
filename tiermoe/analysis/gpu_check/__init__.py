"""The GPU check: what `benchmarks/gpu_check.sh` runs on a machine with a GPU, in one call
(`python -m tiermoe.analysis.gpu_check`, main.py).

- plan.py: the checks in the order of what their results are worth, with their budgets;
- runner.py and child.py: each check in its own process, within its budget, a line per check as it ends;
- models.py: the run's checkpoints (make-model, written once before any timed check);
- the checks by theme: env.py, exact.py, attention.py, syncs.py, copies.py, items.py, memory.py, profile.py.
"""
