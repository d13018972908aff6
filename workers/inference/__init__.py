"""The inference server: a vLLM engine with LoRA slots behind a small HTTP API, and the adapter-sync receiver."""
