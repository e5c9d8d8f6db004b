"""Compressed Arrow IPC: puts written with `IpcWriteOptions(compression="lz4"|"zstd")`, and
compressed bodies that lie about their sizes.

A compressed buffer starts with the length it decompresses to, which the server must bound and
pay for before Arrow allocates it: a few bytes that declare a terabyte must cost nothing.
"""

import json
import struct

import grpc
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import rawflight
from test_flight import get, unique

CODECS = ["lz4", "zstd"]


def table(rows=200_000):
    return pa.table({
        "id": pa.array(range(rows), pa.int64()),
        "value": pa.array([i % 97 * 0.5 if i % 13 else None for i in range(rows)], pa.float64()),
        "name": pa.array([f"name-{i % 1000}" for i in range(rows)]),
        "kind": pa.array([["a", "b", "c"][i % 3] for i in range(rows)]).dictionary_encode(),
    })


def compressed_put(client, name, data, codec, chunk=50_000):
    options = flight.FlightCallOptions(write_options=pa.ipc.IpcWriteOptions(compression=codec))
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(name), data.schema, options=options)
    writer.write_table(data, max_chunksize=chunk)
    writer.done_writing()
    reader.read()
    writer.close()


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_puts_round_trip(client, codec):
    name = unique(codec)
    data = table()
    compressed_put(client, name, data, codec)
    assert get(client, name).equals(data)


def compressed_messages(batch, codec):
    """The IPC messages of a one-batch stream written with `codec`: [(header, body)], schema
    first; each header is the flatbuffer alone, as FlightData carries it."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        writer.write_batch(batch)
    reader = pa.ipc.MessageReader.open_stream(sink.getvalue())
    messages = []
    for message in reader:
        messages.append((message.metadata.to_pybytes(), message.body.to_pybytes() if message.body else b""))
    return messages


def put_raw(server, name, messages):
    (schema_header, _), *batches = messages
    first = rawflight.flight_data(schema_header, descriptor=rawflight.path_descriptor(name))
    with rawflight.RawFlight(server.location) as raw:
        return raw.do_put([first, *(rawflight.flight_data(h, b) for h, b in batches)])


def with_declared_length(body, declared):
    """The body with its first buffer (the int64 values: no nulls, so no validity buffer)
    declaring `declared` bytes uncompressed."""
    return struct.pack("<q", declared) + body[8:]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("declared, code, says", [
    # Over --max-put-message-bytes: refused from the prefix alone.
    (2**40, grpc.StatusCode.RESOURCE_EXHAUSTED, "uncompressed size"),
    (2**63 - 1, grpc.StatusCode.RESOURCE_EXHAUSTED, "uncompressed size"),
    # Within the message limit but over the memory budget: refused before it is allocated.
    (512 << 20, grpc.StatusCode.RESOURCE_EXHAUSTED, "memory"),
    # Less than the data decompresses to: Arrow stops at the declared length.
    (16, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (-5, grpc.StatusCode.INVALID_ARGUMENT, "declares -5 bytes"),
], ids=["1TiB", "2^63", "512MiB", "short", "negative"])
def test_compressed_sizes_are_bounded_and_paid_for_first(make_server, codec, declared, code, says):
    server = make_server("--memory-limit", "64MiB", "--host-memory-limit", "0")
    baseline = server.used_bytes()
    batch = pa.record_batch({"x": pa.array(range(100_000), pa.int64())})
    schema, (header, body) = compressed_messages(batch, codec)
    code_seen, details = put_raw(server, "bomb", [schema, (header, with_declared_length(body, declared))])
    assert code_seen == code, (code_seen, details)
    assert says in details, details
    assert server.used_bytes() == baseline
    with server.client() as client:
        # The server is unharmed, and the same batch with its true sizes goes in.
        assert put_raw(server, "bomb", [schema, (header, body)])[0] == grpc.StatusCode.OK
        assert client.do_get(flight.Ticket(b"bomb")).read_all().column("x") == pa.chunked_array([batch.column(0)])


def compressible(rows=300_000):
    return pa.table({
        "id": pa.array(range(rows), pa.int64()),
        "city": pa.array([["Paris", "Oslo", "Lima"][i % 3] for i in range(rows)]),
        "zeros": pa.array([0.0] * rows),
    })


@pytest.mark.parametrize("codec", CODECS)
def test_reads_are_compressed_when_get_flight_info_asks(server, client, codec):
    """GetFlightInfo with a CMD descriptor {"name", "compression"} issues tickets whose replies
    are compressed: pyarrow reads them as usual, and the wire carries a fraction of the bytes."""
    name = unique(codec)
    data = compressible()
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(name), data.schema)
    writer.write_table(data)
    writer.done_writing()
    reader.read()
    writer.close()
    command = flight.FlightDescriptor.for_command(json.dumps({"name": name, "compression": codec}))
    info = client.get_flight_info(command)
    assert info.total_records == data.num_rows
    assert info.descriptor == command, "the FlightInfo carries the caller's descriptor"
    assert client.get_schema(command).schema == data.schema
    got = pa.concat_tables(client.do_get(e.ticket).read_all() for e in info.endpoints)
    assert got.equals(data)
    plain = client.get_flight_info(flight.FlightDescriptor.for_path(name))
    with rawflight.RawFlight(server.location) as raw:
        wire = sum(len(m) for e in info.endpoints for m in raw.do_get(e.ticket.ticket))
        uncompressed = sum(len(m) for e in plain.endpoints for m in raw.do_get(e.ticket.ticket))
    assert wire * 2 < uncompressed, (wire, uncompressed)


@pytest.mark.parametrize("command", [
    {"name": "x", "compression": "gzip"},
    {"name": "x", "compresion": "lz4"},
    {"compression": "lz4"},
])
def test_bad_read_commands_are_invalid(client, command):
    descriptor = flight.FlightDescriptor.for_command(json.dumps(command))
    with pytest.raises(pa.ArrowInvalid, match="compression"):
        client.get_flight_info(descriptor)
