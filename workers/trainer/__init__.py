"""The trainer role: PEFT LoRA on the base model, the GRPO math (grpo.py), the step, checkpoints, the loop."""
