"""The trainer role: PEFT LoRA on the base model, the GRPO math (grpo.py) and the step that applies it."""
