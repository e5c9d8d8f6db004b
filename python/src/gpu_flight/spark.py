"""A Spark (4.1 or later) data source for gpu-flight datasets (extra `spark`).

    import gpu_flight.spark
    gpu_flight.spark.register(spark)
    df = spark.read.format("gpu_flight").option("uri", "grpc://node-1:8815").load("trips")
    df.filter("fare > 10").select("fare").show()          # the filter runs on the server
    df.write.format("gpu_flight").option("uri", ...).mode("append").save("trips-copy")

Reads make one Spark partition per endpoint, with the schema from GetSchema, and take the
filters Spark pushes (comparisons with literals, IN, IS [NOT] NULL, and NOT of those) to the
server as the read's `where`: only matching rows travel; Spark evaluates the rest (LIKE, ORs).
A schema given with `.schema(...)` naming fewer columns reads only those. Writes put each Spark
partition as a temporary dataset and, once every task succeeded, commit them in partition order
with one atomic put (`append`, or `replace` for `mode("overwrite")`); a failed task or job
drops the temporaries and leaves the dataset as it was. `uri` may name several servers,
comma-separated (`gpu_flight.connect_all`): reads cover every shard, and partition i is written
to server i mod n, each server committing its own shard. Options `token`, `username` and
`password` authenticate as `gpu_flight.connect` does.
"""

from __future__ import annotations

import datetime
import decimal
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa
import pyarrow.flight as flight

from ._client import Mode, connect
from ._cluster import commit_shards, connect_all, drop_temporaries
from ._errors import require

require("pyspark", "spark")
from pyspark.sql.datasource import (  # noqa: E402
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)

NAME = "gpu_flight"


def register(spark: Any) -> None:
    """Registers the `gpu_flight` format with the Spark session `spark`, and turns on Spark's
    filter pushdown to Python data sources (`spark.sql.python.filterPushdown.enabled`), which
    Spark requires of a source that takes filters."""
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(GpuFlightDataSource)


def _uris(options: Any) -> list[str]:
    uri = options.get("uri")
    if not uri:
        raise ValueError('option "uri" names the server(s): grpc://host:8815, comma-separated for several')
    return [part.strip() for part in str(uri).split(",") if part.strip()]


def _connect_kwargs(options: Any) -> dict[str, Any]:
    return {key: options[key] for key in ("token", "username", "password") if options.get(key)}


def _dataset(options: Any) -> str:
    name = options.get("path") or options.get("name")
    if not name:
        raise ValueError("name the dataset: .load(name) or .save(name)")
    return str(name)


class GpuFlightDataSource(DataSource):
    """`spark.read.format("gpu_flight")` and `df.write.format("gpu_flight")`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> Any:
        from pyspark.sql.pandas.types import from_arrow_schema

        with connect_all(_uris(self.options), **_connect_kwargs(self.options)) as cluster:
            return from_arrow_schema(cluster.schema(_dataset(self.options)))

    def reader(self, schema: Any) -> DataSourceReader:
        return _Reader(_uris(self.options), _dataset(self.options), schema, _connect_kwargs(self.options))

    def writer(self, schema: Any, overwrite: bool) -> DataSourceArrowWriter:
        return _Writer(
            _uris(self.options),
            _dataset(self.options),
            schema,
            overwrite,
            _connect_kwargs(self.options),
        )


# Reads.


def _identifier(path: Sequence[str]) -> Optional[str]:
    if len(path) != 1:
        return None  # a nested field: not a column of ours
    return '"' + path[0].replace('"', '""') + '"'


def _literal(value: Any) -> Optional[str]:
    """`value` as an SQL literal the server's predicates take, or None."""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, decimal.Decimal)):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else None
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, datetime.datetime):
        return f"TIMESTAMP '{value.isoformat(sep=' ')}'"
    if isinstance(value, datetime.date):
        return f"DATE '{value.isoformat()}'"
    return None


