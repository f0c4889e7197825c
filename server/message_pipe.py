"""Pickled messages over a one-way pipe between the server and engine processes, never blocking a sender.

Each side writes from the thread that produced the message (the engine between steps, the server
on its event loop). ``multiprocessing.Queue`` hands the pickling and the write to a feeder thread
and needs a reader thread on the other side, and each of them must take the GIL from a thread that
is busy (the engine loop, the event loop): with 64 streams on a 2-core host the engine's time
between steps fell from ~1.0-1.3 ms to ~0.6 ms without them (and with the cheaper pickling of
``messages.StepResult``). Instead the write end is non-blocking: what the pipe cannot take now
waits in the writer's buffer and goes out with the next ``send`` or ``flush``, so a reader that
falls behind never stalls the writer. The read end is non-blocking too,
so the server reads it on its event loop (``loop.add_reader``) and the engine after ``select``.
A frame is an 8-byte length, then the pickle.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from collections import deque
from multiprocessing.connection import Connection

_HEADER = struct.Struct("!Q")
_READ_BYTES = 1 << 20


class MessageWriter:
    """The write end. ``connection`` (one end of ``multiprocessing.Pipe``) only owns the descriptor,
    so that the pipe can be handed to a spawned process."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection  # owns the descriptor: kept, so that it stays open
        self._fd = connection.fileno()
        os.set_blocking(self._fd, False)
        self._frames: deque[memoryview] = deque()  # not yet written; the first may be partly written

    def fileno(self) -> int:
        return self._fd

    @property
    def pending(self) -> bool:
        return bool(self._frames)

    def send(self, message) -> bool:
        """Writes ``message``, or as much of it as the pipe takes now; True if nothing is left pending."""
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        self._frames.append(memoryview(_HEADER.pack(len(data)) + data))
        return self.flush()

    def flush(self) -> bool:
        """Writes what is pending without blocking; True if nothing is left. Once the reader has gone
        (a broken pipe) nothing is read any more and everything is dropped."""
        while self._frames:
            frame = self._frames[0]
            try:
                written = os.write(self._fd, frame)
            except BlockingIOError:
                return False
            except BrokenPipeError:
                self._frames.clear()
                return True
            if written < len(frame):
                self._frames[0] = frame[written:]
                return False
            self._frames.popleft()
        return True

    def drain(self, timeout: float) -> None:
        """Blocks until everything is written, for ``timeout`` seconds at most (at exit, so that the
        last messages, a ``Fatal`` among them, reach the reader)."""
        deadline = time.monotonic() + timeout
        while not self.flush():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            select.select([], [self._fd], [], left)


class MessageReader:
    """The read end; ``read`` returns the messages that have arrived whole, without blocking."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection  # owns the descriptor: kept, so that it stays open
        self._fd = connection.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = bytearray()
        self.eof = False  # every writer has closed its end and everything has been read

    def fileno(self) -> int:
        return self._fd

    def read(self) -> list:
        while not self.eof:
            try:
                chunk = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                break
            if chunk:
                self._buffer += chunk
            else:
                self.eof = True
        messages, start = [], 0
        with memoryview(self._buffer) as view:
            while len(view) - start >= _HEADER.size:
                (size,) = _HEADER.unpack_from(view, start)
                end = start + _HEADER.size + size
                if end > len(view):
                    break  # the rest of this frame is still on its way
                messages.append(pickle.loads(view[start + _HEADER.size:end]))
                start = end
        del self._buffer[:start]
        return messages
