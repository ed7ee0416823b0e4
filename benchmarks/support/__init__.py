"""What several benchmarks share: alternating decode rounds and the load average (decode_rounds.py), a sampler of a
process tree's resident memory (rss_sampler.py), an fp32 view of a checkpoint (fp32_checkpoint.py)."""
