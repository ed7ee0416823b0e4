"""Fine-tuning a hybrid model: LoRA on attention, dense projections and routed experts of both tiers.

- lora.py: LoRASettings and apply_lora (PEFT LoRA on modules, tiermoe's expert LoRA on routed experts).
- chat_sft.py: chat conversations as examples (the chat template's tokens, loss on the replies), batches.
- kt_env.py: KTransformers' ACCELERATE_KT_* settings with KT's meanings and defaults (flags win).
"""
