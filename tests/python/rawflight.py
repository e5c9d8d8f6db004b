"""Requests pyarrow.flight cannot send: hand-made FlightData over grpcio, and raw HTTP/2.

pyarrow validates what it writes (no array longer than 2^31 - 1, offsets within their data), and
its gRPC connections always answer pings. The hardening tests and the soak script need clients
that do neither:

- `RawFlight.do_put` sends FlightData messages built here from IPC bytes (`ipc_parts`), which
  can be patched first (`patch_rows`, a body edit), and reports the gRPC status code exactly.
- `H2Connection` speaks just enough HTTP/2 by hand to send a partial preface, read the server's
  SETTINGS, and answer (or ignore) its PINGs.
"""

import socket
import struct
import time

import grpc

DO_PUT = "/arrow.flight.protocol.FlightService/DoPut"
DO_GET = "/arrow.flight.protocol.FlightService/DoGet"


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number, payload):
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def path_descriptor(name):
    """FlightDescriptor{type: PATH, path: [name]}, encoded."""
    return _varint(1 << 3) + _varint(1) + _field(3, name.encode())


def cmd_descriptor(cmd):
    """FlightDescriptor{type: CMD, cmd}, encoded."""
    return _varint(1 << 3) + _varint(2) + _field(2, cmd)


def flight_data(header, body=b"", descriptor=None):
    """FlightData{flight_descriptor, data_header, data_body}, encoded."""
    out = b"" if descriptor is None else _field(1, descriptor)
    out += _field(2, header)
    if body:
        out += _field(1000, body)
    return out


def ipc_parts(serialized):
    """Splits an encapsulated IPC message (`schema.serialize()`, `batch.serialize()`) into the
    flatbuffer header and the body, as FlightData carries them."""
    data = serialized.to_pybytes()
    if data[:4] != b"\xff\xff\xff\xff":
        raise ValueError("not an encapsulated IPC message")
    (length,) = struct.unpack("<i", data[4:8])
    return data[8 : 8 + length], data[8 + length :]


def patch_rows(header, old_rows, new_rows):
    """Replaces every int64 equal to `old_rows` in a record batch header: the batch length, and a
    null column's length and null count. Choose `old_rows` so that no other field equals it."""
    old = struct.pack("<q", old_rows)
    if old not in header:
        raise ValueError(f"{old_rows} does not occur in the header")
    return header.replace(old, struct.pack("<q", new_rows))


class RawFlight:
    """A grpcio channel to gpu-flight that sends FlightData it is given, byte for byte."""

    def __init__(self, location):
        self.channel = grpc.insecure_channel(
            location.removeprefix("grpc://"),
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        self._do_put = self.channel.stream_stream(DO_PUT, request_serializer=None, response_deserializer=None)

    def do_put(self, messages, timeout=60):
        """Sends encoded FlightData messages as one DoPut; returns (code, details), with the
        PutResult payloads as details when the put succeeded."""
        try:
            results = list(self._do_put(iter(messages), timeout=timeout))
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        return grpc.StatusCode.OK, results

    def do_get(self, ticket, timeout=60):
        """The encoded FlightData messages of a DoGet of `ticket` (bytes), as they arrived."""
        call = self.channel.unary_stream(DO_GET, request_serializer=None, response_deserializer=None)
        return list(call(_field(1, ticket), timeout=timeout))

    def put_batches(self, name, schema, batches, descriptor=None):
        """A DoPut of `schema` then `batches`, each (header, body) as `ipc_parts` returns them."""
        schema_header, _ = ipc_parts(schema.serialize())
        first = flight_data(schema_header, descriptor=descriptor or path_descriptor(name))
        return self.do_put([first, *(flight_data(header, body) for header, body in batches)])

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# HTTP/2 (RFC 9113) by hand.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, GOAWAY = 0x4, 0x6, 0x7
ACK = 0x1
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3


def h2_frame(kind, flags=0, stream=0, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", stream) + payload


class H2Connection:
    """A TCP connection to the server that speaks HTTP/2 frames by hand."""

    def __init__(self, location):
        host, port = location.removeprefix("grpc://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self._buffer = b""

    def send(self, data):
        self.sock.sendall(data)

    def start(self):
        """Sends the client preface and an empty SETTINGS frame."""
        self.send(PREFACE + h2_frame(SETTINGS))

    def _fill(self, n, deadline):
        while len(self._buffer) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise
            except OSError:  # reset by the server
                return False
            if not chunk:
                return False
            self._buffer += chunk
        return True

    def read_frame(self, timeout):
        """The next frame as (kind, flags, stream, payload); None once the server closed the
        connection; TimeoutError if nothing complete arrives within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if not self._fill(9, deadline):
            return None
        length = int.from_bytes(self._buffer[:3], "big")
        if not self._fill(9 + length, deadline):
            return None
        header, payload = self._buffer[:9], self._buffer[9 : 9 + length]
        self._buffer = self._buffer[9 + length :]
        return header[3], header[4], struct.unpack(">I", header[5:9])[0] & 0x7FFFFFFF, payload

    def frames_until_closed(self, timeout, answer_pings=True, on_frame=None):
        """Reads frames, acknowledging SETTINGS (and PINGs if `answer_pings`), until the server
        closes the connection (returns the seconds it took) or `timeout` passes (returns None)."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            try:
                frame = self.read_frame(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return None
            if frame is None:
                return time.monotonic() - start
            kind, flags, _, payload = frame
            if on_frame is not None:
                on_frame(frame)
            if kind == SETTINGS and not flags & ACK:
                self.send(h2_frame(SETTINGS, ACK))
            elif kind == PING and not flags & ACK and answer_pings:
                self.send(h2_frame(PING, ACK, 0, payload))

    def server_settings(self, timeout=10):
        """The parameters of the server's first SETTINGS frame, as a dict."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self.read_frame(max(0.0, deadline - time.monotonic()))
            if frame is None:
                raise ConnectionError("the server closed the connection before sending SETTINGS")
            kind, flags, _, payload = frame
            if kind == SETTINGS and not flags & ACK:
                self.send(h2_frame(SETTINGS, ACK))
                return dict(struct.unpack(">HI", payload[i : i + 6]) for i in range(0, len(payload), 6))

    def close(self):
        self.sock.close()


def wait_closed(sock, timeout):
    """Seconds until the peer closes `sock` (EOF or reset), reading and discarding whatever it
    sends; None if it is still open after `timeout`."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except TimeoutError:
            return None
        except OSError:
            return time.monotonic() - start
