"""Adapter sync: trainer rank 0 sends LoRA tensors to every inference replica over a collective.

- `wire`: the one format (MAC'd header + packed buckets + the buckets' MAC), shared by both sides.
- `transport`: the interface over a collective; `gloo` (CPU) and `nccl` (GPU) implement it, one file each.
- `sender` (trainer rank 0) and `receiver` (inference server): the round protocol, epochs and membership,
  written against the interface so the same code runs over either transport.
"""
