"""Reading a checkpoint's files into the page cache ahead of the loader (models/shards.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest

from encore.models import shards
from encore.models.shards import available_memory, checkpoint_files, evict, prefetch, prefetch_in_background

MB = 1 << 20


def resident(path) -> float:
    """The share of the file's pages in the page cache (mincore over a private mapping)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    view = ctypes.c_char.from_buffer(mapped)
    try:
        assert libc.mincore(ctypes.addressof(view), size, vec) == 0, os.strerror(ctypes.get_errno())
    finally:
        del view
        mapped.close()
    return sum(v & 1 for v in vec) / pages


def evicted(files) -> list:
    evict(files)
    if any(resident(path) > 0 for path in files):
        pytest.skip("this filesystem keeps a file's pages after POSIX_FADV_DONTNEED (tmpfs?)")
    return files


@pytest.fixture
def three_shards(tmp_path):
    files = []
    for i in range(3):
        path = tmp_path / f"layer-{i}.safetensors"
        path.write_bytes(os.urandom(16 * MB))
        files.append(path)
    return files


def test_prefetch_reads_the_files_in_order_up_to_its_budget(three_shards, monkeypatch):
    monkeypatch.setattr(shards, "_PIECE", 3 * MB)  # pieces that do not divide a file
    files = evicted(three_shards)
    assert prefetch(files, budget=24 * MB) == 24 * MB
    assert resident(files[0]) == 1.0
    assert resident(files[1]) >= 0.5  # and the kernel's readahead past the budget, within the file
    assert resident(files[2]) == 0.0


def test_prefetch_reads_a_whole_checkpoint_within_budget(three_shards):
    files = evicted(three_shards)
    assert prefetch(files, budget=1 << 40) == 48 * MB
    assert [resident(path) for path in files] == [1.0, 1.0, 1.0]


def test_prefetch_in_background_reads_a_checkpoint(three_shards):
    index = three_shards[0].parent / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "layer-0.safetensors", "b": "layer-1.safetensors"}}')
    files = evicted(three_shards)
    thread = prefetch_in_background(index.parent)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert [resident(path) for path in files] == [1.0, 1.0, 0.0]  # the index's shards only


def test_a_read_that_fails_ends_the_prefetch_quietly(three_shards, monkeypatch):
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)

    def failing(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing)
    assert prefetch(three_shards, budget=1 << 40) == 48 * MB  # what it set out to read
    assert raised == []


def test_available_memory_is_capped_by_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == 4000000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert available_memory(meminfo, cgroup) == 4000000 * 1024  # v2, unlimited
    (cgroup / "memory.max").write_text(f"{3 * 1024 ** 3}\n")
    (cgroup / "memory.current").write_text(f"{1024 ** 3}\n")
    assert available_memory(meminfo, cgroup) == 2 * 1024 ** 3  # v2: the limit less the usage
    (cgroup / "memory.max").unlink()
    (cgroup / "memory").mkdir()
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{1024 ** 3}\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text(f"{1024 ** 2}\n")
    assert available_memory(meminfo, cgroup) == 1024 ** 3 - 1024 ** 2  # v1


def test_the_files_are_the_loaders_shards_in_its_order(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "b.safetensors", "c": "a.safetensors", "d": "b.safetensors"}}')
    for name in ("a.safetensors", "b.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert checkpoint_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_a_checkpoint_that_cannot_be_read_is_left_to_the_loader(tmp_path, monkeypatch):
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    assert prefetch_in_background(None) is None  # the embedded model
    thread = prefetch_in_background(tmp_path / "no-such-model")
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive() and raised == []
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        checkpoint_files(tmp_path / "no-such-model")
