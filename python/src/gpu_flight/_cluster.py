"""Datasets held as shards on several servers: one shard per server, under the same name.

One gpu-flight server serves one node; a dataset larger than a node, or read from every node,
is a shard on each (for example one server per GPU node, behind a Kubernetes headless Service).
`connect_all` reaches every server (given their URIs, or one DNS name that resolves to each)
and `Cluster` reads the union of the shards, each endpoint from the server its locations name,
and spreads writes over the servers. Nothing here coordinates the servers: each shard commits
on its own (see `Cluster.put`).
"""

from __future__ import annotations

import builtins
import contextlib
import socket
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.flight as flight

from ._client import (
    PUT_MESSAGE_BYTES,
    Client,
    Compression,
    Mode,
    PutData,
    _abandon,
    _as_reader,
    _slices,
    connect,
)
from ._documents import DropResult, PutResult

REUSE_CONNECTION = "arrow-flight-reuse-connection://?"


def servers(uris: Union[str, Sequence[str]]) -> list[str]:
    """The server URIs `uris` names: a list as given, or one URI whose host name resolves to
    several addresses (a headless Service), one URI per address, in a stable order."""
    if not isinstance(uris, str):
        listed = list(uris)
        if not listed:
            raise ValueError("name at least one server")
        return listed
    parsed = urllib.parse.urlsplit(uris)
    if parsed.scheme == "grpc+unix" or parsed.hostname is None or parsed.port is None:
        return [uris]
    try:
        found = socket.getaddrinfo(parsed.hostname, parsed.port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise flight.FlightUnavailableError(f"{uris}: cannot resolve {parsed.hostname}: {error}") from error
    addresses = sorted({str(info[4][0]) for info in found})
    if len(addresses) <= 1:
        return [uris]
    return [f"{parsed.scheme}://{f'[{a}]' if ':' in a else a}:{parsed.port}" for a in addresses]


def _named(uri: str, error: pa.ArrowException) -> pa.ArrowException:
    """`error` with the server it came from in its message, as the same exception class."""
    try:
        return type(error)(f"server {uri}: {error}")
    except TypeError:
        return pa.ArrowException(f"server {uri}: {error}")


def connect_all(uris: Union[str, Sequence[str]], **connect_kwargs: Any) -> Cluster:
    """Connects to every server `uris` names (see `servers`), each as `gpu_flight.connect`
    would with `connect_kwargs`. With TLS and a DNS name that resolves to several addresses,
    each connection verifies the certificate against that name."""
    addresses = servers(uris)
    if isinstance(uris, str) and len(addresses) > 1:
        host = urllib.parse.urlsplit(uris).hostname
        if host is not None and urllib.parse.urlsplit(uris).scheme == "grpc+tls":
            connect_kwargs.setdefault("override_hostname", host)
    clients: list[Client] = []
    try:
        for uri in addresses:
            clients.append(connect(uri, **connect_kwargs))
    except BaseException:
        for client in clients:
            client.close()
        raise
    return Cluster(addresses, clients)


class Cluster:
    """Several gpu-flight servers holding one dataset as a shard each; make one with
    `gpu_flight.connect_all`. A context manager: leaving the block closes every connection."""

    def __init__(self, uris: Sequence[str], clients: Sequence[Client]) -> None:
        self.uris = list(uris)
        self.clients = list(clients)

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _each(self, call: Any) -> builtins.list[Any]:
        results = []
        for uri, client in zip(self.uris, self.clients):
            try:
                results.append(call(client))
            except pa.ArrowException as error:
                raise _named(uri, error) from error
        return results

    def infos(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        compression: Optional[Compression] = None,
        where: Optional[str] = None,
    ) -> builtins.list[flight.FlightInfo]:
        """Every server's FlightInfo of its shard (its rows `where` selects, if given), in
        server order. A server that is down, or that has no shard, raises its error with its
        URI in the message."""
        infos: builtins.list[flight.FlightInfo] = self._each(
            lambda c: c.info(name, columns, compression, where)
        )
        return infos

    def schema(self, name: str, columns: Optional[Sequence[str]] = None) -> pa.Schema:
        """The shards' schema (the first server's; `reader` checks that they agree)."""
        try:
            schema: pa.Schema = self.clients[0].schema(name, columns)
        except pa.ArrowException as error:
            raise _named(self.uris[0], error) from error
        return schema

    def _server_of(self, endpoint: flight.FlightEndpoint, issuer: int) -> int:
        """The server that serves `endpoint`: the first of its locations that is one of the
        cluster's, else the one that issued it (no location, or the connection it came on)."""
        for location in endpoint.locations:
            uri = location.uri.decode() if isinstance(location.uri, bytes) else str(location.uri)
            if uri == REUSE_CONNECTION:
                break
            if uri in self.uris:
                return self.uris.index(uri)
        return issuer

    def reader(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        compression: Optional[Compression] = None,
        where: Optional[str] = None,
    ) -> pa.RecordBatchReader:
        """A RecordBatchReader over the union of the shards: every server's endpoints in
        server order, each read from the server its locations name, only when the reader
        reaches it. Every shard's FlightInfo is asked for first, so a server that is down or a
        missing shard fails here, before any row is read."""
        infos = self.infos(name, columns, compression, where)
        schema = infos[0].schema
        for uri, info in zip(self.uris, infos):
            if not info.schema.equals(schema):
                raise pa.ArrowInvalid(
                    f"server {uri}: the shard of {name!r} has schema {info.schema}, not {schema}"
                )
        plan = [
            (self._server_of(endpoint, issuer), endpoint)
            for issuer, info in enumerate(infos)
            for endpoint in info.endpoints
        ]

        def batches() -> Iterator[pa.RecordBatch]:
            for server, endpoint in plan:
                client = self.clients[server]
                try:
                    yield from client._read_ticket(endpoint.ticket)
                except pa.ArrowException as error:
                    raise _named(self.uris[server], error) from error

        return pa.RecordBatchReader.from_batches(schema, batches())

    def get(
        self,
        name: str,
        columns: Optional[Sequence[str]] = None,
        compression: Optional[Compression] = None,
        where: Optional[str] = None,
    ) -> pa.Table:
        """The union of the shards (or their `columns`, or the rows `where` selects) as one
        Table, in server order."""
        return self.reader(name, columns, compression, where).read_all()

    def put(self, name: str, data: PutData, mode: Mode = "create") -> builtins.list[PutResult]:
        """Puts `data` as a shard on every server, its batches dealt out in turn (a server may
        get an empty shard); returns each server's PutResult.

        Every shard's stream is open until all the data was sent; if anything fails before
        that, every shard is abandoned and no server changes. Then each server commits its
        shard in turn, atomically on its own: if one refuses at that point (a full server, a
        `create` of a name it already holds), the servers before it have committed theirs,
        and the error names the servers that did.
        """
        reader = _as_reader(data)
        writers = []
        try:
            for uri, client in zip(self.uris, self.clients):
                try:
                    writers.append(client._open_put(name, reader.schema, mode))
                except pa.ArrowException as error:
                    raise _named(uri, error) from error
            turn = 0
            for batch in reader:
                for piece in _slices(batch, PUT_MESSAGE_BYTES):
                    writer = writers[turn % len(writers)][0]
                    writer.write_batch(piece)
                    turn += 1
        except BaseException as error:
            for writer, _ in writers:
                _abandon(writer, error)
            raise
        results: builtins.list[PutResult] = []
        for index, (uri, (writer, results_stream)) in enumerate(zip(self.uris, writers)):
            try:
                results.append(self.clients[index]._finish_put(writer, results_stream))
            except pa.ArrowException as error:
                committed = ", ".join(self.uris[:index]) or "none"
                for later, _ in writers[index + 1 :]:
                    _abandon(later, error)
                raise _named(
                    uri, pa.ArrowException(f"{error} (servers that committed: {committed})")
                ) from error
        return results

    def list(self, prefix: str = "") -> builtins.list[str]:
        """The names any server holds a shard of, sorted."""
        names: set[str] = set()
        for found in self._each(lambda c: c.list(prefix)):
            names.update(found)
        return sorted(names)

    def drop(self, name: str) -> builtins.list[DropResult]:
        """Drops every server's shard of `name` (servers without one are skipped; NOT_FOUND
        if none had one)."""
        dropped = []
        for uri, client in zip(self.uris, self.clients):
            try:
                dropped.append(client.drop(name))
            except pa.ArrowKeyError:
                continue
            except pa.ArrowException as error:
                raise _named(uri, error) from error
        if not dropped:
            raise pa.ArrowKeyError(f"no server holds a dataset {name!r}")
        return dropped


def commit_shards(
    cluster: Cluster,
    name: str,
    schema: pa.Schema,
    temporaries: Sequence[Sequence[str]],
    mode: Mode,
) -> None:
    """Commits on each server, in turn, its temporary datasets (`temporaries[i]` on server i,
    in order) as its shard of `name`, with one atomic put of `mode` streamed from them. A
    server that refuses leaves the shards of those before it committed; the error names them."""
    committed: builtins.list[str] = []
    for uri, client, mine in zip(cluster.uris, cluster.clients, temporaries):

        def batches(client: Client = client, mine: Sequence[str] = mine) -> Iterator[pa.RecordBatch]:
            for temporary in mine:
                yield from client.reader(temporary)

        try:
            client.put(name, pa.RecordBatchReader.from_batches(schema, batches()), mode=mode)
        except pa.ArrowException as error:
            done = ", ".join(committed) or "none"
            raise _named(uri, pa.ArrowException(f"{error} (servers that committed: {done})")) from error
        committed.append(uri)


def drop_temporaries(cluster: Cluster, prefix: str) -> None:
    """Drops every dataset whose name starts with `prefix` on every server."""
    for client in cluster.clients:
        for temporary in client.list(prefix):
            with contextlib.suppress(pa.ArrowKeyError):
                client.drop(temporary)
