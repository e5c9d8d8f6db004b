"""The client: gpu-flight's puts, reads and actions over one `pyarrow.flight.FlightClient`."""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, Optional, Union

import pyarrow as pa
import pyarrow.flight as flight

from ._documents import CopyResult, Device, DropResult, MoveResult, PutResult, parse
from ._export import DEFAULT_LEASE_SECONDS, Export, open_export
from ._import import put_device
from ._shared import read_shared

Mode = Literal["create", "replace", "append"]
Compression = Literal["lz4", "zstd"]
PutData = Union[pa.Table, pa.RecordBatch, pa.RecordBatchReader, Iterable[pa.RecordBatch]]

PUT_MESSAGE_BYTES = 64 * 1024 * 1024
"""Batches larger than this are sent in slices, so every message stays far below the server's
`--max-put-message-bytes` (1 GiB by default) and gRPC's buffers stay small."""


def connect(
    uri: str,
    *,
    token: Optional[str] = None,
    username: Optional[str] = None,
    password: Optional[str] = None,
    tls_root_certs: Optional[bytes] = None,
    cert_chain: Optional[bytes] = None,
    private_key: Optional[bytes] = None,
    override_hostname: Optional[str] = None,
    timeout: Optional[float] = None,
) -> Client:
    """Connects to the gpu-flight server at `uri` (`grpc://host:port`, `grpc+tls://...`,
    `grpc+unix:///path`).

    `token` is a bearer token sent with every call; `username` and `password` log in with Basic
    credentials (the server's Handshake) and use the session token it returns. `tls_root_certs`
    (PEM) verifies the server; `cert_chain` and `private_key` (PEM) are the client's certificate
    for mutual TLS. `timeout` (seconds) applies to every call.
    """
    if token is not None and (username is not None or password is not None):
        raise ValueError("pass either token or username and password, not both")
    if (username is None) != (password is None):
        raise ValueError("username and password go together")
    kwargs: dict[str, Any] = {}
    if tls_root_certs is not None:
        kwargs["tls_root_certs"] = tls_root_certs
    if cert_chain is not None:
        kwargs["cert_chain"] = cert_chain
    if private_key is not None:
        kwargs["private_key"] = private_key
    if override_hostname is not None:
        kwargs["override_hostname"] = override_hostname
    raw = flight.connect(uri, **kwargs)
    try:
        headers: list[tuple[bytes, bytes]] = []
        if token is not None:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        elif username is not None and password is not None:
            login = flight.FlightCallOptions(timeout=timeout)
            headers.append(raw.authenticate_basic_token(username, password, options=login))
    except BaseException:
        raw.close()
        raise
    return Client(
        raw, headers=headers, timeout=timeout, reconnect=functools.partial(flight.connect, uri, **kwargs)
    )


def _command(**fields: Any) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_command(
        json.dumps({key: value for key, value in fields.items() if value is not None})
    )


def _read_descriptor(
    name: str,
    columns: Optional[Sequence[str]],
    compression: Optional[str],
    where: Optional[str] = None,
) -> flight.FlightDescriptor:
    """PATH for a plain read, else the CMD document `{"name", "columns", "compression",
    "where"}`."""
    if columns is None and compression is None and where is None:
        return flight.FlightDescriptor.for_path(name)
    if isinstance(columns, str):
        raise TypeError("columns must be a sequence of column names, not a string")
    return _command(
        name=name,
        columns=None if columns is None else list(columns),
        compression=compression,
        where=where,
    )


def _as_reader(data: PutData) -> pa.RecordBatchReader:
    if isinstance(data, pa.RecordBatchReader):
        return data
    if isinstance(data, pa.Table):
        return pa.RecordBatchReader.from_batches(data.schema, data.to_batches())
    if isinstance(data, pa.RecordBatch):
        return pa.RecordBatchReader.from_batches(data.schema, [data])
    if hasattr(data, "__arrow_c_stream__"):
        return pa.RecordBatchReader.from_stream(data)
    batches = iter(data)
    try:
        first = next(batches)
    except StopIteration:
        raise ValueError("an empty iterable of record batches has no schema: pass a Table") from None
    if not isinstance(first, pa.RecordBatch):
        raise TypeError(f"expected record batches, got {type(first).__name__}")

    def chained() -> Iterator[pa.RecordBatch]:
        yield first
        yield from batches

    return pa.RecordBatchReader.from_batches(first.schema, chained())


