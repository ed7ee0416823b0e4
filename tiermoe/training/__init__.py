"""Fine-tuning a hybrid model: LoRA on attention, dense projections and routed experts of both tiers.

- lora.py: apply_lora (a PEFT LoraConfig applied as PEFT applies it; routed experts get tiermoe's ExpertLoRA);
  lora_fields.py: every LoraConfig field honoured for modules and experts alike, or refused naming it.
- adapter_switch.py: adapters off, or a frozen copy active, expert LoRA included (DPO's reference).
- peft_layout.py, adapter_*.py: adapters in PEFT's layout (save_adapter / load_adapter, merging for serving).
- chat_sft.py: chat conversations as examples (the chat template's tokens, loss on the replies), batches.
- sft_loop.py: the training loop (AdamW, warmup + cosine, reply-token loss) and the held-out evaluation.
- checkpoints.py: adapter, optimizer, schedule, data position and generators, for an exact resume.
- finetune_data.py, finetune.py: a whole `tiermoe finetune` run as a library call.
- kt_env.py: KTransformers' ACCELERATE_KT_* settings with KT's meanings and defaults (flags win).
- long_context.py: the CPU tier's span of tokens in training (set_expert_chunk); context_memory.py: a step's host
  bytes by term, measured on copies of the model's first layers (`tiermoe fit --train`).
"""
