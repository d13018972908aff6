"""grpo-lora-operator: GRPO with LoRA where only the adapter travels from trainer to vLLM, over a collective.

`grpolora.api` is the torch-free core (job schema, plan, env contract) shared by the operator and the workers.
"""

__version__ = "0.1.0"
