"""Loading checkpoints into tiers: safetensors reading, the model skeleton, the loader."""
