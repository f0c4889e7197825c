"""Host tensors from Python lists, for the per-step copies to the device.

``torch.tensor(list)`` converts element by element through PyTorch's generic sequence path: ~60 µs
for 600 ints on this repo's CPU. Packing the list into an ``array`` first and wrapping its buffer
takes ~20 µs, and a step builds several such tensors (the batch layout, the sampling parameters).

Each host-to-device copy costs ~10 µs of host time on an H100 host, so a step's fields go in as few
copies as possible (``upload``). Pinned staging does not make them cheaper through PyTorch: buffers
from its caching host allocator (an allocation and a recorded event per copy) made a bs-1 step of
encore-tiny ~100 µs slower (session 16, benchmarks/README.md), and a pageable source is free again as
soon as the copy call returns.

The other way, ``Readback`` copies device tensors to the host behind the work already queued and reads
them once they have landed, so that the host can queue more work first.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}
_ALIGN = 8  # bytes: each part of an ``upload`` starts at a multiple of the widest element


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``values`` (ints or floats) in ``dtype`` (int64, int32 or float32)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


def put(host: memoryview, offset: int, values: Sequence, dtype: torch.dtype) -> None:
    """Writes ``values`` packed as ``dtype`` into the bytes ``host`` at byte ``offset``; an ``array``
    already of ``dtype``'s typecode is copied as it is (``array.array(code, other)`` goes element by
    element)."""
    code = _TYPECODES[dtype]
    packed = values if isinstance(values, array.array) and values.typecode == code else array.array(code, values)
    host[offset:offset + len(packed) * packed.itemsize] = memoryview(packed).cast("B")


def view_at(typed: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """``count`` elements of the 1-D tensor ``typed`` from byte ``offset`` on (a multiple of its
    element size)."""
    start = offset // typed.element_size()
    return typed[start:start + count]


def upload(parts: Sequence[tuple[Sequence, torch.dtype]], device: torch.device | str,
           stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
    """1-D tensors on ``device`` of each (values, dtype) in ``parts``, in one host-to-device copy: the
    parts are packed back to back (each at an 8-byte-aligned offset) into one host buffer, and the
    device copy of it is cut into views of the parts' dtypes. The copy does not wait for the device
    (``torch.tensor(values, device=cuda)`` does: a step that sent its lists that way stalled the host
    on its own forward, session 39). ``stream``: the copy is issued there, so that it need not wait
    behind the work already queued on the current stream, which then waits for it (and keeps its
    memory from being handed out again until done with it)."""
    offsets, total = [], 0
    for values, dtype in parts:
        offsets.append(total)
        total += -(-len(values) * dtype.itemsize // _ALIGN) * _ALIGN
    host = bytearray(max(total, _ALIGN))
    view = memoryview(host)
    for (values, dtype), offset in zip(parts, offsets):
        put(view, offset, values, dtype)
    on_device = _copy(torch.frombuffer(host, dtype=torch.uint8), torch.device(device), stream)
    typed = {dtype: on_device.view(dtype) for _, dtype in parts}
    return [view_at(typed[dtype], offset, len(values)) for (values, dtype), offset in zip(parts, offsets)]


def _copy(host: torch.Tensor, device: torch.device, stream: torch.cuda.Stream | None) -> torch.Tensor:
    if stream is None:
        return host.to(device, non_blocking=True)
    with torch.cuda.stream(stream):
        on_device = host.to(device, non_blocking=True)
    consumer = torch.cuda.current_stream(device)
    on_device.record_stream(consumer)  # its memory is not handed out again before the consumer is done
    consumer.wait_stream(stream)
    return on_device


class Readback:
    """Device tensors (None allowed) read to the host as lists. ``behind`` (CUDA): each is copied on the
    current stream behind the work queued there and read once an event says it has landed, so that the
    host can launch more before ``lists`` waits (the device runs that while the host waits); otherwise
    read at once by ``lists``."""

    def __init__(self, tensors: Sequence[torch.Tensor | None], behind: bool = False) -> None:
        self.event = None
        if behind and tensors[0].is_cuda:
            tensors = [t.to("cpu", non_blocking=True) if t is not None else None for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()
        self.tensors = tensors

    def lists(self) -> list[list | None]:
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() if t is not None else None for t in self.tensors]
