"""Fine-tuning a hybrid model: LoRA on attention, dense projections and routed experts of both tiers."""
