"""The one wire format of an adapter sync round, used by sender and receiver alike.

A round is: a fixed-size length word, the JSON header followed by its MAC, then the buckets (uint8 buffers), each
one broadcast from sync rank 0. The header names every tensor (name, dtype, shape, bucket, byte offset), the
adapter version, the epoch, the LoRA config and a MAC over all buckets. Tensors are packed into few large
buckets so that a round costs a handful of collectives however many LoRA tensors the model has.

The sync port and the store are reachable by whoever can reach the pod (a NetworkPolicy is not enforced by every
CNI), so a round is authenticated end to end under the job's round key (derived from its token): one MAC over the
payload, every bucket byte in wire order, carried in the header, and an HMAC-SHA256 over the whole header, payload
MAC, version and epoch included. The payload's MAC is Poly1305 (six times HMAC-SHA256's speed on a CPU with SHA
extensions: a round's bytes are MAC'd once by the sender and once by each receiver) under a key of the round's
own, HMAC-SHA256 of the round key and a random nonce the header carries, as Poly1305 authenticates one message
per key; where OpenSSL offers no Poly1305 (FIPS mode) the sender MACs the payload with HMAC-SHA256 under the round
key instead, and the header names which. A receiver refuses a header whose MAC does not verify, or whose version
or epoch differ from the ones announced by the token-guarded prepare call, and activates only buckets whose MAC
verifies. A checksum would not do for the payload: CRC-32 and any sum are linear, so whoever can rewrite the
bytes in flight replaces a tensor and fixes up four bytes of padding to keep the checksum (the test
`test_a_linear_fix_up_of_the_payload_is_refused_under_a_genuine_header` does exactly that). Everything a header
says is bounded before anything is allocated from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.poly1305 import Poly1305

from grpolora.api.pool import sync_key

# 2: the header carries a MAC; 3: and a MAC of the payload instead of a checksum; 4: Poly1305; 5: the incarnation
WIRE_VERSION = 5
ALIGN = 64  # bytes; every tensor starts aligned so that a byte view can be reinterpreted as any dtype
MAC_BYTES = 32  # HMAC-SHA256, the header's MAC
NONCE_BYTES = 16  # random per round: 2^-64 odds of a repeat after 2^32 rounds
# The payload's MAC (HMAC-SHA256) is over this tag and then the bucket bytes. A header body is JSON and starts with
# "{", so no header is ever a payload's message and no payload a header's, though one key MACs both.
PAYLOAD_TAG = b"grpolora sync round payload\0"
# A round's Poly1305 key is HMAC-SHA256(round key, this tag + the round's nonce): never a header's MAC either.
POLY1305_KEY_TAG = b"grpolora sync round poly1305 key\0"
PAYLOAD_MAC_ALGORITHMS = ("poly1305", "hmac-sha256")
POLY1305_SLICE_BYTES = 1 << 20
# Bounds on what a header may announce, far above any LoRA adapter (a rank-512 adapter on every linear layer of
# a 70B model is a few GiB in ~600 tensors), checked before allocating anything.
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1 << 16
MAX_BUCKETS = 1 << 12
MAX_NDIM = 8
MAX_ROUND_BYTES = 64 << 30

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a dtype's name as specs and headers write it ("bfloat16", "float16", "float32")."""
    if name not in _DTYPES:
        raise WireError(f"unsupported dtype {name} (one of {sorted(_DTYPES)})")
    return _DTYPES[name]


class WireError(ValueError):
    """A header or buffer that does not follow this format (never activated)."""


def round_key(token: str) -> bytes:
    """The MAC key of sync rounds (header and payload), derived from the job token (one secret, a key per
    purpose). A RolloutPool's servers never see the token: the operator hands them this same key
    (grpolora.api.pool, the one derivation)."""
    return sync_key(token)


def check_header_length(length: int) -> None:
    """A header's length, checked before the header is parsed (it came whole from the store: parsed if in bounds)."""
    if not MAC_BYTES < length <= MAX_HEADER_BYTES + MAC_BYTES:
        raise WireError(f"header length {length} outside (32, {MAX_HEADER_BYTES + MAC_BYTES}] bytes")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes from the start of its bucket
    nbytes: int