def _predicate(pushed: Any) -> Optional[str]:
    """A Spark filter as SQL, or None where the server does not run it."""
    from pyspark.sql import datasource as ds

    comparisons = {
        ds.EqualTo: "=",
        ds.GreaterThan: ">",
        ds.GreaterThanOrEqual: ">=",
        ds.LessThan: "<",
        ds.LessThanOrEqual: "<=",
    }
    for kind, operator in comparisons.items():
        if type(pushed) is kind:
            attribute: Sequence[str] = getattr(pushed, "attribute", ())
            column, value = _identifier(attribute), _literal(getattr(pushed, "value", None))
            return None if column is None or value is None else f"{column} {operator} {value}"
    if isinstance(pushed, ds.In):
        column = _identifier(pushed.attribute)
        values = [_literal(value) for value in pushed.value]
        if column is None or not values or any(value is None for value in values):
            return None
        return f"{column} IN ({', '.join(str(value) for value in values)})"
    if isinstance(pushed, (ds.IsNull, ds.IsNotNull)):
        column = _identifier(pushed.attribute)
        negated = " NOT" if isinstance(pushed, ds.IsNotNull) else ""
        return None if column is None else f"{column} IS{negated} NULL"
    if isinstance(pushed, ds.Not):
        inner = _predicate(pushed.child)
        return None if inner is None else f"NOT ({inner})"
    return None


@dataclass(frozen=True)
class _Endpoint(InputPartition):
    server: str
    ticket: bytes


class _Reader(DataSourceReader):
    def __init__(self, uris: list[str], name: str, schema: Any, kwargs: dict[str, Any]) -> None:
        self.uris, self.name, self.kwargs = uris, name, kwargs
        self.columns = [field.name for field in schema.fields]
        self.where: list[str] = []

    def pushFilters(self, filters: list[Any]) -> Iterable[Any]:
        for pushed in filters:
            sql = _predicate(pushed)
            if sql is None:
                yield pushed  # Spark evaluates it
            else:
                self.where.append(sql)

    def partitions(self) -> Sequence[InputPartition]:
        where = " AND ".join(f"({sql})" for sql in self.where) or None
        with connect_all(self.uris, **self.kwargs) as cluster:
            infos = cluster.infos(self.name, columns=self.columns, where=where)
            return [
                _Endpoint(cluster.uris[cluster._server_of(endpoint, issuer)], endpoint.ticket.ticket)
                for issuer, info in enumerate(infos)
                for endpoint in info.endpoints
            ]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, _Endpoint):
            raise TypeError(f"not a gpu_flight partition: {partition!r}")
        with connect(partition.server, **self.kwargs) as client:
            yield from client._read_ticket(flight.Ticket(partition.ticket))


# Writes.


@dataclass(frozen=True)
class _Written(WriterCommitMessage):
    server: int
    partition: int
    temporary: Optional[str]
    rows: int


class _Writer(DataSourceArrowWriter):
    def __init__(
        self, uris: list[str], name: str, schema: Any, overwrite: bool, kwargs: dict[str, Any]
    ) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.uris, self.name, self.overwrite, self.kwargs = uris, name, overwrite, kwargs
        self.schema = to_arrow_schema(schema)
        self.prefix = f"{name}.tmp-{uuid.uuid4().hex}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> _Written:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = context.attemptNumber() if context is not None else 0
        server = partition % len(self.uris)
        temporary = f"{self.prefix}-{partition}-{attempt}"
        batches = (batch.cast(self.schema) if batch.schema != self.schema else batch for batch in iterator)
        reader = pa.RecordBatchReader.from_batches(self.schema, batches)
        with connect(self.uris[server], **self.kwargs) as client:
            rows = client.put(temporary, reader, mode="create").rows
        return _Written(server, partition, temporary, rows)

    def commit(self, messages: list[Optional[WriterCommitMessage]]) -> None:
        written = sorted((m for m in messages if isinstance(m, _Written)), key=lambda m: m.partition)
        mode: Mode = "replace" if self.overwrite else "append"
        with connect_all(self.uris, **self.kwargs) as cluster:
            try:
                mine = [
                    [m.temporary for m in written if m.server == i and m.temporary is not None]
                    for i in range(len(cluster.uris))
                ]
                commit_shards(cluster, self.name, self.schema, mine, mode)
            finally:
                drop_temporaries(cluster, self.prefix)

    def abort(self, messages: list[Optional[WriterCommitMessage]]) -> None:
        self._drop_temporaries()

    def _drop_temporaries(self) -> None:
        with connect_all(self.uris, **self.kwargs) as cluster:
            drop_temporaries(cluster, self.prefix)
