"""A checkpoint's safetensors files, and reading them into the page cache ahead of the loader.

No torch here: ``encore serve``'s engine process starts the read before its own imports (torch, Dynamo:
~9 s on the GPU machine), so that a checkpoint not yet in the page cache comes off the disk while they
run instead of after them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

_PIECE = 16 << 20


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The shards in the order the loader reads them."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(model_dir)!r}")


def prefetch(files: list[Path], budget: int, threads: int = 4) -> int:
    """Reads the files, in order, up to ``budget`` bytes, on ``threads`` daemon threads into throwaway
    buffers, which leaves them in the page cache; returns the bytes it set out to read. A read that
    fails ends its thread quietly: the loader reads the same bytes and reports it. (``POSIX_FADV_WILLNEED``
    would read at most the device's readahead window a call, 128 KB by default.)"""
    pieces = []
    total = 0
    for path in files:
        size = max(min(path.stat().st_size, budget - total), 0)
        pieces += [(path, offset, min(_PIECE, size - offset)) for offset in range(0, size, _PIECE)]
        total += size
    queue = iter(pieces)
    lock = threading.Lock()

    def read() -> None:
        buf = memoryview(bytearray(_PIECE))
        while True:
            with lock:
                piece = next(queue, None)
            if piece is None:
                return
            path, offset, n = piece
            try:
                os.preadv(fds[path], [buf[:n]], offset)
            except OSError as exc:
                log.debug("checkpoint prefetch: reading %s failed: %s", path, exc)
                return

    with open_files(dict.fromkeys(piece[0] for piece in pieces)) as fds:
        readers = [threading.Thread(target=read, name="encore-prefetch", daemon=True) for _ in range(threads)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
    return total


@contextmanager
def open_files(paths: Iterable[Path]) -> Iterator[dict[Path, int]]:
    """Read-only descriptors of ``paths``, closed on leaving (also those opened before one that failed)."""
    fds: dict[Path, int] = {}
    try:
        for path in paths:
            fds[path] = os.open(path, os.O_RDONLY)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def evict(files: list[Path]) -> None:
    """Drops the files' pages from the page cache, written back first (dirty pages are not dropped);
    ``posix_fadvise`` needs no root. For benchmarks and tests of a start whose checkpoint comes off the
    disk."""
    with open_files(files) as fds:
        for fd in fds.values():
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes this process may still fill: MemAvailable, or less under a cgroup memory limit (v2
    ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), which
    the page cache counts against."""
    available = None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise OSError(f"{meminfo} has no MemAvailable")
    for limit, usage in (("memory.max", "memory.current"),  # v2, then v1
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap, used = (cgroup / limit).read_text().strip(), int((cgroup / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap != "max":
            available = min(available, max(int(cap) - used, 0))
    return available


def prefetch_in_background(model_dir: str | Path | None) -> threading.Thread | None:
    """Starts reading the checkpoint into the page cache on daemon threads (an engine that exits does
    not wait for them), at most half the memory available: past that its last pages would evict its
    first before the loader reads them. Linux only (/proc/meminfo); None (the embedded model, small)
    reads nothing; a checkpoint that cannot be read is left for the loader to report."""
    if model_dir is None or not os.path.exists("/proc/meminfo"):
        return None

    def run() -> None:
        start = time.perf_counter()
        try:
            files = checkpoint_files(Path(model_dir))
            done = prefetch(files, available_memory() // 2)
        except (OSError, ValueError, KeyError) as exc:
            log.debug("checkpoint prefetch skipped: %s", exc)
            return
        log.info("checkpoint prefetch: %.1f GB of %s in %.1fs", done / 1e9, model_dir, time.perf_counter() - start)

    thread = threading.Thread(target=run, name="encore-prefetch", daemon=True)
    thread.start()
    return thread
