"""Reading safetensors files into parameters, against safetensors' own reader."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from encore.models import weight_stream
from encore.models.weight_stream import read_into, stored_tensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "f32": torch.randn(5, 3, 7, generator=g),
        "f16": torch.randn(11, generator=g).to(torch.float16),
        "i64": torch.randint(-2**40, 2**40, (6,), generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "f8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path, metadata={"format": "pt"})
    return path


def test_the_header_gives_every_tensor_in_file_order(shard):
    want = load_file(shard)
    stored = stored_tensors(shard)
    assert {t.name for t in stored} == set(want)
    assert [t.offset for t in stored] == sorted(t.offset for t in stored)
    for t in stored:
        assert (t.dtype, t.shape) == (want[t.name].dtype, tuple(want[t.name].shape)), t.name
        assert t.nbytes == want[t.name].numel() * want[t.name].element_size()


def test_read_into_matches_safetensors_in_place_cast_and_strided(shard):
    want = load_file(shard)
    stored = {t.name: t for t in stored_tensors(shard)}
    same = {name: torch.full_like(t, 0) for name, t in want.items()}
    cast = torch.zeros(37, 19, dtype=torch.float32)  # bf16 -> float32
    wide = torch.zeros(5, 3, 14)  # a strided half of a wider parameter
    read_into([(stored[n], same[n]) for n in same] + [(stored["bf16"], cast), (stored["f32"], wide[..., 7:])])
    for name, t in want.items():
        assert same[name].dtype == t.dtype and torch.equal(same[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert torch.equal(cast, want["bf16"].float())
    assert torch.equal(wide[..., 7:], want["f32"]) and not wide[..., :7].any()


def _write(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("header, data, match", [
    (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 8, r"tensor w .*\[0, 16\]"),
    (b'{"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}', b"\0" * 16, r"tensor w .*\[3\]"),
    (b'{"w": {"dtype": "F32", "shape": [4]}}', b"\0" * 16, r"tensor w has a malformed header entry"),
    (b'{"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}', b"\0" * 16, r"tensor w has a malformed"),
    (b'{"w": 7}', b"", r"tensor w has a malformed header entry 7"),
    (b'[1, 2]', b"", r"header that is not a JSON object"),
    (b'{"w": ', b"", r"unreadable safetensors header"),
])
def test_a_bad_header_names_the_file_and_tensor(tmp_path, header, data, match):
    path = tmp_path / "bad.safetensors"
    _write(path, header, data)
    with pytest.raises(ValueError, match=match) as info:
        stored_tensors(path)
    assert str(path) in str(info.value)


def test_a_dtype_encore_cannot_read_is_an_error_only_when_loaded(tmp_path):
    path = tmp_path / "c64.safetensors"
    _write(path, b'{"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}', b"\0" * 8)
    (stored,) = stored_tensors(path)
    assert stored.dtype is None and stored.dtype_name == "C64"
    read_into([])  # skipped by the loader: nothing to say
    with pytest.raises(ValueError, match=r"tensor w has dtype C64; encore reads \['BF16'"):
        read_into([(stored, torch.zeros(1))])


def test_a_file_truncated_after_its_header_was_read_is_named(shard):
    stored = stored_tensors(shard)
    last = stored[-1]
    with open(shard, "r+b") as f:
        f.truncate(last.offset + last.nbytes // 2)
    with pytest.raises(ValueError, match=r"ended at byte \d+ while being read") as info:
        read_into([(last, torch.empty(last.shape, dtype=last.dtype))])
    assert str(shard) in str(info.value)


def test_a_file_too_short_for_its_header_length_is_named(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(ValueError, match=r"not a safetensors file: header length 1048576"):
        stored_tensors(path)


def test_chunks_cover_each_tensor_once_sharing_and_splitting(shard, monkeypatch):
    monkeypatch.setattr(weight_stream, "CHUNK_BYTES", 64)
    stored = stored_tensors(shard)
    skipped = "f32"  # a gap in the file: the chunk before it ends there
    assert next(t for t in stored if t.name == skipped).nbytes > 0
    pairs = [(t, torch.empty(t.shape, dtype=t.dtype)) for t in stored if t.name != skipped]
    chunks = weight_stream._chunks(pairs)
    seen = {t.name: [] for t, _ in pairs}
    for c in chunks:
        assert 0 < c.nbytes <= 64
        at = 0
        for p in c.parts:
            assert p.at == at and c.offset + p.at == p.src.offset + p.start
            seen[p.src.name].append((p.start, p.n))
            at += p.n
        assert at == c.nbytes
    for t, _ in pairs:
        covered = 0
        for start, n in seen[t.name]:
            assert start == covered
            covered += n
        assert covered == t.nbytes, t.name
    assert any(len(c.parts) > 1 for c in chunks)  # neighbours share a chunk
    assert len(seen["bf16"]) > 1  # 1406 bytes over 64-byte chunks
    gap = next(t for t in stored if t.name == skipped)
    assert not any(c.offset < gap.offset + gap.nbytes and gap.offset < c.offset + c.nbytes for c in chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("slow_copies", [False, True], ids=["plain", "slow-copies"])
def test_pinned_stream_matches_safetensors_on_cuda(tmp_path, monkeypatch, slow_copies):
    """A ring of 3 buffers of 256 bytes over ~6 KB: every buffer is reused several times. With slow
    copies (a ~1 ms sleep queued on the copy stream before each chunk's copies) a reader that refilled a
    buffer before its copies ran would corrupt the tensors."""
    monkeypatch.setattr(weight_stream, "CHUNK_BYTES", 256)
    monkeypatch.setattr(weight_stream, "READERS", 2)
    monkeypatch.setattr(weight_stream, "SLOTS", 3)
    if slow_copies:
        send = weight_stream._PinnedStream._send

        def slow_send(self, chunk, buf):
            torch.cuda._sleep(2_000_000)
            send(self, chunk, buf)

        monkeypatch.setattr(weight_stream._PinnedStream, "_send", slow_send)
    path = tmp_path / "model.safetensors"
    save_file(_tensors(), path, metadata={"format": "pt"})
    want = load_file(path)
    stored = {t.name: t for t in stored_tensors(path)}
    same = {name: torch.zeros_like(t, device="cuda") for name, t in want.items()}
    cast = torch.zeros(37, 19, dtype=torch.float32, device="cuda")
    wide = torch.zeros(5, 3, 14, device="cuda")
    read_into([(stored[n], same[n]) for n in same] + [(stored["bf16"], cast), (stored["f32"], wide[..., 7:])])
    for name, t in want.items():
        assert torch.equal(same[name].cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert torch.equal(cast.cpu(), want["bf16"].float())
    assert torch.equal(wide[..., 7:].cpu(), want["f32"]) and not wide[..., :7].any()
