"""Streaming safetensors shards straight into parameters.

A checkpoint tensor's bytes go from its file into its destination with no tensor in between. On the
CPU each tensor is read (``preadv``) into the parameter itself. On CUDA a few threads read the shards,
in file order, into a ring of pinned buffers, and each buffer is copied to the GPU on a side stream
while the threads read the next ones. safetensors' ``get_tensor`` builds a CPU tensor for every
checkpoint tensor (a copy out of its mmap), which ``copy_`` then sends from pageable memory, one
blocking copy at a time: on a V2-Lite checkpoint that is ~5000 expert tensors of 5.8 MB each.

Only the header is parsed here (8-byte little-endian length, then JSON: dtype, shape, byte offsets
from the end of the header); a header that does not add up is an error naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from encore.models.shards import open_files

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
           "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}
_MAX_HEADER = 100 << 20  # safetensors' own limit

CHUNK_BYTES = 16 << 20  # one pinned buffer: a few expert tensors, or a slice of an embedding
READERS = 8  # threads reading the shards
SLOTS = 2 * READERS  # pinned buffers: while the threads read into half, the other half is copied


@dataclass(frozen=True, slots=True)
class StoredTensor:
    path: Path
    name: str
    dtype: torch.dtype | None  # None: a dtype encore does not read (an error only if it is loaded)
    dtype_name: str  # safetensors' own
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int


def stored_tensors(path: Path) -> list[StoredTensor]:
    """The tensors of one safetensors file, in file order."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file: {size} bytes")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{str(path)!r} is not a safetensors file: header length {length}, file {size} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ValueError(f"{str(path)!r} has an unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{str(path)!r} has a safetensors header that is not a JSON object")
    base = 8 + length
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dtype = _DTYPES.get(dtype_name)
            whole = (end - begin == dtype.itemsize * math.prod(shape)) if dtype is not None else end >= begin
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{str(path)!r}: tensor {name} has a malformed header entry {info!r}") from None
        if not whole or begin < 0 or base + end > size:
            raise ValueError(f"{str(path)!r}: tensor {name} ({dtype_name} {list(shape)}) has data_offsets "
                             f"[{begin}, {end}] in a file of {size} bytes")
        tensors.append(StoredTensor(path, name, dtype, dtype_name, shape, base + begin, end - begin))
    return sorted(tensors, key=lambda t: t.offset)


def read_into(pairs: list[tuple[StoredTensor, torch.Tensor]]) -> None:
    """Fills each destination (its stored tensor's shape, any dtype: cast on its own device) with its
    stored tensor. All destinations are on one device."""
    unreadable = [src for src, _ in pairs if src.dtype is None]
    if unreadable:
        src = unreadable[0]
        raise ValueError(f"{str(src.path)!r}: tensor {src.name} has dtype {src.dtype_name}; encore reads "
                         f"{sorted(_DTYPES)}")
    if not pairs:
        return
    device = pairs[0][1].device
    if device.type == "cuda":
        _PinnedStream(device).run(pairs)
        return
    with open_files(dict.fromkeys(src.path for src, _ in pairs)) as fds:
        for src, dest in pairs:
            direct = _direct(src, dest)
            buf = dest if direct else torch.empty(src.shape, dtype=src.dtype)
            _pread(fds[src.path], _bytes(buf), src.offset, src.path)
            if not direct:
                dest.copy_(buf)


def _direct(src: StoredTensor, dest: torch.Tensor) -> bool:
    """Whether the stored bytes can go straight into ``dest`` (else through a tensor of the stored dtype)."""
    return dest.dtype == src.dtype and dest.is_contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # t contiguous: a view


def _pread(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    """Fills ``out`` (uint8) with the file's bytes from ``offset``; preadv drops the GIL."""
    view = memoryview(out.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{str(path)!r} ended at byte {offset + done} while being read")
        done += n


@dataclass(slots=True)
class _Part:
    """One stored tensor's bytes [start, start + n) at ``at`` in a chunk."""
    src: StoredTensor
    dest: torch.Tensor
    start: int
    n: int
    at: int


@dataclass(slots=True)
class _Chunk:
    path: Path
    offset: int
    nbytes: int
    parts: list[_Part]


def _chunks(pairs: list[tuple[StoredTensor, torch.Tensor]]) -> list[_Chunk]:
    """Contiguous file ranges of at most CHUNK_BYTES: neighbouring tensors share one, a large tensor
    spans several."""
    chunks: list[_Chunk] = []
    for src, dest in sorted(pairs, key=lambda p: (str(p[0].path), p[0].offset)):
        start = 0
        while start < src.nbytes:  # an empty tensor has nothing to read
            last = chunks[-1] if chunks else None
            if (last is None or last.path != src.path or last.offset + last.nbytes != src.offset + start
                    or last.nbytes == CHUNK_BYTES):
                last = _Chunk(src.path, src.offset + start, 0, [])
                chunks.append(last)
            n = min(src.nbytes - start, CHUNK_BYTES - last.nbytes)
            last.parts.append(_Part(src, dest, start, n, last.nbytes))
            last.nbytes += n
            start += n
    return chunks


class _PinnedStream:
    """Reads chunks into a ring of pinned buffers on READERS threads, in order, and copies each to the GPU
    on a side stream; a buffer is read into again once the event after its last copy has passed. A
    destination of another dtype or layout gets its tensor through a scratch tensor on the GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.scratch: dict[str, torch.Tensor] = {}

    def run(self, pairs: list[tuple[StoredTensor, torch.Tensor]]) -> None:
        chunks = _chunks(pairs)
        slots = min(SLOTS, len(chunks))
        ring = torch.empty(slots, CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        # The destinations' memory may have been freed by kernels still queued on the current stream.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with open_files(dict.fromkeys(c.path for c in chunks)) as fds, \
                    ThreadPoolExecutor(READERS, thread_name_prefix="encore-load") as pool, \
                    torch.cuda.stream(self.stream):
                reads: deque[Future] = deque(pool.submit(_read_chunk, ring[i], fds[chunks[i].path], chunks[i], None)
                                             for i in range(slots))
                for i, chunk in enumerate(chunks):
                    reads.popleft().result()
                    self._send(chunk, ring[i % slots])
                    if i + slots < len(chunks):
                        sent = torch.cuda.Event()
                        sent.record(self.stream)
                        nxt = chunks[i + slots]
                        reads.append(pool.submit(_read_chunk, ring[i % slots], fds[nxt.path], nxt, sent))
        finally:
            self.stream.synchronize()  # on an error too: no copy may still write into a parameter
            del ring
            torch._C._host_emptyCache()  # the ring's pinned pages back to the OS

    def _send(self, chunk: _Chunk, buf: torch.Tensor) -> None:
        for part in chunk.parts:
            src, dest = part.src, part.dest
            direct = _direct(src, dest)
            if direct:
                target = dest
            elif part.start == 0:
                target = self.scratch[src.name] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            else:
                target = self.scratch[src.name]
            _bytes(target)[part.start:part.start + part.n].copy_(buf[part.at:part.at + part.n], non_blocking=True)
            if not direct and part.start + part.n == src.nbytes:
                dest.copy_(self.scratch.pop(src.name))


def _read_chunk(buf: torch.Tensor, fd: int, chunk: _Chunk, sent: torch.cuda.Event | None) -> None:
    """Reads ``chunk`` into its ring buffer once ``sent`` (recorded after the copies out of that buffer
    that the ring's last lap queued) has passed."""
    if sent is not None:
        sent.synchronize()
    _pread(fd, buf[:chunk.nbytes], chunk.offset, chunk.path)
