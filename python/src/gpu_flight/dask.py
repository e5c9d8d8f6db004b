"""Dask DataFrames from and to gpu-flight datasets (extra `dask`: `pip install 'gpu-flight[dask]'`).

`read_dataset` makes one partition per endpoint of the dataset, reading nothing while the
graph is built; `write_dataset` writes every partition and changes the target dataset once,
atomically, after all of them succeeded.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import pyarrow as pa
import pyarrow.flight as flight

from ._client import connect
from ._cluster import commit_shards, connect_all, drop_temporaries
from ._errors import require

Backend = Literal["pandas", "cudf"]


@dataclass(frozen=True)
class _Partition:
    """One endpoint: what a task needs to read it, small and picklable."""

    uri: str
    name: str
    index: int
    endpoints: int
    ticket: bytes
    columns: Optional[tuple[str, ...]]
    connect_kwargs: tuple[tuple[str, Any], ...]


def _to_frame(table: pa.Table, backend: Backend) -> Any:
    if backend == "cudf":
        cudf = require("cudf", "cudf")
        return cudf.DataFrame.from_arrow(table)
    return table.to_pandas()


def _read_partition(
    part: _Partition, backend: Backend = "pandas", columns: Optional[Sequence[str]] = None
) -> Any:
    """Reads one endpoint. `columns` is Dask's projection: when it selects fewer columns than
    the ticket streams, a projected ticket for the same endpoint is asked for, so only those
    columns travel. A projection so wide that its FlightInfo lists fewer endpoints than the
    graph's (its tickets repeat the column list) is read through the graph's ticket instead,
    and selected here."""
    with connect(part.uri, **dict(part.connect_kwargs)) as client:
        options = client.call_options
        wanted = None if columns is None else tuple(columns)
        ticket = flight.Ticket(part.ticket)
        if wanted is not None and wanted != part.columns:
            info = client.info(part.name, columns=list(wanted))
            if len(info.endpoints) == part.endpoints:
                ticket = info.endpoints[part.index].ticket
                # The graph's ticket must still be current now: then the projected ticket,
                # issued before, is for the same version (versions only move forward). A stale
                # one fails with the server's NOT_FOUND, as an unprojected read would.
                check = client.flight_client.do_get(flight.Ticket(part.ticket), options=options)
                check.schema  # noqa: B018 (the first message carries the ticket's verdict)
                check.cancel()
        table = client.flight_client.do_get(ticket, options=options).read_all()
    if wanted is not None:
        table = table.select(list(wanted))
    return _to_frame(table, backend)


def read_dataset(
    uri: Union[str, Sequence[str]],
    name: str,
    columns: Optional[Sequence[str]] = None,
    backend: Backend = "pandas",
    **connect_kwargs: Any,
) -> Any:
    """A Dask DataFrame of dataset `name` on the server at `uri`, one partition per endpoint,
    in row order (the index restarts in each partition; divisions are unknown).

    `uri` may name several servers holding a shard each (a list, or a DNS name resolving to
    each, as `gpu_flight.connect_all` takes): the partitions are then the union of every
    shard's endpoints, in server order, each read from its server.

    `columns` selects columns on the server, and so does Dask's own projection
    (`ddf[["a", "b"]]`). `backend="cudf"` makes cudf partitions (needs cudf). The graph holds
    the tickets of the version current now: computing it after a replace or append fails with
    NOT_FOUND. `connect_kwargs` go to `gpu_flight.connect` in every task (token, TLS, ...), so
    they must be picklable.
    """
    dd = require("dask.dataframe", "dask")
    if backend not in ("pandas", "cudf"):
        raise ValueError(f"backend must be 'pandas' or 'cudf', not {backend!r}")
    if backend == "cudf":
        require("cudf", "cudf")
    projection = None if columns is None else tuple(columns)
    with connect_all(uri, **connect_kwargs) as cluster:
        infos = cluster.infos(name, columns=None if projection is None else list(projection))
        kwargs = tuple(sorted(connect_kwargs.items()))
        parts = []
        for issuer, info in enumerate(infos):
            endpoints = list(info.endpoints)
            for i, endpoint in enumerate(endpoints):
                server = cluster.uris[cluster._server_of(endpoint, issuer)]
                ticket = endpoint.ticket.ticket
                parts.append(_Partition(server, name, i, len(endpoints), ticket, projection, kwargs))
    meta = _to_frame(infos[0].schema.empty_table(), backend)
    return dd.from_map(
        _read_partition,
        parts,
        backend=backend,
        columns=None if projection is None else list(projection),
        meta=meta,
        label=f"gpu-flight-read-{name}",
        enforce_metadata=False,
    )


def _write_partition(
    frame: Any, name: str, schema: pa.Schema, uri: str, connect_kwargs: dict[str, Any]
) -> tuple[int, Optional[BaseException]]:
    """Puts one partition as a temporary dataset; returns its rows, or the error that stopped
    it. A task never raises, so every scheduler runs them all to their end before the
    temporary datasets are dropped (a local scheduler re-raises the first failure while the
    other tasks still run)."""
    try:
        if type(frame).__module__.startswith("cudf"):
            table = frame.to_arrow(preserve_index=False)
        else:
            table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
        table = table.cast(schema) if not table.schema.equals(schema) else table
        with connect(uri, **connect_kwargs) as client:
            return client.put(name, table, mode="create").rows, None
    except Exception as error:  # handed to the caller by write_dataset
        return 0, error


def write_dataset(
    ddf: Any,
    uri: Union[str, Sequence[str]],
    name: str,
    mode: Literal["create", "replace", "append"] = "create",
    **connect_kwargs: Any,
) -> int:
    """Writes the Dask DataFrame `ddf` (its columns, not its index) as dataset `name`; returns
    the rows written.

    Every partition is put, in parallel, as a temporary dataset `<name>.tmp-<uuid>-<i>`.
    Only when every task succeeded is the target changed, once and atomically: the temporary
    datasets are streamed, in partition order, from the server through this process into one
    put of `mode` on `name` ("create": ALREADY_EXISTS if `name` exists; "replace": swapped
    atomically; "append": added atomically), so readers see the target whole before or whole
    after. A failed task, or a failed commit, leaves `name` as it was, and the temporary
    datasets are dropped (unless this process dies first: they are then left under that
    prefix, for `drop`).

    With several servers (`uri` as `read_dataset` takes it), partition i goes to server
    i mod n, and each server commits its shard as above once every task succeeded: a server
    that refuses its commit leaves the shards committed before it (the error names them).
    """
    dask = require("dask", "dask")
    if mode not in ("create", "replace", "append"):
        raise ValueError(f"mode must be 'create', 'replace' or 'append', not {mode!r}")
    meta = ddf._meta
    if type(meta).__module__.startswith("cudf"):
        schema = meta.to_arrow(preserve_index=False).schema
    else:
        schema = pa.Schema.from_pandas(meta, preserve_index=False)
    prefix = f"{name}.tmp-{uuid.uuid4().hex}"
    with connect_all(uri, **connect_kwargs) as cluster:
        if mode == "create":
            for address, client in zip(cluster.uris, cluster.clients):
                if _exists(client, name):
                    # What the server would say at the commit, said before anything is written.
                    raise pa.ArrowException(
                        f"server {address}: dataset {name!r} already exists (mode='create')"
                    )
        parts = ddf.to_delayed()
        count = len(cluster.uris)
        temporaries = [(i % count, f"{prefix}-{i}") for i in range(len(parts))]
        try:
            tasks = [
                dask.delayed(_write_partition)(part, temporary, schema, cluster.uris[server], connect_kwargs)
                for part, (server, temporary) in zip(parts, temporaries)
            ]
            outcomes = _compute_all(dask, tasks)
            for _, error in outcomes:
                if error is not None:
                    raise error
            rows = sum(written for written, _ in outcomes)
            mine = [[t for owner, t in temporaries if owner == i] for i in range(count)]
            commit_shards(cluster, name, schema, mine, mode)
        finally:
            drop_temporaries(cluster, prefix)
    return int(rows)


def _compute_all(dask: Any, tasks: list[Any]) -> list[tuple[int, Optional[BaseException]]]:
    """Computes `tasks`, and on a distributed cluster waits for every one to end before raising
    a failure, so no put of a partition lands after the temporary datasets are dropped."""
    try:
        from distributed import default_client, wait
    except ImportError:
        return list(dask.compute(*tasks))
    try:
        client = default_client()  # type: ignore[no-untyped-call]
    except ValueError:  # no distributed client: the local schedulers
        return list(dask.compute(*tasks))
    futures = client.compute(tasks)
    wait(futures)  # type: ignore[no-untyped-call]
    return list(client.gather(futures))


def _exists(client: Any, name: str) -> bool:
    try:
        client.info(name)
    except pa.ArrowKeyError:
        return False
    return True