def _slices(batch: pa.RecordBatch, limit: int) -> Iterator[pa.RecordBatch]:
    size = batch.nbytes
    if size <= limit or batch.num_rows <= 1:
        yield batch
        return
    rows = max(1, batch.num_rows * limit // size)
    for start in range(0, batch.num_rows, rows):
        yield batch.slice(start, rows)


ABORT_REASON_CHARS = 1000
ABANDONED = "the client abandoned the put"
"""How the server's ABORTED answer to the abort marker begins."""
"""The most characters of the caller's error sent as the reason of an abandoned put."""


def _abandon(writer: flight.FlightStreamWriter, error: BaseException) -> Optional[pa.ArrowException]:
    """Tells the server to discard the put (the abort marker: app_metadata alone, JSON
    `{"abort": reason}`), then closes the stream. Returns the error closing raised unless it is
    the server's answer to the marker: a refusal the server had sent before, which says more
    than `error` about a stream that failed."""
    reason = f"{type(error).__name__}: {error}"[:ABORT_REASON_CHARS]
    with contextlib.suppress(pa.ArrowException):
        writer.write_metadata(pa.py_buffer(json.dumps({"abort": reason}).encode()))
    try:
        writer.close()
    except pa.ArrowException as closing:
        if ABANDONED not in str(closing):
            return closing
    return None


class Client:
    """A connection to one gpu-flight server; make one with `gpu_flight.connect`.

    A context manager: leaving the block closes the connection. Methods raise the server's
    errors as pyarrow's exceptions (see the package's docstring). Not safe to share between
    threads while a put or a reader is in progress; make one client per thread.
    """

    def __init__(
        self,
        flight_client: flight.FlightClient,
        *,
        headers: Sequence[tuple[bytes, bytes]] = (),
        timeout: Optional[float] = None,
        reconnect: Optional[Callable[[], flight.FlightClient]] = None,
    ) -> None:
        self._flight = flight_client
        self._headers = list(headers)
        self._timeout = timeout
        self._reconnect = reconnect  # a new connection like this one, for a release after close()
        self._closed = False

    @property
    def flight_client(self) -> flight.FlightClient:
        """The underlying `pyarrow.flight.FlightClient`, for calls this class does not wrap."""
        return self._flight

    @property
    def call_options(self) -> flight.FlightCallOptions:
        """Call options carrying this client's credentials and timeout, for `flight_client`."""
        return self._options()

    def _options(
        self, compression: Optional[str] = None, timeout: Optional[float] = None
    ) -> flight.FlightCallOptions:
        write_options = None if compression is None else pa.ipc.IpcWriteOptions(compression=compression)
        if self._timeout is not None:
            timeout = self._timeout if timeout is None else min(timeout, self._timeout)
        return flight.FlightCallOptions(timeout=timeout, headers=self._headers, write_options=write_options)

    def close(self) -> None:
        """Closes the connection; calls in progress fail. Exports made through it still
        release their leases when they end (on a connection of their own)."""
        self._closed = True
        self._flight.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Puts

    def put(
        self,
        name: str,
        data: PutData,
        mode: Mode = "create",
        device: Optional[Device] = None,
        compression: Optional[Compression] = None,
    ) -> PutResult:
        """Puts `data` (a Table, a RecordBatch, a RecordBatchReader, an object with
        `__arrow_c_stream__`, or an iterable of RecordBatches) as dataset `name`.

        `mode`: "create" (ALREADY_EXISTS if the name is taken), "replace" (swaps the dataset
        atomically, or creates it) or "append" (adds rows with identical fields, or creates it).
        `device` asks for a device (its number or GPU UUID); `compression` ("lz4" or "zstd")
        compresses the bodies sent. Readers and iterables are streamed batch by batch, never
        held whole. The put commits when the stream ends, atomically.

        If anything fails before the stream is ended (reading `data` raises, a batch does not
        match the schema, an interrupt), the put is abandoned: the server is told to discard it
        (docs/protocol.md, the abort marker), so nothing is committed and the dataset is left as
        it was. That exception is raised here, or the server's own refusal if it had refused
        the put first.
        """
        reader = _as_reader(data)
        writer, results = self._open_put(name, reader.schema, mode, device, compression)
        pieces = (piece for batch in reader for piece in _slices(batch, PUT_MESSAGE_BYTES))
        # Until the stream is ended on purpose, any failure (the caller's data, a batch that
        # cannot be sent, an interrupt) abandons the put: closing would end it cleanly, and the
        # server would commit what it had.
        try:
            for piece in pieces:
                writer.write_batch(piece)
        except BaseException as error:
            refusal = _abandon(writer, error)
            if refusal is not None and isinstance(error, pa.ArrowException):
                raise refusal from error
            raise
        return self._finish_put(writer, results)

    def _open_put(
        self,
        name: str,
        schema: pa.Schema,
        mode: Mode,
        device: Optional[Device] = None,
        compression: Optional[Compression] = None,
    ) -> tuple[flight.FlightStreamWriter, flight.FlightMetadataReader]:
        """Starts a put's stream: the writer, and the reader of the server's answer."""
        descriptor = _command(name=name, mode=mode, device=device)
        writer, results = self._flight.do_put(descriptor, schema, options=self._options(compression))
        return writer, results

    def _finish_put(
        self, writer: flight.FlightStreamWriter, results: flight.FlightMetadataReader
    ) -> PutResult:
        """Ends a put's stream, which commits it, and returns the server's answer."""
        try:
            writer.done_writing()
            # None when the server refused the put: close() then raises its error.
            answer = results.read()
        finally:
            writer.close()
        if answer is None:
            raise flight.FlightInternalError("the server committed no put and returned no error")
        return PutResult.from_json(answer.to_pybytes())

    # Reads

    def info(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        compression: Optional[Compression] = None,
        where: Optional[str] = None,
    ) -> flight.FlightInfo:
        """The dataset's FlightInfo: schema (of `columns`, if given), `total_records`,
        `total_bytes` and its endpoints in row order, whose tickets stream `columns` with
        bodies compressed by `compression` ("lz4" or "zstd"), and only the rows `where` (an
        SQL predicate, as a WHERE clause takes it: `"fare > 10 AND city IN ('Oslo')"`)
        selects, filtered on the server (`total_records` is then -1)."""
        descriptor = _read_descriptor(name, columns, compression, where)
        return self._flight.get_flight_info(descriptor, options=self._options())

    def schema(self, name: str, columns: Optional[Sequence[str]] = None) -> pa.Schema:
        """The dataset's schema, or its projection onto `columns`."""
        descriptor = _read_descriptor(name, columns, None)
        return self._flight.get_schema(descriptor, options=self._options()).schema

    def reader(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        compression: Optional[Compression] = None,
        where: Optional[str] = None,
    ) -> pa.RecordBatchReader:
        """A RecordBatchReader over every endpoint of the dataset, in row order. Each endpoint
        is requested only when the reader reaches it; the data is the version current when
        this is called (a later replace or append makes it fail with NOT_FOUND). `where`
        filters rows on the server (see `info`)."""
        return self.read_info(self.info(name, columns, compression, where))

    def read_info(self, info: flight.FlightInfo) -> pa.RecordBatchReader:
        """A RecordBatchReader over `info`'s endpoints, in order, read lazily."""
        return pa.RecordBatchReader.from_batches(info.schema, self._batches(info.endpoints))

    def _batches(self, endpoints: Sequence[flight.FlightEndpoint]) -> Iterator[pa.RecordBatch]:
        for endpoint in endpoints:
            yield from self._read_ticket(endpoint.ticket)

    def _read_ticket(self, ticket: flight.Ticket) -> Iterator[pa.RecordBatch]:
        """The record batches one ticket streams (DoGet), read as they arrive."""
        for chunk in self._flight.do_get(ticket, options=self._options()):
            yield chunk.data

    def get(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        compression: Optional[Compression] = None,
        where: Optional[str] = None,
    ) -> pa.Table:
        """The whole dataset (or its `columns`, or the rows `where` selects) as a Table."""
        return self.reader(name, columns, compression, where).read_all()

    def list(self, prefix: str = "") -> list[str]:
        """The names of the datasets starting with `prefix` (all of them by default)."""
        infos = self._flight.list_flights(criteria=prefix.encode(), options=self._options())
        return [info.descriptor.path[0].decode() for info in infos]

    def infos(self, prefix: str = "") -> builtins.list[flight.FlightInfo]:
        """The FlightInfo of every dataset whose name starts with `prefix`."""
        return list(self._flight.list_flights(criteria=prefix.encode(), options=self._options()))

    # Actions

    def _action(
        self,
        action: str,
        body: Optional[dict[str, Any]] = None,
        timeout: Optional[float] = None,
        reconnect: bool = False,
    ) -> bytes:
        """Runs `action`; `timeout` caps the client's own; with `reconnect`, on a fresh
        connection once this client is closed."""
        payload = b"" if body is None else json.dumps(body).encode()
        call = flight.Action(action, payload)
        options = self._options(timeout=timeout)
        if reconnect and self._closed and self._reconnect is not None:
            with self._reconnect() as fresh:
                results = list(fresh.do_action(call, options=options))
        else:
            results = list(self._flight.do_action(call, options=options))
        if len(results) != 1:
            raise flight.FlightInternalError(f"the {action} action returned {len(results)} results, not 1")
        body_bytes: bytes = results[0].body.to_pybytes()
        return body_bytes

    def drop(self, name: str) -> DropResult:
        """Drops the dataset (NOT_FOUND if absent); streams already reading it finish."""
        return DropResult.from_json(self._action("drop", {"name": name}))

    def status(self) -> dict[str, Any]:
        """The server's `status` document: version, backend, devices, datasets, memory,
        leases, puts and counters (docs/protocol.md has every field)."""
        return parse(self._action("status"), "status")

    def move(self, name: str, device: Device) -> MoveResult:
        """Moves the whole dataset onto `device`, as a new version."""
        return MoveResult.from_json(self._action("move", {"name": name, "device": device}))

    def copy(self, name: str, as_name: str, device: Optional[Device] = None) -> CopyResult:
        """Copies the dataset to the new name `as_name` (ALREADY_EXISTS if taken), on `device`
        (which may be left out on a server with one device)."""
        body: dict[str, Any] = {"name": name, "as": as_name}
        if device is not None:
            body["device"] = device
        return CopyResult.from_json(self._action("copy", body))

    # Zero-copy on the same node

    def put_device(self, name: str, obj: Any, mode: Mode = "create") -> PutResult:
        """Hands `obj`, held on a GPU of the server's node, to the server without the network:
        the server copies it device to device into dataset `name` and commits it as `put`
        would (`mode` as there). The memory may be freed once this returns.

        `obj` is anything with `__arrow_c_device_array__` (a record batch on a CUDA device) or
        `__arrow_c_device_stream__` (each batch in turn, the rest appended: not atomic), a
        cuDF DataFrame, or a dict of column name to one-dimensional CuPy array or PyTorch
        tensor. Needs `cuda-bindings` (extra `cuda`), the server on the GPU the data is on,
        and memory from `cudaMalloc` (not a `cudaMallocAsync` pool, which cannot be shared:
        `NotShareable`). A server on the host backend refuses with FAILED_PRECONDITION.
        """
        return put_device(self, name, obj, mode)

    def export(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        device: Optional[Union[int, str]] = None,
        copy: bool = False,
        lease_seconds: int = DEFAULT_LEASE_SECONDS,
    ) -> Export:
        """Maps the dataset's GPU memory (or its `columns`) into this process, without copying
        it: for a process on the server's node, with the server's GPUs visible. Needs the
        `cuda-bindings` package (extra `cuda`); a server on the host backend refuses with
        FAILED_PRECONDITION.

        `device` is the GPU this process computes on: its CUDA ordinal here (as CuPy and
        PyTorch number devices) or its UUID. Partitions on other GPUs are then mapped on it
        for peer access (read over NVLink or PCIe), or with `copy=True` copied onto it by the
        server for the lease (role `write`). Without `device`, each partition is mapped on
        the GPU holding it. `lease_seconds` bounds how long the memory stays valid.

        Returns an `Export`; use it as a context manager. Raises `DeviceNotVisible` (after
        releasing the lease) if the dataset is on a GPU this process cannot see.
        """
        return open_export(self, name, columns, device, copy, lease_seconds)

    def read_shared(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        where: Optional[str] = None,
        lease_seconds: int = DEFAULT_LEASE_SECONDS,
    ) -> pa.Table:
        """The dataset (or its `columns`, or the rows `where` selects, as `get` takes them) as a
        Table mapped from the server's shared memory, without a copy and without the network:
        for a process on the server's node, on a server started with `--shm-socket`. Needs no
        GPU library.

        The server writes the rows into sealed memory files once; this process maps them and
        the table's buffers point into the mappings, which stay mapped as long as anything
        taken from the table is alive. The package renews the server's lease on the files
        (`lease_seconds` at a time) until then, and releases it after. The server empties the
        files when the lease ends, so a table read after that faults (SIGBUS): a forked
        child's inherited copy once the parent let go of it, or any copy after renewals failed
        for longer than half the lease.
        """
        return read_shared(self, name, columns, where, lease_seconds)
