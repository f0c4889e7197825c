"""MessageWriter and MessageReader: order, a full pipe that never blocks the writer, frames split
across reads, and either end going away."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

from encore.server.message_pipe import MessageReader, MessageWriter


def _pipe() -> tuple[MessageReader, MessageWriter, Connection, Connection]:
    """The two ends, and the connections that own their descriptors (to close an end)."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    return MessageReader(reader), MessageWriter(writer), reader, writer


def test_messages_arrive_whole_and_in_order():
    reader, writer, _, _ = _pipe()
    sent = [("message", i, "x" * i) for i in range(200)]
    for message in sent:
        assert writer.send(message)
    assert reader.read() == sent
    assert reader.read() == [] and not reader.eof


def test_a_full_pipe_never_blocks_the_writer_and_loses_nothing():
    reader, writer, _, _ = _pipe()
    sent = [i.to_bytes(4, "big") * 25_000 for i in range(50)]  # 5 MB, far past a pipe's buffer
    assert not all([writer.send(message) for message in sent]) and writer.pending
    received = []
    while len(received) < len(sent):
        received += reader.read()
        writer.flush()
    assert received == sent and not writer.pending


def test_a_frame_split_across_reads_waits_for_its_rest():
    reader, writer, _, _ = _pipe()
    assert not writer.send("y" * 1_000_000)  # bigger than the pipe: it goes in parts
    assert reader.read() == []
    received = []
    while not received:
        writer.flush()
        received = reader.read()
    assert received == ["y" * 1_000_000]


def test_drain_gives_up_after_its_timeout_when_nobody_reads():
    reader, writer, _, _ = _pipe()
    writer.send(bytes(1_000_000))
    writer.drain(0.05)
    assert writer.pending


def test_the_reader_sees_the_end_and_a_writer_without_reader_drops_its_messages():
    reader, writer, _, write_end = _pipe()
    writer.send("last")
    write_end.close()
    assert reader.read() == ["last"] and reader.eof
    reader, writer, read_end, _ = _pipe()
    read_end.close()
    assert writer.send("nobody reads this") and not writer.pending
