"""The trainer: PEFT LoRA on the base model, GRPO math, the training step, checkpoints."""
