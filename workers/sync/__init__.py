"""Adapter sync: trainer rank 0 sends LoRA tensors to every inference replica over a collective.

- `wire`: the one format (MAC'd header + packed buckets + the buckets' MAC) and the one packer, shared by both sides
  (a replica's shared payload, inference/payload.py, is the wire layout of one bucket).
- `transport`: the interface over a collective; `gloo` (CPU) and `nccl` (GPU) implement it, one file each; `groups`
  forms an epoch's group; `watchdog` cuts a stalled round. Both ends of the group run them.
- `sender`: trainer rank 0's process (its main thread and the rollout producer's).
- `receiver`: each replica's sync member, in vLLM's TP rank 0 worker process (inference/member_host.py), not in the
  replica's HTTP process.
- `control`: the control messages and errors: trainer rank 0 (HttpMember), the replica's HTTP process (the API) and
  its member (over the member's sockets).
The round protocol is written against the transport interface, so the same code runs over either transport.
"""
