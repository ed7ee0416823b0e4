"""Fine-tuning: LoRA SFT of a hybrid model whose experts live on two tiers.

- chat_sft.py: chat conversations as examples (the chat template's tokens, loss on the replies), batches.
- kt_env.py: KTransformers' ACCELERATE_KT_* settings with KT's meanings and defaults (flags win).
"""
