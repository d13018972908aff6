"""The sync protocol over real gloo collectives and a real TCP store, in one process: a sender and receivers on
threads, with recording sinks instead of vLLM (tests/workers/test_inference_sync.py covers real servers)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import hmac
import json
import re
import threading
import time
import zlib

import pytest
import torch
import torch.distributed as dist

from grpolora.api.load import parse_job
from grpolora.workers.adapter import lora_scaling
from grpolora.workers.sync import wire
from grpolora.workers.sync.control import (
    FingerprintMismatch,
    JoinRequest,
    PrepareRequest,
    StaleIncarnation,
    SyncError,
)
from grpolora.workers.sync.receiver import AdapterReceiver
from grpolora.workers.sync.sender import AdapterSender, send_round
from grpolora.workers.sync.transport import Transport, TransportError, connect_store, epoch_store
from grpolora.workers.tasks import Prompt
from grpolora.workers.trainer.buffer import RolloutBuffer
from grpolora.workers.trainer.producer import ROUND_ATTEMPTS, RolloutProducer
from grpolora.workers.trainer.rollout import Completion, ReplicasLost, RolloutError
from tests.helpers import job_doc
from tests.workers.syncfakes import (  # noqa: F401 (nccl_abort_semantics: a fixture)
    LORA_SCALINGS,
    LocalMember,
    RecordingSink,
    free_port,
    gloo_sender,
    nccl_abort_semantics,
)

TIMEOUT = 3.0
TOKEN = "job-token"
KEY = wire.round_key(TOKEN)


def eventually(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)


def adapter(seed: int, layers: int = 4, width: int = 64, rank: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        tensors[f"base_model.model.layers.{i}.q_proj.lora_A.weight"] = torch.randn(rank, width, generator=g)
        tensors[f"base_model.model.layers.{i}.q_proj.lora_B.weight"] = torch.randn(width, rank, generator=g)
    return tensors


class Cluster:
    """A sender and `n` receivers wired through LocalMembers."""

    def __init__(self, n: int, *, bucket_bytes: int = 1 << 20, fingerprint: str = "fp", on_bucket_sent=None, **sender):
        self.port = free_port()
        self.store = connect_store("127.0.0.1", self.port, is_master=True, timeout_seconds=TIMEOUT)
        self.sinks = [RecordingSink() for _ in range(n)]
        self.receivers = [
            AdapterReceiver(s, replica_index=i, fingerprint="fp", key=KEY) for i, s in enumerate(self.sinks)
        ]
        self.members = [LocalMember(i, r) for i, r in enumerate(self.receivers)]
        self.sender = self.make_sender(
            bucket_bytes=bucket_bytes, fingerprint=fingerprint, on_bucket_sent=on_bucket_sent, **sender
        )

    def make_sender(self, **kwargs) -> AdapterSender:
        options = {
            "bucket_bytes": 1 << 20,
            "fingerprint": "fp",
            "token": TOKEN,
            "timeout_seconds": TIMEOUT,
            "join_timeout_seconds": TIMEOUT,
        } | kwargs
        return AdapterSender(
            self.members, store=self.store, store_addr="127.0.0.1", store_port=self.port, backend="gloo", **options
        )

    def wait_live(self, version: int, indices=None) -> None:
        deadline = time.monotonic() + 10
        for i in indices if indices is not None else range(len(self.sinks)):
            while self.sinks[i].live_version < version:
                assert time.monotonic() < deadline, f"replica {i} never reached version {version}"
                time.sleep(0.01)

    def close(self) -> None:
        self.sender.close()
        for receiver in self.receivers:
            receiver.close()


@pytest.fixture
def cluster():
    made: list[Cluster] = []

    def make(n: int = 2, **kwargs) -> Cluster:
        made.append(Cluster(n, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()
    # A test whose rounds failed leaves gloo groups in reference cycles (tracebacks, threads' frames); collected by
    # chance in a later test, one tears down in that test's thread and stalls it past its join timeout. Collected
    # here, each test's groups go with it.
    made.clear()
    gc.collect()


def test_wire_round_trip_with_mixed_dtypes_and_many_buckets():
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(100).to(torch.bfloat16),
        "c": torch.randn(7, 7).to(torch.float16),
        "d": torch.randn(1000),
    }
    header, buckets = wire.pack(tensors, key=KEY, version=4, epoch=2, bucket_bytes=512)
    # a, b, c share the first 512-byte bucket (64 + 256 + 128 bytes, aligned); d is larger than a bucket: its own.
    assert header.bucket_sizes == (448, 4032)  # 4000 bytes padded to the 64-byte alignment
    assert {t.name: t.bucket for t in header.tensors} == {"a": 0, "b": 0, "c": 0, "d": 1}
    decoded = wire.RoundHeader.decode(header.encode(KEY), KEY)
    assert decoded == header
    wire.verify(decoded, buckets, KEY)
    for name, tensor in wire.unpack(decoded, buckets).items():
        assert torch.equal(tensor, tensors[name]) and tensor.dtype == tensors[name].dtype


def test_payload_mac_detects_flips_swaps_and_truncation():
    header, buckets = wire.pack(
        {"x": torch.arange(64, dtype=torch.float32)}, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20
    )
    flipped = [b.clone() for b in buckets]
    flipped[0][5] ^= 1
    with pytest.raises(wire.WireError, match="payload MAC does not verify"):
        wire.verify(header, flipped, KEY)
    swapped = [b.clone() for b in buckets]
    swapped[0][0:4], swapped[0][4:8] = buckets[0][4:8].clone(), buckets[0][0:4].clone()
    with pytest.raises(wire.WireError, match="payload MAC does not verify"):
        wire.verify(header, swapped, KEY)
    with pytest.raises(wire.WireError, match="short transfer"):
        wire.verify(header, [buckets[0][:-64]], KEY)
    with pytest.raises(wire.WireError, match="payload MAC does not verify"):  # the same bytes under another key
        wire.verify(header, buckets, wire.round_key("guessed-token"))


def test_the_payload_mac_fed_in_pieces_equals_one_pass():
    """The receiver feeds the MAC each piece as it lands; bucket boundaries and piece sizes must not matter."""
    header, buckets = wire.pack(
        {"x": torch.randn(1000), "y": torch.randn(300)}, key=KEY, version=1, epoch=0, bucket_bytes=1024
    )
    assert len(buckets) == 2
    mac = wire.PayloadMac.of(header, KEY)
    for bucket in buckets:
        for piece in bucket.split(100):
            mac.update(piece)
    assert mac.hexdigest() == header.payload_mac
    wire.verify(header, buckets, KEY, computed=mac.hexdigest())


def test_a_gpu_buckets_bytes_reach_the_mac_through_a_reused_staging_buffer_in_order():
    """On a GPU the MAC reads a bucket through one page-locked buffer per thread, chunk by chunk (host_chunks): the
    chunks, each read before the next overwrites the buffer, are the bucket's bytes in order. (CI has no GPU: the
    staging is driven here with a CPU tensor and a small buffer; the H200 figures are in BENCHMARKS.md.)"""
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    staging = torch.empty(4096, dtype=torch.uint8)
    chunks = [bytes(chunk) for chunk in wire.staged_chunks(data, staging)]
    assert [len(c) for c in chunks] == [4096, 4096, 1808] and b"".join(chunks) == data.numpy().tobytes()
    header, buckets = wire.pack({"x": torch.randn(3000)}, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    mac = wire.PayloadMac.of(header, KEY)
    for chunk in wire.staged_chunks(buckets[0], staging):
        mac._update(chunk)
    assert mac.hexdigest() == header.payload_mac
    assert [bytes(c) for c in wire.host_chunks(buckets[0])] == [buckets[0].numpy().tobytes()]  # a CPU's: no copy


def _crc_fixup(message: bytes, forged: bytes, at: int) -> bytes:
    """`forged` with the four bytes at `at` replaced so that its CRC-32 equals `message`'s.

    CRC-32 is affine over GF(2): for messages of one length, crc(x ^ y ^ z) == crc(x) ^ crc(y) ^ crc(z). So with P
    nonzero only in those four bytes, crc(forged ^ P) == crc(forged) ^ crc(P) ^ crc(zeros), and P solves a 32 x 32
    linear system (Gaussian elimination over 32-bit words): no key, no search, a microsecond of arithmetic."""
    zeros = bytes(len(message))
    target = zlib.crc32(message) ^ zlib.crc32(forged)
    rows = []  # (crc contribution, the patch bits that make it), reduced to one row per leading bit
    for bit in range(32):
        patch = bytearray(len(message))
        patch[at + bit // 8] = 1 << (bit % 8)
        rows.append((zlib.crc32(bytes(patch)) ^ zlib.crc32(zeros), 1 << bit))
    solution = 0
    for pivot in range(31, -1, -1):
        index = next(i for i, (value, _) in enumerate(rows) if value >> pivot & 1)
        value, bits = rows.pop(index)
        rows = [(v ^ value, b ^ bits) if v >> pivot & 1 else (v, b) for v, b in rows]
        if target >> pivot & 1:
            target, solution = target ^ value, solution ^ bits
    assert target == 0
    out = bytearray(forged)
    for offset in range(4):
        out[at + offset] ^= solution >> (8 * offset) & 0xFF
    return bytes(out)


def forge_lora_b(header: wire.RoundHeader, buckets: list[torch.Tensor]) -> torch.Tensor:
    """What someone who can rewrite the bucket bytes in flight (but holds no token) does: replace a lora_B tensor
    by values of their choosing and fix up four bytes of the padding after it, so that the payload's CRC-32 (the
    header's checksum up to wire version 2, which such a forgery passed) still holds. Rewrites `buckets` in place;
    returns the values planted."""
    entry = next(t for t in header.tensors if "lora_B" in t.name and -t.nbytes % wire.ALIGN >= 4)
    concatenated = torch.cat(buckets)
    original = bytes(concatenated.numpy())
    planted = torch.full((entry.nbytes // 4,), 1e3)  # the attacker's B
    start = sum(header.bucket_sizes[: entry.bucket]) + entry.offset
    concatenated[start : start + entry.nbytes] = planted.view(torch.uint8)
    fixed = _crc_fixup(original, bytes(concatenated.numpy()), start + entry.nbytes)
    assert zlib.crc32(fixed) == zlib.crc32(original) and fixed != original
    pieces = torch.frombuffer(bytearray(fixed), dtype=torch.uint8).split(header.bucket_sizes)
    for bucket, piece in zip(buckets, pieces, strict=True):
        bucket.copy_(piece)
    return planted.view(entry.shape)


def padded_adapter() -> dict[str, torch.Tensor]:
    """An adapter whose lora_B (5 x 3 float32: 60 bytes) leaves padding before the next 64-byte boundary."""
    g = torch.Generator().manual_seed(0)
    return {
        "layer.lora_A.weight": torch.randn(3, 16, generator=g),
        "layer.lora_B.weight": torch.randn(5, 3, generator=g),
    }


@pytest.mark.parametrize("algorithm", wire.PAYLOAD_MAC_ALGORITHMS)
def test_a_linear_fix_up_of_the_payload_is_refused_under_a_genuine_header(algorithm, monkeypatch):
    monkeypatch.setattr(wire, "PAYLOAD_MAC_ALGORITHM", algorithm)
    tensors = padded_adapter()
    header, buckets = wire.pack(tensors, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    assert header.payload_mac_algorithm == algorithm
    wire.verify(wire.RoundHeader.decode(header.encode(KEY), KEY), buckets, KEY)
    decoded = wire.RoundHeader.decode(header.encode(KEY), KEY)  # the header is genuine: the forgery is the payload
    planted = forge_lora_b(decoded, buckets)
    assert torch.equal(wire.unpack(decoded, buckets)["layer.lora_B.weight"], planted)
    with pytest.raises(wire.WireError, match="payload MAC"):
        wire.verify(decoded, buckets, KEY)


def test_the_payload_is_macd_with_poly1305_under_a_key_of_its_own_each_round():
    """Poly1305 (~7 GB/s on one core here, HMAC-SHA256 ~1.1 GB/s) is a one-time authenticator: a key MACs one
    message, never two. Each round's key is HMAC-SHA256 of the job's key and a random nonce the header carries
    (authenticated by the header's MAC): the same adapter sent twice travels under two keys, with two tags."""
    assert wire.PAYLOAD_MAC_ALGORITHM == "poly1305"  # where OpenSSL offers it, as in every wheel of cryptography
    tensors = padded_adapter()
    first, buckets = wire.pack(tensors, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    second, again = wire.pack(tensors, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    assert first.payload_mac_algorithm == second.payload_mac_algorithm == "poly1305"
    assert len(bytes.fromhex(first.payload_nonce)) == wire.NONCE_BYTES and first.payload_nonce != second.payload_nonce
    wire.verify(first, buckets, KEY)
    wire.verify(second, again, KEY)
    assert wire.payload_mac(buckets, wire.PayloadMac.of(second, KEY)) != first.payload_mac  # same bytes, new key
    stale = dataclasses.replace(second, payload_mac=first.payload_mac)  # one round's tag under another's nonce
    with pytest.raises(wire.WireError, match="payload MAC does not verify"):
        wire.verify(stale, buckets, KEY)


def test_a_receiver_without_poly1305_refuses_such_a_round_saying_why(monkeypatch):
    """OpenSSL in FIPS mode offers no Poly1305: a sender there MACs with HMAC-SHA256 (the header names it), and a
    receiver there cannot check a Poly1305 round, which it refuses with the reason instead of a bare mismatch."""
    header, buckets = wire.pack(padded_adapter(), key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    monkeypatch.setattr(wire, "poly1305_available", lambda: False)
    with pytest.raises(wire.WireError, match="Poly1305 is not available here"):
        wire.verify(header, buckets, KEY)


def test_a_round_a_receiver_cannot_check_is_refused_with_the_reason_and_the_group_stays(cluster, monkeypatch):
    """A receiver whose OpenSSL lacks Poly1305 (FIPS mode) next to a sender that has it: the header is genuine, so
    the receiver follows the round to its end (in lockstep with the group), refuses it, says why, and stays in the
    group; a sender without Poly1305 (HMAC-SHA256 rounds) then gets through to it."""
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    epoch = c.sender.epoch
    monkeypatch.setattr(wire, "poly1305_available", lambda: False)  # the receivers' side (sender's choice was made)
    with pytest.raises(SyncError, match="every replica refused version 2"):
        c.sender.send(adapter(1), {})
    eventually(lambda: all("Poly1305 is not available here" in (r.state().last_error or "") for r in c.receivers))
    assert [s.live_version for s in c.sinks] == [1, 1] and c.sender.epoch == epoch
    monkeypatch.setattr(wire, "PAYLOAD_MAC_ALGORITHM", "hmac-sha256")  # what a sender in FIPS mode chooses
    report = c.sender.send(adapter(1), {})
    assert report.members == (0, 1) and c.sender.epoch == epoch
    c.wait_live(report.version)


def test_a_forged_payload_is_never_activated(cluster, monkeypatch):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    real_pack = wire.pack

    def forging_pack(*args, **kwargs):  # the header is the sender's own; the bytes on the wire are not
        header, buckets = real_pack(*args, **kwargs)
        forge_lora_b(header, buckets)
        return header, buckets

    monkeypatch.setattr(wire, "pack", forging_pack)
    with pytest.raises(SyncError, match="every replica refused version 2"):
        c.sender.send(padded_adapter(), {})
    eventually(lambda: all("payload MAC" in (r.state().last_error or "") for r in c.receivers))
    assert [s.live_version for s in c.sinks] == [1, 1] and all(sorted(s.adapters) == [1] for s in c.sinks)


def signed(body: bytes) -> bytes:
    """A header body with a valid MAC: what only a holder of the token can make (so the bounds are the last line)."""
    return body + hmac.new(KEY, body, hashlib.sha256).digest()


def test_malformed_headers_are_rejected():
    header, _ = wire.pack({"x": torch.zeros(4)}, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    with pytest.raises(wire.WireError, match="malformed"):
        wire.RoundHeader.decode(signed(b"{not json"), KEY)
    bad_layout = header.encode(KEY)[: -wire.MAC_BYTES].replace(b'"nbytes":16', b'"nbytes":20')
    with pytest.raises(wire.WireError, match="do not hold shape"):
        wire.RoundHeader.decode(signed(bad_layout), KEY)


def test_a_header_without_the_tokens_mac_is_refused_before_it_is_parsed():
    header, _ = wire.pack({"x": torch.zeros(4)}, key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    forged = header.encode(wire.round_key("guessed-token"))
    with pytest.raises(wire.WireError, match="MAC does not verify"):
        wire.RoundHeader.decode(forged, KEY)
    tampered = bytearray(header.encode(KEY))
    tampered[tampered.index(b'"version":1') + 10] = ord("7")  # a new version under the old MAC
    with pytest.raises(wire.WireError, match="MAC does not verify"):
        wire.RoundHeader.decode(bytes(tampered), KEY)
    with pytest.raises(wire.WireError, match="header length"):
        wire.RoundHeader.decode(b"{}", KEY)


def _layout(**changes) -> bytes:
    """A header for one 4-float tensor in one bucket, with fields replaced, MAC'd with the right key."""
    data = {
        "version": 1,
        "epoch": 0,
        "incarnation": 0,
        "tensors": [{"name": "x", "dtype": "float32", "shape": [4], "bucket": 0, "offset": 0, "nbytes": 16}],
        "bucket_sizes": [64],
        "payload_mac": "0" * 32,
        "payload_mac_algorithm": "poly1305",
        "payload_nonce": "0" * 32,
        "adapter_config": {},
        "wire_version": wire.WIRE_VERSION,
    }
    tensor = changes.pop("tensor", {})
    data["tensors"][0] |= tensor
    data |= changes
    return signed(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (_layout(tensor={"shape": [-4], "nbytes": -16}), "not a non-negative integer"),
        (_layout(tensor={"shape": [4.0]}), "not a non-negative integer"),
        (_layout(tensor={"shape": [True, 4]}), "not a non-negative integer"),
        (_layout(tensor={"shape": [1] * 9, "nbytes": 4}), "9 dimensions"),
        (_layout(tensor={"shape": [1 << 40], "nbytes": 4 << 40}, bucket_sizes=[4 << 40]), "at most"),
        (_layout(bucket_sizes=[1 << 30]), "bucket 0: 1073741824 bytes announced, its tensors fill 64"),
        (_layout(bucket_sizes=[64, 64]), "bucket 1: 64 bytes announced, its tensors fill 0"),
        (_layout(bucket_sizes=[64] * (wire.MAX_BUCKETS + 1)), "buckets"),
        (_layout(tensors=[]), "0 tensors"),
        (_layout(tensor={"offset": 32}), "overlap or leave its bucket"),
        (_layout(tensor={"offset": 64}), "overlap or leave its bucket"),
        (_layout(tensor={"bucket": 3}), "bucket 3 of 1"),
        (_layout(version=-1), "version -1"),
        (_layout(incarnation=-1), "incarnation -1"),
        (_layout(payload_mac_algorithm="crc32"), "payload MAC algorithm 'crc32' (one of"),
        (_layout(payload_nonce="00"), "payload nonce"),
        (_layout(payload_nonce="zz" * 16), "payload nonce"),
    ],
)
def test_a_header_is_bounded_before_anything_is_allocated(raw, words):
    with pytest.raises(wire.WireError, match=re.escape(words)):
        wire.RoundHeader.decode(raw, KEY)


def test_two_tensors_may_not_overlap():
    data = json.loads(_layout()[: -wire.MAC_BYTES])
    data["tensors"].append(data["tensors"][0] | {"name": "y"})
    with pytest.raises(wire.WireError, match="overlap"):
        wire.RoundHeader.decode(signed(json.dumps(data).encode()), KEY)


def test_a_sender_without_the_token_gets_nothing_activated(cluster, caplog):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    intruder = c.make_sender(token="not-the-token")  # can reach the store and the sync port, and the control API
    with pytest.raises(SyncError):
        intruder.send(adapter(1), {})
    intruder.close()
    assert [s.live_version for s in c.sinks] == [1, 1] and all(1 in s.adapters and 2 not in s.adapters for s in c.sinks)
    assert "header MAC does not verify" in caplog.text  # each receiver said why (a re-formation clears last_error)


def test_a_header_for_another_round_than_the_announced_one_is_refused(cluster, monkeypatch, caplog):
    c = cluster(2)
    real_pack = wire.pack
    monkeypatch.setattr(wire, "pack", lambda *a, **kw: real_pack(*a, **kw | {"version": kw["version"] + 5}))
    with pytest.raises(SyncError):
        c.sender.send(adapter(0), {})
    assert [s.live_version for s in c.sinks] == [0, 0]
    assert (
        "header for version 6 of epoch 0 from trainer incarnation 0, but the trainer announced version 1 of epoch 0"
        in caplog.text
    )


def test_a_header_from_another_incarnation_than_the_announced_one_is_refused(cluster, monkeypatch, caplog):
    """The incarnation is MAC'd with the round: a header may not claim another trainer's than its prepare did."""
    c = cluster(1)
    real_pack = wire.pack
    monkeypatch.setattr(wire, "pack", lambda *a, **kw: real_pack(*a, **kw | {"incarnation": 7}))
    with pytest.raises(SyncError):
        c.sender.send(adapter(0), {})
    assert c.sinks[0].live_version == 0
    assert (
        "from trainer incarnation 7, but the trainer announced version 1 of epoch 0 from incarnation 0" in caplog.text
    )


def test_members_are_told_to_expect_a_round_while_it_is_packed(cluster, monkeypatch):
    """Packing (a copy of the adapter and its MAC) and the members' prepare calls (an HTTP round trip each) overlap:
    a pack that waits for every member to have been asked still finishes, where it timed out when packing came
    first. What cannot travel (a dtype the wire lacks) is still refused before any member is asked."""
    c = cluster(2)
    asked = threading.Barrier(len(c.members) + 1, timeout=5)
    for member in c.members:
        real_prepare = member.prepare

        def prepare(request, real_prepare=real_prepare):
            asked.wait()
            real_prepare(request)

        member.prepare = prepare
    real_pack = wire.pack

    def pack_once_asked(*args, **kwargs):
        asked.wait()  # BrokenBarrierError after 5 s unless every member has been asked meanwhile
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(wire, "pack", pack_once_asked)
    report = c.sender.send(adapter(0), {})
    assert report.members == (0, 1)
    c.wait_live(1)
    for member in c.members:
        member.prepare = lambda request: pytest.fail("a member was asked to expect a round that cannot travel")
    with pytest.raises(wire.WireError, match="unsupported dtype int64"):
        c.sender.send({"x": torch.arange(4)}, {})


def test_rounds_deliver_exact_tensors_and_versions_grow(cluster):
    c = cluster(2, bucket_bytes=4096)  # the adapter spans several buckets and arrives whole
    for version, seed in ((1, 0), (2, 1)):
        report = c.sender.send(adapter(seed), {"r": 8})
        assert report.version == version and report.members == (0, 1) and not report.refused
        assert report.bytes >= sum(t.numel() * 4 for t in adapter(seed).values())
        c.wait_live(version)
        for sink in c.sinks:
            got = sink.adapters[version]
            assert got.keys() == adapter(seed).keys()
            assert all(torch.equal(got[k], v) for k, v in adapter(seed).items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_adapter_travels_in_the_models_dtype_in_half_the_bytes(cluster, dtype):
    """The trainer's float32 master weights stay float32 (what it passes is not touched); the round carries them
    rounded to the model's dtype, as vLLM would round them when it builds the LoRA for that model: half the bytes,
    the same adapter served. A late joiner gets those same bytes."""
    c = cluster(2)
    fp32 = c.sender.send(adapter(0), {}).bytes
    c.sender.close()
    c.sender = c.make_sender(wire_dtype=dtype)
    master = adapter(1)
    report = c.sender.send(master, {})
    assert report.bytes <= fp32 // 2 + 64 * len(master)  # each tensor padded to the 64-byte alignment
    c.wait_live(report.version)
    for sink in c.sinks:
        got = sink.adapters[report.version]
        assert all(got[k].dtype == dtype and torch.equal(got[k], v.to(dtype)) for k, v in master.items())
    assert all(v.dtype == torch.float32 and torch.equal(v, adapter(1)[k]) for k, v in master.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@LORA_SCALINGS
def test_the_sender_folds_the_lora_scaling_into_lora_b_as_it_packs(cluster, config, scaling, dtype):
    """vLLM multiplies lora_B by the LoRA's scaling in place as it builds a LoRA (LoRALayerWeights.optimize), in the
    engine's thread between steps, and a receiver folding it into its staged copy first spent 2.5-5.6 ms of each
    round's critical path doing so. The sender folds it as it packs: the multiply replaces the copy into the bucket
    (free), in the trainer's float32, rounded to the wire dtype once; the header's config then scales by 1
    (tests/workers/test_sync_members.py checks `lora_scaling` against vLLM's PEFTHelper). An equivalent peft
    adapter. Per-module alphas are left to vLLM, which resolves their patterns: those travel as they are."""
    c = cluster(2, wire_dtype=dtype)
    master = adapter(3)
    report = c.sender.send(master, config)
    c.wait_live(report.version)
    for sink in c.sinks:
        got, handed = sink.adapters[report.version], sink.configs[report.version]
        if scaling is None:
            assert handed == config
            assert all(torch.equal(got[k], v.to(dtype)) for k, v in master.items())
            continue
        assert lora_scaling(handed) == 1.0 and lora_scaling(config) == scaling
        unscaled = ("lora_alpha", "use_rslora")
        assert {k: v for k, v in handed.items() if k not in unscaled} == {
            k: v for k, v in config.items() if k not in unscaled
        }
        for name, tensor in master.items():
            expected = (tensor * scaling if "lora_B" in name else tensor).to(dtype)
            assert got[name].dtype == dtype and torch.equal(got[name], expected), name
    assert all(torch.equal(v, adapter(3)[k]) for k, v in master.items()), "the trainer's weights are not touched"


def test_corrupted_round_is_refused_and_the_old_version_keeps_serving(cluster, monkeypatch):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    real_pack = wire.pack

    def corrupting_pack(*args, **kwargs):
        header, buckets = real_pack(*args, **kwargs)
        buckets[0][3] ^= 0xFF  # after the MAC was computed: what a bad link or a bug would do
        return header, buckets

    monkeypatch.setattr(wire, "pack", corrupting_pack)
    with pytest.raises(SyncError, match="every replica refused version 2"):
        c.sender.send(adapter(1), {})
    # Asserted once the receivers have recorded the refusal, so that an activation after it would be seen.
    eventually(lambda: all("payload MAC does not verify" in (r.state().last_error or "") for r in c.receivers))
    assert [s.live_version for s in c.sinks] == [1, 1]
    assert all(sorted(s.adapters) == [1] for s in c.sinks)
    monkeypatch.setattr(wire, "pack", real_pack)
    report = c.sender.send(adapter(1), {})  # the group is intact: the next good round goes through
    assert report.members == (0, 1)
    c.wait_live(report.version)


def test_truncated_round_activates_nothing(cluster, monkeypatch):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    real_pack = wire.pack

    def truncating_pack(*args, **kwargs):
        header, buckets = real_pack(*args, **kwargs)
        return header, buckets[:-1]  # the header announces a bucket that never comes

    monkeypatch.setattr(wire, "pack", truncating_pack)
    with pytest.raises(SyncError, match="could not be sent"):
        c.sender.send(adapter(1), {})
    assert [s.live_version for s in c.sinks] == [1, 1]
    assert all(len(s.adapters) == 1 for s in c.sinks)


def test_a_lost_replica_is_dropped_and_its_replacement_catches_up(cluster):
    """(Death in the middle of a round needs separate processes: tests/workers/test_inference_sync.py.)"""
    c = cluster(3, bucket_bytes=1024)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    first_epoch = c.sender.epoch
    victim = c.members[2]
    victim.down = True
    victim.receiver.close()
    report = c.sender.send(adapter(1), {})
    assert report.members == (0, 1) and report.attempts == 2 and report.epoch > first_epoch
    c.wait_live(2, indices=[0, 1])

    # The replacement (same replica index, fresh process) joins the next epoch and gets version 2 at once.
    sink = RecordingSink()
    c.sinks[2] = sink
    c.receivers[2] = AdapterReceiver(sink, replica_index=2, fingerprint="fp", key=KEY)
    c.members[2].receiver, c.members[2].down = c.receivers[2], False
    assert not c.receivers[2].ready
    assert c.sender.refresh() is True
    c.wait_live(2, indices=[2])
    assert c.receivers[2].ready
    name = "base_model.model.layers.0.q_proj.lora_A.weight"
    assert torch.equal(sink.adapters[2][name], adapter(1)[name])
    report = c.sender.send(adapter(2), {})
    assert report.members == (0, 1, 2) and report.version == 3
    assert c.sender.refresh() is False


def test_a_hung_replica_times_out_and_the_group_reforms(cluster):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    hung = c.members[1]
    real_prepare = hung.prepare

    def hang(request) -> None:  # answers, then never enters the round, and stops answering (SIGSTOP-like)
        hung.down = True

    hung.prepare = hang
    started = time.monotonic()
    report = c.sender.send(adapter(1), {})
    assert time.monotonic() - started >= TIMEOUT * 0.9  # the round waited for the collective's timeout
    assert report.members == (0,)
    hung.prepare = real_prepare


def test_fingerprint_mismatch_is_refused_naming_both(cluster):
    c = cluster(1)
    sender = c.make_sender(fingerprint="trainer-fp")
    with pytest.raises(FingerprintMismatch, match="trainer loaded trainer-fp, inference replica 0 loaded fp"):
        sender.form_group()
    sender.close()
    with pytest.raises(FingerprintMismatch, match="this replica \\(index 0\\) loaded fp"):
        c.receivers[0].join(
            JoinRequest(
                epoch=9,
                rank=1,
                world_size=2,
                store_addr="x",
                store_port=1,
                backend="gloo",
                timeout_seconds=1,
                join_timeout_seconds=1,
                trainer_fingerprint="other",
                current_version=0,
            )
        )


def test_versions_and_epochs_never_go_backwards_across_a_sender_restart(cluster):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.sender.send(adapter(1), {})
    c.wait_live(2)
    epoch = c.sender.epoch
    c.sender.close()
    # A restarted trainer (from an older checkpoint, version 1) must not reuse version 2 or the epoch.
    c.sender = c.make_sender(first_version=1, first_epoch=0)
    report = c.sender.send(adapter(5), {})
    assert report.version == 3 and report.epoch > epoch
    c.wait_live(3)


def test_sends_from_threads_do_not_interleave(cluster):
    """The trainer may call send from a background thread (pipelined mode); rounds are serialized."""
    c = cluster(1)
    errors: list[BaseException] = []

    def send(seed: int) -> None:
        try:
            c.sender.send(adapter(seed), {})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    c.wait_live(3)


def test_a_late_joiner_gets_the_bytes_of_the_version_it_is_told(cluster):
    """The sender keeps the last version for newcomers: a copy, not a view of weights that train on."""
    c = cluster(2)
    c.members[1].down = True
    live = adapter(0)  # stands for the trainer's parameters
    sent = {k: v.clone() for k, v in live.items()}
    c.sender.send(live, {})
    c.wait_live(1, indices=[0])
    for tensor in live.values():
        tensor.add_(1.0)  # the next optimizer step, in place, before the next sync
    c.members[1].down = False
    assert c.sender.refresh() is True
    c.wait_live(1, indices=[1])
    assert all(torch.equal(c.sinks[1].adapters[1][k], sent[k]) for k in sent)


def test_the_sender_packs_into_the_buckets_of_the_round_before_last_never_the_kept_one(cluster):
    """Packing into fresh memory cost a page fault per page (11 ms against 5.6 ms into reused memory for the
    quickstart's 19.5 MB). The sender reuses the buckets of the round before the last: the last round's are kept
    for members behind it, and a late joiner still gets exactly those bytes."""
    c = cluster(2)
    c.members[1].down = True
    c.sender.send(adapter(0), {})
    first = [b.data_ptr() for b in c.sender._last_round[1]]
    c.sender.send(adapter(1), {})
    second = [b.data_ptr() for b in c.sender._last_round[1]]
    c.sender.send(adapter(2), {})
    assert [b.data_ptr() for b in c.sender._last_round[1]] == first and second != first
    c.wait_live(3, indices=[0])
    c.members[1].down = False
    assert c.sender.refresh() is True
    c.wait_live(3, indices=[1])
    assert all(torch.equal(c.sinks[1].adapters[3][k], v) for k, v in adapter(2).items())


def replace_replica(c: Cluster, index: int, sink=None) -> None:
    """A fresh process takes over replica `index` (same address): it has joined no epoch and serves version 0."""
    c.receivers[index].close()
    c.sinks[index] = sink or RecordingSink()
    c.receivers[index] = AdapterReceiver(c.sinks[index], replica_index=index, fingerprint="fp", key=KEY)
    c.members[index].receiver = c.receivers[index]


def test_a_replica_replaced_between_rounds_gets_the_current_adapter(cluster):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.sender.send(adapter(1), {})
    c.wait_live(2)
    replace_replica(c, 1)  # never seen unreachable: its slot is still listed in the group
    assert c.sender.refresh() is True
    c.wait_live(2, indices=[1])
    assert c.receivers[1].ready
    assert all(torch.equal(c.sinks[1].adapters[2][k], v) for k, v in adapter(1).items())
    assert c.sender.serving(2) == (0, 1)


class FlakySink(RecordingSink):
    """vLLM's add_lora failing once (out of LoRA slots, a bad folder): the version never went live."""

    def __init__(self, failures: int = 1) -> None:
        super().__init__()
        self.failures = failures

    def activate(self, version, tensors, adapter_config, *, incarnation: int = 0) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("add_lora failed")
        super().activate(version, tensors, adapter_config, incarnation=incarnation)


def test_a_round_is_acknowledged_only_after_activation(cluster):
    c = cluster(2)
    replace_replica(c, 1, FlakySink())
    report = c.sender.send(adapter(0), {})
    assert report.members == (0,) and "activation failed" in report.refused[1]
    assert c.sinks[1].live_version == 0 and not c.receivers[1].ready
    # Out of the rollout set until re-synced: rollouts for version 1 go to replica 0 only.
    assert c.sender.serving(1) == (0,)
    report = c.sender.send(adapter(1), {})  # the next round brings it back
    assert report.members == (0, 1)
    assert c.sender.serving(2) == (0, 1)


def test_a_replica_that_answers_but_cannot_join_is_dropped_then_re_added(cluster):
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    half_alive = c.members[1]
    real_join = half_alive.join
    half_alive.join = lambda request: None  # answers HTTP, never reaches the sync store
    c.sender.close()
    c.sender = c.make_sender(join_timeout_seconds=1.0, rejoin_backoff_seconds=0.5, timeout_seconds=60.0)
    started = time.monotonic()
    report = c.sender.send(adapter(1), {})
    # Dropped after one join timeout, not retried with the same membership until the (60 s) sync timeout.
    assert time.monotonic() - started < 10
    assert report.members == (0,) and c.sender.group == (0,)
    half_alive.join = real_join
    time.sleep(0.6)  # its back-off has passed: the next refresh tries it again, and it catches up
    assert c.sender.refresh() is True
    c.wait_live(2, indices=[1])
    assert c.sender.group == (0, 1) and c.sender.serving(2) == (0, 1)


def test_a_receiver_never_activates_a_version_at_or_below_its_own(cluster):
    """The receiver's own guard, whatever a (buggy or restarted) sender sends."""
    c = cluster(1)
    c.sender.send(adapter(0), {})
    c.sender.send(adapter(1), {})
    c.wait_live(2)
    with c.sender._lock:  # a round of version 1 again, bypassing the sender's own numbering
        c.sender._send_once(wire.pack(adapter(5), key=KEY, version=1, epoch=0, bucket_bytes=1 << 20), 1, 1)
    eventually(lambda: not c.receivers[0].state().busy)
    assert c.sinks[0].live_version == 2 and sorted(c.sinks[0].adapters) == [1, 2]
    assert torch.equal(
        c.sinks[0].adapters[1]["base_model.model.layers.0.q_proj.lora_A.weight"],
        adapter(0)["base_model.model.layers.0.q_proj.lora_A.weight"],
    )


class RecordingRollouts:
    """The rollout client's side, stood in for: generate fails as RolloutClient.generate does when no replica is
    named, and otherwise answers one completion per prompt on the version asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def generate(self, prompts, sampling, *, version, replicas, seeds=None):
        self.calls.append((version, tuple(replicas)))
        if not replicas:
            raise RolloutError(f"no inference replica in the sync group serves adapter version {version}")
        return [[Completion(token_ids=[1], logprobs=[-0.1], text="x", finish_reason="stop", version=version)]
                for _ in prompts]  # fmt: skip


def test_the_rollout_producer_waits_for_a_re_forming_group_instead_of_failing(cluster):
    """k >= 2: the producer generates while the trainer's sender re-forms the group (a replica lost or replaced).
    The group is empty from the moment the old epoch is left until every member has joined the new one (up to
    the join timeout); a round the producer started then failed with "no inference replica ... serves", and the
    run ended. The replica's join is held here, so the window is certain rather than hoped for."""
    c = cluster(1)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    replace_replica(c, 0)  # its only replica restarted: the next refresh re-forms the group
    joining, release = threading.Event(), threading.Event()
    real_join = c.members[0].join

    def held_join(request: JoinRequest) -> None:
        joining.set()
        assert release.wait(20)
        real_join(request)

    c.members[0].join = held_join
    reform = threading.Thread(target=c.sender.refresh, daemon=True)
    reform.start()
    assert joining.wait(20)  # the old epoch is left, the new one not formed: the window is open
    touched = threading.Event()

    class Watched:  # the producer's sender, telling the test when the producer reads it
        def __getattr__(self, name):
            touched.set()
            return getattr(c.sender, name)

    buffer, rollouts = RolloutBuffer(staleness=2, next_position=0), RecordingRollouts()
    grpo = parse_job(job_doc(grpo={"promptsPerStep": 1})).spec.grpo
    prompts = iter([Prompt(text="p0"), Prompt(text="p1")])
    producer = RolloutProducer(
        grpo, prompts, lambda p: [1, 2], None, sender=Watched(), rollouts=rollouts, buffer=buffer
    )
    buffer.allow(1)
    producer.start()
    assert touched.wait(20)  # the producer asks the sender for a version and replicas while the group re-forms
    release.set()
    reform.join(20)
    groups, _ = buffer.take(1, version=1, then_allow=0)
    assert [g.version for g in groups] == [1]
    assert rollouts.calls == [(1, (0,))]  # once, after the group formed and the replica caught up
    buffer.close()


def count_probes(member: LocalMember) -> list[float]:
    """The times at which the sender asked `member` for its state (answered or not), from now on."""
    probes: list[float] = []
    real_state = member.state

    def state():
        probes.append(time.monotonic())
        return real_state()

    member.state = state
    return probes


def test_a_group_whose_every_replica_is_lost_waits_for_a_replacement(cluster):
    """The only replica dies (a node drained, the OOM killer): its replacement needs a model load before it answers.
    Re-forming raised "no inference replica answers" at once and the run ended; it waits for one now, bounded by
    `replacement_wait_seconds`, and catches the replacement up to the current version."""
    c = cluster(1)
    c.sender.close()
    c.sender = c.make_sender(replacement_wait_seconds=30.0)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    c.members[0].down = True
    probes = count_probes(c.members[0])
    reform = threading.Thread(target=c.sender.refresh, daemon=True)
    reform.start()
    # Asked by refresh, then by the formation, then again: the sender is waiting for a replica to answer.
    eventually(lambda: len(probes) >= 3, seconds=20)
    replace_replica(c, 0)
    c.members[0].down = False
    reform.join(20)
    assert not reform.is_alive()
    c.wait_live(1)
    assert c.sender.serving(1) == (0,)


def test_the_wait_for_a_replacement_is_bounded(cluster):
    c = cluster(1)
    c.sender.close()
    c.sender = c.make_sender(replacement_wait_seconds=1.0)
    c.sender.send(adapter(0), {})
    c.members[0].down = True
    started = time.monotonic()
    with pytest.raises(SyncError, match=r"no inference replica answers \(1 expected\) after waiting 1s"):
        c.sender.refresh()
    assert time.monotonic() - started < 10


class DyingRollouts(RecordingRollouts):
    """The replicas die while generating the first round (every share fails, as RolloutClient.generate raises it),
    and come back as `replace` says."""

    def __init__(self, replace) -> None:
        super().__init__()
        self._replace = replace

    def generate(self, prompts, sampling, *, version, replicas, seeds=None):
        if not self.calls:
            self.calls.append((version, tuple(replicas)))
            self._replace()
            raise ReplicasLost(f"every replica failed to generate ({len(prompts)} prompts lost): replica 0: gone")
        return super().generate(prompts, sampling, version=version, replicas=replicas, seeds=seeds)


def test_the_rollout_producer_survives_its_only_replica_dying_mid_generation(cluster):
    """Every replica serving a round failed: the producer ended with "every replica failed to generate" and the
    trainer exited 1 at its next take. It re-forms the group now (waiting for a replacement), and generates the same
    prompts again on it."""
    c = cluster(1)
    c.sender.close()
    c.sender = c.make_sender(replacement_wait_seconds=30.0)
    c.sender.send(adapter(0), {})
    c.wait_live(1)

    probes = count_probes(c.members[0])

    def die_then_come_back() -> None:
        c.members[0].down = True
        probes.clear()

        def later() -> None:
            eventually(lambda: len(probes) >= 3, seconds=20)  # the producer's re-formation waits for a replica
            replace_replica(c, 0)
            c.members[0].down = False

        threading.Thread(target=later, daemon=True).start()

    rollouts = DyingRollouts(die_then_come_back)
    buffer = RolloutBuffer(staleness=2, next_position=0)
    grpo = parse_job(job_doc(grpo={"promptsPerStep": 1})).spec.grpo
    producer = RolloutProducer(
        grpo, iter([Prompt(text="p0")]), lambda p: [1, 2], None, sender=c.sender, rollouts=rollouts, buffer=buffer
    )
    buffer.allow(1)
    producer.start()
    groups, _ = buffer.take(1, version=1, then_allow=0)
    assert [(g.position, g.version) for g in groups] == [(0, 1)]
    assert rollouts.calls == [(1, (0,)), (1, (0,))]  # the same round again, on the replacement
    assert c.sinks[0].live_version == 1  # which was caught up first
    buffer.close()


class FailingRollouts(RecordingRollouts):
    def generate(self, prompts, sampling, *, version, replicas, seeds=None):
        self.calls.append((version, tuple(replicas)))
        raise ReplicasLost("every replica failed to generate (1 prompts lost): replica 0: HTTP 500")


def test_a_round_that_fails_on_every_replica_again_and_again_ends_the_run(cluster):
    """Replicas that answer but fail every request (a bug, not a death): retried a bounded number of times."""
    c = cluster(1)
    c.sender.send(adapter(0), {})
    rollouts, buffer = FailingRollouts(), RolloutBuffer(staleness=0, next_position=0)
    grpo = parse_job(job_doc(grpo={"promptsPerStep": 1})).spec.grpo
    producer = RolloutProducer(
        grpo, iter([Prompt(text="p0")]), lambda p: [1, 2], None, sender=c.sender, rollouts=rollouts, buffer=buffer
    )
    buffer.allow(1)
    producer.start()
    with pytest.raises(ReplicasLost, match="every replica failed"):
        buffer.take(1, version=1, then_allow=0)
    assert len(rollouts.calls) == ROUND_ATTEMPTS


class CountingStore:
    """A store that counts the receiver's looks for a header (`check`): how a test sees a member waiting on it."""

    def __init__(self, store) -> None:
        self._store, self.checks = store, 0

    def check(self, keys) -> bool:
        self.checks += 1
        return self._store.check(keys)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class BlockingTransport(Transport):
    """A member's transport whose collectives block until it is closed (NCCL over P2P/NVLink/SHM does not surface
    a peer's abort: a member inside an abandoned round waits there until its own side aborts). `entered`: a
    collective was posted (on NCCL, a kernel on the member's stream). The header goes through `store` (the epoch's;
    in memory by default), counted."""

    # NCCL's rule (syncfakes._ReturnsWhenAborted): a collective cut by this rank's own abort returns normally
    # instead of raising as gloo's does. Set per test (BlockedMember's `returns_when_closed`).
    returns_when_closed = False

    def __init__(self, *, epoch: int, rank: int, world_size: int, store=None, **_) -> None:
        self.epoch, self.rank, self.world_size, self.device = epoch, rank, world_size, torch.device("cpu")
        self.store = CountingStore(dist.HashStore() if store is None else epoch_store(store, epoch))
        self.left = threading.Event()
        self.entered = threading.Event()

    def start_broadcast(self, tensor, src: int = 0) -> BlockingTransport:
        self.entered.set()
        return self

    def wait(self) -> None:  # the Pending of every collective: it never completes
        self.left.wait()
        if self.returns_when_closed:
            return
        raise TransportError("the group is closed")

    def pieces(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer]

    def all_reduce_sum(self, tensor) -> None:
        self.wait()

    @property
    def closed(self) -> bool:
        return self.left.is_set()

    def close(self) -> None:
        self.left.set()


def test_a_round_whose_collective_never_completes_is_cut_by_the_senders_watchdog():
    """A receiver that hangs (a stuck NCCL peer, a node gone without closing its sockets) leaves the sender inside a
    collective until sync.timeoutSeconds; the watchdog closes the transport after progressTimeoutSeconds without a
    piece, the collective fails, and the sender goes on (it re-forms: the next test)."""
    transport = BlockingTransport(epoch=0, rank=0, world_size=2)
    header, buckets = wire.pack(adapter(0), key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
    raised: list[BaseException] = []

    def send() -> None:
        try:
            send_round(transport, header, buckets, KEY, progress_seconds=0.5)
        except BaseException as exc:
            raised.append(exc)

    sending = threading.Thread(target=send, daemon=True)
    sending.start()
    sending.join(5)
    transport.close()  # frees the thread if the watchdog did not
    assert not sending.is_alive() or raised, "the round was not cut"
    sending.join(5)
    assert raised and isinstance(raised[0], TransportError), raised
    assert "no progress in the round of version 1 for 0.5s; abandoned" in str(raised[0])


def test_a_hung_replica_is_cut_out_by_the_watchdog_long_before_the_sync_timeout(cluster):
    """Real gloo: replica 1 answers its prepare and never enters the round. The round is cut after
    progressTimeoutSeconds without progress, not after sync.timeoutSeconds, and the next epoch forms without it."""
    c = cluster(2, timeout_seconds=20, progress_timeout_seconds=1.0)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    hung = c.members[1]

    def hang(request) -> None:  # answers, then never enters the round, and stops answering (SIGSTOP-like)
        hung.down = True

    hung.prepare = hang
    started = time.monotonic()
    report = c.sender.send(adapter(1), {})
    assert time.monotonic() - started < 10  # the sync timeout is 20 s
    assert report.members == (0,) and c.sender.group == (0,)


class BlockedMember:
    """A member (AdapterReceiver) whose every group's transport is a BlockingTransport (`made`, in order)."""

    def __init__(self, monkeypatch, returns_when_closed: bool = False, **join) -> None:
        from grpolora.workers.sync import receiver as receiver_module

        self.made: list[BlockingTransport] = []

        def blocking_transport(backend, store, **kwargs) -> BlockingTransport:
            self.made.append(BlockingTransport(store=store, **kwargs))
            self.made[-1].returns_when_closed = returns_when_closed
            return self.made[-1]

        monkeypatch.setattr(receiver_module, "create_transport", blocking_transport)
        self.port = free_port()
        self.store = connect_store("127.0.0.1", self.port, is_master=True, timeout_seconds=TIMEOUT)
        self.member = AdapterReceiver(RecordingSink(), replica_index=0, fingerprint="fp", key=KEY)
        self._join = join

    def join(self, epoch: int) -> None:
        self.member.join(
            JoinRequest(
                epoch=epoch, rank=1, world_size=2, store_addr="127.0.0.1", store_port=self.port,
                join_timeout_seconds=TIMEOUT, trainer_fingerprint="fp", current_version=0, **self._join,
            )
        )  # fmt: skip

    def prepared(self) -> None:
        """Joined epoch 0 and told to prepare its round 1, which the sender has not committed (no header)."""
        self.join(0)
        eventually(lambda: self.member.state().epoch == 0)
        self.member.prepare(PrepareRequest(epoch=0, version=1))
        # Waiting for the header (it looks in the store) -- or, wrongly, inside a collective already.
        eventually(lambda: self.made[0].store.checks >= 3 or self.made[0].entered.is_set())

    def inside_a_round(self) -> None:
        """Joined epoch 0 and inside its round's first broadcast: the header came, the payload does not."""
        self.prepared()
        header, _ = wire.pack(adapter(0), key=KEY, version=1, epoch=0, bucket_bytes=1 << 20)
        self.made[0].commit_header(1, header.encode(KEY))  # as the sender would
        assert self.made[0].entered.wait(TIMEOUT)

    def sender_dies(self) -> None:
        """The sender's process is gone, and with it the store it hosts."""
        vars(self).pop("store", None)
        gc.collect()

    def close(self) -> None:
        self.member.close()
        self.sender_dies()


@pytest.fixture
def blocked(monkeypatch):
    made: list[BlockedMember] = []

    def make(returns_when_closed: bool = False, **join) -> BlockedMember:
        made.append(BlockedMember(monkeypatch, returns_when_closed, **join))
        return made[-1]

    yield make
    for member in made:
        member.close()


@pytest.mark.parametrize("returns_when_closed", [False, True], ids=["gloo-raises", "nccl-returns"])
def test_a_member_in_a_stalled_round_leaves_it_and_joins_the_next_epoch(blocked, returns_when_closed):
    """The member's own watchdog: a round in which nothing arrives for progressTimeoutSeconds is left (the member
    is out of that epoch at once, whatever the trainer does), and the next epoch's join is taken. On NCCL the cut
    receive returns normally: the member must still see that it never finished (it landed nothing real), not refuse
    the "round" and stay joined to the closed group."""
    b = blocked(returns_when_closed, backend="gloo", timeout_seconds=3600, progress_timeout_seconds=0.5)
    b.inside_a_round()
    eventually(lambda: b.member.state().epoch is None, seconds=5)  # left the stalled round's epoch on its own
    assert b.made[0].closed
    assert "no progress in the round 1 of epoch 0 for 0.5s" in (b.member.state().last_error or "")
    b.join(1)
    eventually(lambda: b.member.state().epoch == 1, seconds=TIMEOUT)


def test_a_member_inside_an_abandoned_round_joins_the_next_epoch_at_once(blocked):
    """A round abandoned by the trainer (another member's prepare failed, a member died) leaves this member inside
    its first broadcast. The join of the next epoch must free it, well within sync.joinTimeoutSeconds, not after
    sync.timeoutSeconds (an hour here)."""
    b = blocked(backend="nccl", timeout_seconds=3600)
    b.inside_a_round()  # the trainer abandons that round
    started = time.monotonic()
    b.join(1)
    eventually(lambda: b.member.state().epoch == 1, seconds=TIMEOUT)
    assert time.monotonic() - started < TIMEOUT
    assert b.made[0].closed and not b.made[1].closed


# ---- the round's receives are posted only once the sender has committed to it (issue 36, GPU hazards) -----------


def test_a_member_posts_no_receive_while_the_sender_has_not_committed_the_round(cluster, monkeypatch):
    """A receive posted at prepare (on NCCL: a kernel waiting on the member's stream, in vLLM's process) holds every
    device-wide synchronisation of vLLM's (empty_cache, synchronize) until the round runs or is cut. The sender sits
    between the prepares and the round while it packs and until every member's prepare is answered: here member 1's
    is held. Member 0, told to prepare, waits for the header in the store and posts nothing on the group; once
    the sender commits, the round goes through."""
    from grpolora.workers.sync import receiver as receiver_module
    from grpolora.workers.sync import sender as sender_module

    events: list[tuple[str, int]] = []  # ("posted", rank): a collective started; ("committed", 0): the header out
    stores: dict[int, CountingStore] = {}

    def recording(create):
        def create_transport(backend, store, **kwargs) -> Transport:
            transport, rank = create(backend, store, **kwargs), kwargs["rank"]
            start, commit = transport.start_broadcast, transport.commit_header

            def start_broadcast(tensor, src: int = 0):
                events.append(("posted", rank))
                return start(tensor, src)

            def commit_header(version: int, raw: bytes) -> None:
                events.append(("committed", rank))
                commit(version, raw)

            transport.start_broadcast, transport.commit_header = start_broadcast, commit_header
            transport.store = stores[rank] = CountingStore(transport.store)
            return transport

        return create_transport

    monkeypatch.setattr(receiver_module, "create_transport", recording(receiver_module.create_transport))
    monkeypatch.setattr(sender_module, "create_transport", recording(sender_module.create_transport))
    c = cluster(2)
    c.sender.send(adapter(0), {})
    events.clear()
    release = threading.Event()
    answer = c.members[1].prepare

    def held(request: PrepareRequest) -> None:
        assert release.wait(TIMEOUT * 3)
        answer(request)

    c.members[1].prepare = held
    sending = threading.Thread(target=c.sender.send, args=(adapter(1), {}), daemon=True)
    sending.start()
    try:
        checks = stores[1].checks
        eventually(lambda: stores[1].checks >= checks + 3 or ("posted", 1) in events)  # member 0 is rank 1
        assert events == [], "a member posted a receive before the sender committed the round"
    finally:
        release.set()
    sending.join(TIMEOUT * 3)
    c.wait_live(2)
    committed = events.index(("committed", 0))
    assert [event for event in events[:committed] if event[0] == "posted"] == []
    assert {rank for kind, rank in events[committed:] if kind == "posted"} == {0, 1, 2}


def test_a_sender_that_dies_after_the_prepare_leaves_no_receive_posted_on_its_members(blocked):
    """The trainer died (or gave up) between a member's prepare and the round: the member waited on the store, posted
    nothing, and leaves the epoch as soon as the store is gone with the sender's process."""
    b = blocked(backend="nccl", timeout_seconds=3600)
    b.prepared()
    assert not b.made[0].entered.is_set(), "a receive was posted before the sender committed the round"
    b.sender_dies()
    eventually(lambda: b.member.state().epoch is None, seconds=TIMEOUT)
    assert "the sync store failed" in (b.member.state().last_error or "")
    assert not b.made[0].entered.is_set()


def test_a_member_waiting_for_a_header_that_never_comes_takes_the_next_join(blocked):
    """The round was abandoned before the sender committed it (another member's prepare failed): the next epoch's
    join frees the member at once (it closes the epoch it waited in), with nothing ever posted in it."""
    b = blocked(backend="nccl", timeout_seconds=3600)
    b.prepared()
    b.join(1)
    eventually(lambda: b.member.state().epoch == 1, seconds=TIMEOUT)
    assert b.made[0].closed and not b.made[0].entered.is_set()


# ---- fencing: two trainers of one job (a restart whose old pod still runs, a zombie behind a partition) ----------


def test_a_stale_trainer_can_neither_publish_nor_take_the_group_back(cluster):
    """Both hold the job's token. Once the replicas have seen the newer incarnation, the older one's rounds are
    refused before they start, and its join does not break up the newer one's group."""
    c = cluster(2)
    old = c.sender  # incarnation 0
    old.send(adapter(0), {})
    c.wait_live(1)
    new = c.make_sender(incarnation=1)
    new.send(adapter(1), {})
    c.wait_live(2)
    epoch, group = new.epoch, new.group
    with pytest.raises(StaleIncarnation, match="follows incarnation 1, a newer trainer of this job"):
        old.send(adapter(2), {})
    with pytest.raises(StaleIncarnation, match="another trainer of this job has taken over"):
        old.form_group()
    assert [s.live_version for s in c.sinks] == [2, 2]
    assert all(torch.equal(s.adapters[2][n], t) for s in c.sinks for n, t in adapter(1).items())
    assert all(r.state().epoch == epoch for r in c.receivers)  # still in the newer trainer's group
    report = new.send(adapter(3), {})
    assert report.members == group and report.attempts == 1
    new.close()


def test_a_restarted_trainer_counts_no_replica_as_serving_a_version_another_incarnation_sent(cluster):
    """A trainer restarted from a checkpoint of version 1 while the replicas hold version 2 of its predecessor: the
    number is the same, the weights are not. It must not count them as serving its versions until it sent its own."""
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.sender.send(adapter(1), {})
    c.wait_live(2)
    restarted = c.make_sender(incarnation=1, first_version=1)
    restarted.form_group()
    assert restarted.version == 2 and restarted.serving(1) == ()
    report = restarted.send(adapter(5), {})
    assert report.version == 3 and restarted.serving(3) == (0, 1)
    restarted.close()


def test_a_catch_up_does_not_count_a_replica_holding_its_version_number_from_another_incarnation(cluster):
    """Replica 1 was cut off from the restarted trainer (incarnation 1) while the old one (0) reached it alone and
    made its version 2 live there; the new trainer's own version 2 went to replica 0. Back in the group, replica 1
    gets the new trainer's version 2 as a catch-up: it cannot make the number live twice, and must not acknowledge
    it as served, or the trainer would send it version-2 rollouts that run on the old trainer's weights."""
    c = cluster(2)
    c.sender.send(adapter(0), {})
    c.wait_live(1)
    c.members[1].down = True  # cut off from the new trainer
    new = c.make_sender(incarnation=1)
    new.form_group()
    assert new.send(adapter(10), {}).version == 2
    # The old trainer still reaches replica 1.
    old = gloo_sender([LocalMember(1, c.receivers[1])], token=TOKEN, timeout_seconds=TIMEOUT)
    assert old.send(adapter(20), {}).version == 2
    old.close()
    c.members[1].down = False
    assert new.refresh() is True  # re-formed with replica 1, which the catch-up sends version 2
    assert new.serving(2) == (0,)
    assert c.sinks[1].incarnations[2] == 0 and "another trainer incarnation" in c.receivers[1].state().last_error
    report = new.send(adapter(30), {})  # its next version replaces the old trainer's on replica 1
    assert report.members == (0, 1) and c.sinks[1].incarnations[3] == 1
    new.close()


@pytest.mark.parametrize(("value", "incarnation"), [(None, 0), ("", 0), ("3", 3)])
def test_a_trainer_pods_incarnation_is_the_one_its_job_is_marked_with(value, incarnation):
    """Where the trainer's incarnation comes from on a cluster: the operator marks each new trainer Job and its pod
    template with the next incarnation (job_workloads.with_restart_attempt; status.trainerIncarnation), the pod reads
    the annotation through the downward API (empty for the first: Kubernetes' pkg/fieldpath gives a missing
    annotation as "")."""
    from grpolora.api import contract
    from grpolora.api.plan import LoopbackNetwork, plan
    from grpolora.operator import names
    from grpolora.operator.builders import trainer_job
    from grpolora.operator.job_workloads import with_restart_attempt

    planned = plan(parse_job(job_doc()), LoopbackNetwork())
    job = with_restart_attempt(trainer_job(planned), 1, 3)  # restart 1, the fourth trainer Job (a resume between)
    pod = job["spec"]["template"]
    assert pod["metadata"]["annotations"][names.INCARNATION_ANNOTATION] == "3"
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    field = env[contract.TRAINER_INCARNATION]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == f"metadata.annotations['{names.INCARNATION_ANNOTATION}']"
    environ = planned.env_for("trainer", 0, token=TOKEN)
    if value is not None:
        environ[contract.TRAINER_INCARNATION] = value
    assert contract.WorkerEnv.from_environ(environ).trainer_incarnation == incarnation


def test_an_incarnation_that_is_no_number_is_refused_naming_the_variable():
    from grpolora.api import contract
    from grpolora.api.plan import LoopbackNetwork, plan

    environ = plan(parse_job(job_doc()), LoopbackNetwork()).env_for("trainer", 0, token=TOKEN)
    with pytest.raises(contract.ContractError, match="GRPOLORA_TRAINER_INCARNATION='x' is not an integer"):
        contract.WorkerEnv.from_environ(environ | {contract.TRAINER_INCARNATION: "x"})


# ---- NCCL's abort: a cut collective returns normally (issue 45, data plane item 2) ----------------------------


class StallingSink(RecordingSink):
    """An activation slower than progressTimeoutSeconds (vLLM building the LoRA while short of memory, an engine
    busy with a long prefill): version `stall` is held until `release` is set."""

    def __init__(self, stall: int) -> None:
        super().__init__()
        self.stall, self.release, self.stalled = stall, threading.Event(), threading.Event()

    def activate(self, version, tensors, adapter_config, *, incarnation: int = 0) -> None:
        if version == self.stall:
            self.stalled.set()
            assert self.release.wait(60)
        super().activate(version, tensors, adapter_config, incarnation=incarnation)


@pytest.mark.usefixtures("nccl_abort_semantics")
def test_an_aborted_closing_all_reduce_is_a_lost_replica_not_every_replica_refusing(cluster, monkeypatch):
    """NCCL's rules (syncfakes._ReturnsWhenAborted): replica 1's activation of version 2 stalls past the closing
    status's bound (a wedged engine; CLOSING_TIMEOUT_SECONDS, 1 s here), so the closing all-reduce stalls on every
    rank; the sender's watchdog aborts it, and the aborted wait returns normally with the status tensor as it was
    (all zeros). Read as statuses, every replica "refused" and the trainer ended (exit 1). It must be a lost replica:
    the sender re-forms without replica 1 and version 2 goes to replica 0; once replica 1 is free again it rejoins and
    takes version 4. Walked over four rounds."""
    from grpolora.workers.sync import receiver as receiver_module
    from grpolora.workers.sync import sender as sender_module

    for module in (sender_module, receiver_module):
        monkeypatch.setattr(module, "CLOSING_TIMEOUT_SECONDS", 1.0)
    c = cluster(2, progress_timeout_seconds=1.0, join_timeout_seconds=1.5, rejoin_backoff_seconds=0.2)
    slow = StallingSink(stall=2)
    replace_replica(c, 1, slow)
    try:
        walk_rounds_with_a_stalled_activation(c, slow)
    finally:
        slow.release.set()


def walk_rounds_with_a_stalled_activation(c: Cluster, slow: StallingSink) -> None:
    assert c.sender.send(adapter(0), {}).members == (0, 1)
    c.wait_live(1)

    report = c.sender.send(adapter(1), {})  # round 2: the closing all-reduce is cut
    assert slow.stalled.is_set()
    assert report.members == (0,) and report.attempts == 2 and c.sender.group == (0,)
    assert c.sinks[0].live_version == 2

    slow.release.set()  # replica 1 finishes activating; its report of a cut round must fail, not "succeed"
    eventually(lambda: "JoinRequest" in (c.receivers[1].state().last_error or ""), seconds=20)
    eventually(lambda: not c.receivers[1].state().busy)
    assert c.receivers[1].state().epoch is None  # left the aborted group instead of staying "joined" to it

    assert c.sender.send(adapter(2), {}).members == (0,)  # round 3: replica 1 is still benched

    def rejoined() -> bool:  # once its back-off (doubled per failed formation) has passed: back in the group
        c.sender.refresh()
        return c.sender.group == (0, 1)

    eventually(rejoined, seconds=30)
    report = c.sender.send(adapter(3), {})  # round 4
    assert report.members == (0, 1) and report.version == 4
    c.wait_live(4)
    assert all(torch.equal(c.sinks[1].adapters[4][k], v) for k, v in adapter(3).items())


# ---- the round's bounds agree, and the round leaves nothing in the store (issue 45, data plane 6) --------------


class SlowSink(RecordingSink):
    """vLLM's workers building the LoRA for `seconds`: longer than progressTimeoutSeconds, well within the activation's
    own bound (adapter_book.ACTIVATION_TIMEOUT_SECONDS)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def activate(self, version, tensors, adapter_config, *, incarnation: int = 0) -> None:
        time.sleep(self.seconds)
        super().activate(version, tensors, adapter_config, incarnation=incarnation)


@pytest.mark.usefixtures("nccl_abort_semantics")
def test_an_activation_within_its_own_bound_is_not_cut_by_the_rounds_watchdog(cluster):
    """The closing status is the round's last piece and waits for the activation, which the book allows 60 s while
    progressTimeoutSeconds is 30 by default: an activation between the two was cut on both sides (on NCCL, an abort
    mid-activation), re-formed and sent again, every round. The closing piece is given the activation's bound.
    (On gloo each collective keeps the progress bound of its own: gloo.GlooTransport.all_reduce_sum.)"""
    c = cluster(2, progress_timeout_seconds=0.5)
    replace_replica(c, 1, SlowSink(1.5))
    for seed in range(3):
        report = c.sender.send(adapter(seed), {})
        assert (report.members, report.attempts) == ((0, 1), 1), report
    assert c.sender.epoch == 0 and [s.live_version for s in c.sinks] == [3, 3]


def test_a_rounds_header_is_deleted_from_the_store_after_its_round(cluster):
    """Each round wrote epoch/<n>/header/<v> into trainer rank 0's store and nothing removed it: ~75 KB a round for an
    8B model's adapter, for the whole run. Walked over rounds, a re-formation and a catch-up."""
    c = cluster(2)
    for seed in range(3):
        c.sender.send(adapter(seed), {})
    replace_replica(c, 1)
    assert c.sender.refresh() is True  # a new epoch, and the current version sent again to replica 1
    c.wait_live(3, indices=[1])
    c.sender.send(adapter(3), {})
    headers = [
        (epoch, version)
        for epoch in range(c.sender.epoch + 1)
        for version in range(1, 5)
        if epoch_store(c.store, epoch).check([f"header/{version}"])
    ]
    assert headers == []