@dataclass(frozen=True)
class RoundHeader:
    version: int  # adapter version the receivers will serve after this round
    epoch: int  # sync-group epoch the round belongs to
    incarnation: int  # of the trainer that sent it (AdapterSender): a replica refuses one older than it has seen
    tensors: tuple[TensorEntry, ...]
    bucket_sizes: tuple[int, ...]
    payload_mac: str  # hex MAC of every bucket, in order (PayloadMac)
    payload_mac_algorithm: str  # one of PAYLOAD_MAC_ALGORITHMS
    payload_nonce: str  # hex, NONCE_BYTES: the round's own Poly1305 key comes from it
    adapter_config: Mapping[str, Any] = field(default_factory=dict)  # peft LoraConfig fields
    wire_version: int = WIRE_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def encode(self, key: bytes) -> bytes:
        """The JSON header followed by its MAC under `key` (see round_key)."""
        # Fields by hand: dataclasses.asdict deep-copies every entry, 2.8 of the 3.5 ms a 420-tensor header took.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["tensors"] = [vars(t) for t in self.tensors]  # a TensorEntry's fields are its attributes
        fields["adapter_config"] = dict(self.adapter_config)
        body = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
        return body + hmac.new(key, body, hashlib.sha256).digest()

    @classmethod
    def decode(cls, raw: bytes, key: bytes) -> RoundHeader:
        """Verify the MAC first (nothing of an unauthenticated header is even parsed), then the layout."""
        check_header_length(len(raw))
        body, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), mac):
            raise WireError("header MAC does not verify: not sent by a holder of this job's token")
        try:
            data = json.loads(body)
            if data.get("wire_version") != WIRE_VERSION:
                raise WireError(f"wire version {data.get('wire_version')} is not {WIRE_VERSION}")
            if len(data["tensors"]) > MAX_TENSORS or len(data["bucket_sizes"]) > MAX_BUCKETS:
                raise WireError(f"more than {MAX_TENSORS} tensors or {MAX_BUCKETS} buckets")
            tensors = tuple(
                TensorEntry(
                    name=str(t["name"]),
                    dtype=str(t["dtype"]),
                    shape=tuple(_count(d, "dimension") for d in t["shape"]),
                    bucket=_count(t["bucket"], "bucket"),
                    offset=_count(t["offset"], "offset"),
                    nbytes=_count(t["nbytes"], "nbytes"),
                )
                for t in data["tensors"]
            )
            header = cls(
                version=_count(data["version"], "version"),
                epoch=_count(data["epoch"], "epoch"),
                incarnation=_count(data["incarnation"], "incarnation"),
                tensors=tensors,
                bucket_sizes=tuple(_count(s, "bucket size") for s in data["bucket_sizes"]),
                payload_mac=str(data["payload_mac"]),
                payload_mac_algorithm=str(data["payload_mac_algorithm"]),
                payload_nonce=str(data["payload_nonce"]),
                adapter_config=dict(data.get("adapter_config") or {}),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            if isinstance(exc, WireError):
                raise
            raise WireError(f"malformed round header: {exc}") from None
        header.check_layout()
        return header

    def check_layout(self) -> None:
        """Bounded, and consistent: every tensor has a known dtype, a size matching its shape, and lies inside its
        bucket without overlapping another; every bucket ends where its last tensor does (padded)."""
        check_mac_algorithm(self.payload_mac_algorithm)
        try:
            nonce = bytes.fromhex(self.payload_nonce)
        except ValueError:
            nonce = b""
        if len(nonce) != NONCE_BYTES:
            raise WireError(f"payload nonce {self.payload_nonce!r} is not {NONCE_BYTES} bytes in hex")
        if not self.tensors or len(self.tensors) > MAX_TENSORS:
            raise WireError(f"{len(self.tensors)} tensors (1 to {MAX_TENSORS})")
        if not 0 < len(self.bucket_sizes) <= MAX_BUCKETS:
            raise WireError(f"{len(self.bucket_sizes)} buckets (1 to {MAX_BUCKETS})")
        if self.total_bytes > MAX_ROUND_BYTES:
            raise WireError(f"{self.total_bytes} bytes announced; at most {MAX_ROUND_BYTES}")
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise WireError("a tensor name appears twice")
        ends = [0] * len(self.bucket_sizes)
        for t in sorted(self.tensors, key=lambda t: (t.bucket, t.offset)):
            if t.dtype not in _DTYPES:
                raise WireError(f"tensor {t.name}: unsupported dtype {t.dtype}")
            if len(t.shape) > MAX_NDIM:
                raise WireError(f"tensor {t.name}: {len(t.shape)} dimensions; at most {MAX_NDIM}")
            if not t.bucket < len(self.bucket_sizes):
                raise WireError(f"tensor {t.name}: bucket {t.bucket} of {len(self.bucket_sizes)}")
            elements = 1
            for dim in t.shape:
                elements *= dim
            if elements * _DTYPES[t.dtype].itemsize != t.nbytes:
                raise WireError(f"tensor {t.name}: {t.nbytes} bytes do not hold shape {t.shape} of {t.dtype}")
            if t.offset % ALIGN or t.offset < ends[t.bucket] or t.offset + t.nbytes > self.bucket_sizes[t.bucket]:
                raise WireError(
                    f"tensor {t.name}: bytes [{t.offset}, {t.offset + t.nbytes}) overlap or leave its bucket"
                )
            ends[t.bucket] = t.offset + _padded(t.nbytes)
        for index, (end, size) in enumerate(zip(ends, self.bucket_sizes, strict=True)):
            if end != size:
                raise WireError(f"bucket {index}: {size} bytes announced, its tensors fill {end}")


def _count(value: object, what: str) -> int:
    """A non-negative integer from JSON (never a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError(f"{what} {value!r} is not a non-negative integer")
    return value


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None = None
) -> tuple[list[TensorEntry], list[int]]:
    """Assign each tensor a bucket and offset, in name order, as `dtype` (None: each its own); a tensor larger than
    a bucket gets its own. Raises WireError for what cannot travel."""
    if not tensors:
        raise WireError("nothing to send: the adapter has no tensors")
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    for name in sorted(tensors):
        tensor = tensors[name]
        wire_dtype = dtype or tensor.dtype
        dtype_name = str(wire_dtype).removeprefix("torch.")
        if dtype_name not in _DTYPES:
            raise WireError(f"tensor {name}: unsupported dtype {dtype_name}")
        nbytes = tensor.numel() * wire_dtype.itemsize
        if not sizes or sizes[-1] + _padded(nbytes) > bucket_bytes:
            sizes.append(0)
        entries.append(TensorEntry(name, dtype_name, tuple(tensor.shape), len(sizes) - 1, sizes[-1], nbytes))
        sizes[-1] += _padded(nbytes)
    return entries, sizes


def pack(
    tensors: Mapping[str, torch.Tensor],
    *,
    key: bytes,
    version: int,
    epoch: int,
    bucket_bytes: int,
    incarnation: int = 0,
    device: torch.device | str = "cpu",
    adapter_config: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    reuse: Sequence[torch.Tensor] = (),
    scales: Mapping[str, float] | None = None,
) -> tuple[RoundHeader, list[torch.Tensor]]:
    """Copy the tensors into few uint8 buckets on `device`, as `dtype` (the wire dtype; None: each its own), and
    describe them in a header, with the buckets' MAC under `key` (see round_key).

    The buckets are a copy, never views of the trainer's parameters, so that a member caught up later gets these
    very bytes under the round's version whatever the optimizer has done since; rounded to the wire dtype in that
    one copy, leaving the trainer's float32 master weights as they are.

    `reuse`: buffers of an earlier round that nothing reads any more, packed into where their sizes and device fit
    (writing into fresh memory costs a page fault per page on a CPU). `scales`: factors that the named tensors are
    multiplied by on the way, in their own precision (the multiply takes the copy's place, at no extra cost)."""
    entries, sizes = plan_buckets(tensors, bucket_bytes, dtype)
    spare = {(b.numel(), b.device): b for b in reuse if b.dtype == torch.uint8 and b.is_contiguous()}
    # Padding bytes stay uninitialised: they travel like the rest, and the MAC covers what was sent.
    buckets = [_reused(spare, size, torch.device(device)) for size in sizes]
    write_entries(buckets, entries, tensors, scales)
    algorithm, nonce = PAYLOAD_MAC_ALGORITHM, secrets.token_hex(NONCE_BYTES)
    header = RoundHeader(
        version=version,
        epoch=epoch,
        incarnation=incarnation,
        tensors=tuple(entries),
        bucket_sizes=tuple(sizes),
        payload_mac=payload_mac(buckets, PayloadMac(key, algorithm, nonce)),
        payload_mac_algorithm=algorithm,
        payload_nonce=nonce,
        adapter_config=dict(adapter_config or {}),
    )
    return header, buckets


def write_entries(
    buckets: Sequence[torch.Tensor],
    entries: Sequence[TensorEntry],
    tensors: Mapping[str, torch.Tensor],
    scales: Mapping[str, float] | None = None,
) -> None:
    """The packer, for a round's buckets and a shared payload alike (inference/payload.py: one bucket): each tensor
    copied into its entry's place, as the entry's dtype (rounding on the way), times its scale if it has one."""
    for entry in entries:
        source = tensors[entry.name].detach().reshape(-1)
        view = buckets[entry.bucket][entry.offset : entry.offset + entry.nbytes].view(_DTYPES[entry.dtype])
        # Copied as the dtype into an aligned view: a byte-wise copy is ~100x slower on CPUs.
        scale = scales.get(entry.name) if scales else None
        if scale is None:
            view.copy_(source)
        else:
            torch.mul(source, scale, out=view)


def _reused(spare: dict[tuple[int, torch.device], torch.Tensor], size: int, device: torch.device) -> torch.Tensor:
    """A spare buffer of `size` bytes on `device` (taken out of `spare`), else a new one."""
    buffer = spare.pop((size, device), None)
    return buffer if buffer is not None else torch.empty(size, dtype=torch.uint8, device=device)


def unpack(header: RoundHeader, buckets: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of every tensor inside the received buckets (no copy); verify them first."""
    if len(buckets) != len(header.bucket_sizes):
        raise WireError(f"got {len(buckets)} buckets, the header announced {len(header.bucket_sizes)}")
    result = {}
    for entry in header.tensors:
        raw = buckets[entry.bucket][entry.offset : entry.offset + entry.nbytes]
        result[entry.name] = raw.view(_DTYPES[entry.dtype]).view(entry.shape)
    return result


def verify(header: RoundHeader, buckets: Sequence[torch.Tensor], key: bytes, *, computed: str | None = None) -> None:
    """Raise WireError unless the buckets are exactly what the header announced, as MAC'd under `key`.
    `computed`: the MAC already accumulated while the bytes arrived (see PayloadMac), instead of a second pass."""
    sizes = tuple(int(b.numel()) for b in buckets)
    if sizes != header.bucket_sizes:
        raise WireError(f"bucket sizes {sizes} differ from the announced {header.bucket_sizes} (short transfer)")
    if computed is None:
        computed = payload_mac(buckets, PayloadMac.of(header, key))
    if not hmac.compare_digest(computed, header.payload_mac):
        raise WireError("payload MAC does not verify: the buckets are not the bytes the header's sender MAC'd")


def payload_mac(buckets: Sequence[torch.Tensor], mac: PayloadMac) -> str:
    """The MAC of a whole payload, in one pass."""
    for bucket in buckets:
        mac.update(bucket)
    return mac.hexdigest()


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself on a CPU, else a copy of it there."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


# A GPU tensor's bytes reach the MAC through a page-locked buffer of this size that each thread reuses: on an H200,
# 87 MB came to the host in 1.6 ms page-locked against 75 ms into pageable memory (`.cpu()`), which was most of the
# sender's MAC (BENCHMARKS.md, GPU figures at scale).
HOST_STAGING_BYTES = 16 << 20


class _Staging(threading.local):
    buffer: torch.Tensor | None = None


_STAGING = _Staging()


def _staging_buffer() -> torch.Tensor:
    if _STAGING.buffer is None:
        try:
            _STAGING.buffer = torch.empty(HOST_STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: pageable, as `.cpu()` would give
            _STAGING.buffer = torch.empty(HOST_STAGING_BYTES, dtype=torch.uint8)
    return _STAGING.buffer


def host_chunks(tensor: torch.Tensor) -> Iterator[memoryview]:
    """`tensor`'s bytes on the host, in order: a CPU tensor's own memory, else staged chunks (staged_chunks)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        yield memoryview(flat.numpy()).cast("B")
    else:
        yield from staged_chunks(flat, _staging_buffer())


def staged_chunks(flat: torch.Tensor, staging: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of `flat` (uint8) copied chunk by chunk into `staging` (host memory): each chunk is valid until
    the next one is asked for."""
    for start in range(0, flat.numel(), staging.numel()):
        part = flat[start : start + staging.numel()]
        chunk = staging[: part.numel()]
        chunk.copy_(part)
        yield memoryview(chunk.numpy()).cast("B")


def check_mac_algorithm(algorithm: str) -> None:
    if algorithm not in PAYLOAD_MAC_ALGORITHMS:
        raise WireError(f"payload MAC algorithm {algorithm!r} (one of {PAYLOAD_MAC_ALGORITHMS})")


def poly1305_available() -> bool:
    """Whether this OpenSSL offers Poly1305 (not in FIPS mode)."""
    try:
        Poly1305(bytes(32))
    except UnsupportedAlgorithm:
        return False
    return True


class PayloadMac:
    """The payload's MAC, fed piece by piece in wire order, so a receiver checks each piece while the next one
    arrives. Poly1305 at ~7 GB/s on one core here; HMAC-SHA256, the fallback, ~1.1 GB/s with SHA extensions
    (BENCHMARKS.md). Buffers on a GPU are copied to the host chunk by chunk first (host_chunks): a MAC is host work."""

    def __init__(self, key: bytes, algorithm: str, nonce: str) -> None:
        check_mac_algorithm(algorithm)
        self._digest: Callable[[], bytes]
        self._slice: int | None = None
        if algorithm == "poly1305":
            one_time_key = hmac.new(key, POLY1305_KEY_TAG + bytes.fromhex(nonce), hashlib.sha256).digest()
            poly = Poly1305(one_time_key)
            # cryptography holds the GIL while Poly1305 runs (OpenSSL's HMAC drops it): fed a slice at a time, it
            # never stops the process's other threads (vLLM's engine loop, in a member) for more than ~0.2 ms.
            self._update, self._digest, self._slice = poly.update, poly.finalize, POLY1305_SLICE_BYTES
        else:  # hmac-sha256
            mac = hmac.new(key, PAYLOAD_TAG, hashlib.sha256)
            self._update, self._digest = mac.update, mac.digest
        self._result: str | None = None

    @classmethod
    def of(cls, header: RoundHeader, key: bytes) -> PayloadMac:
        """The MAC a receiver checks `header`'s payload with; WireError if it cannot (a sender chooses what it has)."""
        if header.payload_mac_algorithm == "poly1305" and not poly1305_available():
            raise WireError("the round's payload MAC is Poly1305, and Poly1305 is not available here (FIPS mode?)")
        return cls(key, header.payload_mac_algorithm, header.payload_nonce)

    def update(self, piece: torch.Tensor) -> None:
        for data in host_chunks(piece):
            step = self._slice or len(data) or 1
            for start in range(0, len(data), step):
                self._update(data[start : start + step])

    def hexdigest(self) -> str:
        """The MAC of everything fed so far; nothing may be fed after."""
        if self._result is None:
            self._result = self._digest().hex()
        return self._result


# Poly1305 wherever OpenSSL offers it, as in every wheel of `cryptography`; HMAC-SHA256 under FIPS.
PAYLOAD_MAC_ALGORITHM = "poly1305" if poly1305_available() else "hmac-sha256"
