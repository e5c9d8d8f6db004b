"""A dataset as shards on several servers: `gpu_flight.connect_all`, and the Dask reader and
writer given several servers, against three real servers on 127.0.0.1."""

import gpu_flight
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest

from test_flight import unique


def table(n=10_000):
    return pa.table({"i": pa.array(range(n), pa.int64()), "s": [f"v{i % 97}" for i in range(n)]})


def batches(t, size=1000):
    return pa.RecordBatchReader.from_batches(t.schema, t.to_batches(max_chunksize=size))


def by_i(t):
    return t.sort_by("i")


@pytest.fixture
def three(make_server):
    return [make_server() for _ in range(3)]


def test_writes_deal_batches_out_and_reads_are_the_union(three):
    uris = [server.location for server in three]
    source = table()
    name = unique("sharded")
    with gpu_flight.connect_all(uris) as cluster:
        results = cluster.put(name, batches(source))
        assert [r.rows for r in results] == [4000, 3000, 3000], "ten batches dealt in turn"
        assert cluster.list() == [name]
        assert by_i(cluster.get(name)).equals(source)
        projected = cluster.get(name, columns=["s"])
        assert projected.column_names == ["s"] and projected.num_rows == source.num_rows
        assert [info.total_records for info in cluster.infos(name)] == [4000, 3000, 3000]
    for server, rows in zip(three, [4000, 3000, 3000]):
        with gpu_flight.connect(server.location) as one:
            assert one.get(name).num_rows == rows, "each server holds its shard"
    with gpu_flight.connect_all(uris) as cluster:
        assert len(cluster.drop(name)) == 3
        with pytest.raises(pa.ArrowKeyError):
            cluster.drop(name)


def test_a_server_that_is_down_or_lacks_its_shard_is_named(three):
    uris = [server.location for server in three]
    name = unique("down")
    with gpu_flight.connect_all(uris) as cluster:
        cluster.put(name, batches(table()))
        with gpu_flight.connect(uris[1]) as second:
            second.drop(name)
        with pytest.raises(pa.ArrowKeyError, match=f"server {uris[1]}"):
            cluster.get(name)
    whole = unique("whole")
    with gpu_flight.connect_all(uris) as cluster:
        cluster.put(whole, batches(table()))
    assert three[2].stop() == 0
    with gpu_flight.connect_all(uris, timeout=5) as cluster, pytest.raises(pa.ArrowException, match=uris[2]):
        cluster.reader(whole)  # asks every shard before reading any row


def test_a_failed_write_changes_no_server(three):
    uris = [server.location for server in three]
    name = unique("atomic")

    def failing():
        yield from table().to_batches(max_chunksize=1000)[:5]
        raise RuntimeError("the source broke")

    with gpu_flight.connect_all(uris) as cluster:
        with pytest.raises(RuntimeError, match="source broke"):
            cluster.put(name, pa.RecordBatchReader.from_batches(table().schema, failing()))
        assert cluster.list() == []


def test_endpoints_are_read_from_the_server_their_locations_name():
    cluster = gpu_flight.Cluster(["grpc://a:1", "grpc://b:2"], [])
    ticket = flight.Ticket(b"x")
    elsewhere = flight.FlightEndpoint(ticket, [flight.Location("grpc://b:2")])
    here = flight.FlightEndpoint(ticket, [flight.Location("arrow-flight-reuse-connection://?")])
    unknown = flight.FlightEndpoint(ticket, [flight.Location("grpc://c:3")])
    assert cluster._server_of(elsewhere, 0) == 1
    assert cluster._server_of(here, 1) == 1
    assert cluster._server_of(unknown, 0) == 0
    assert cluster._server_of(flight.FlightEndpoint(ticket, []), 1) == 1


def test_dask_reads_and_writes_across_servers(three):
    dask = pytest.importorskip("dask")
    from gpu_flight.dask import read_dataset, write_dataset

    uris = [server.location for server in three]
    source = table()
    name = unique("dask")
    with gpu_flight.connect_all(uris) as cluster:
        cluster.put(name, batches(source, 2500))
    with dask.config.set(scheduler="threads"):
        ddf = read_dataset(uris, name)
        assert ddf.npartitions == 3, "one endpoint per shard"
        got = pa.Table.from_pandas(ddf.compute(), preserve_index=False).cast(source.schema)
        assert by_i(got).equals(source)
        copy = unique("dask-copy")
        write_dataset(ddf[ddf.i % 2 == 0], uris, copy)
    with gpu_flight.connect_all(uris) as cluster:
        written = cluster.get(copy).cast(source.schema)
        assert by_i(written).equals(source.filter(pc.equal(pc.bit_wise_and(source["i"], 1), 0)))
        assert [info.total_records > 0 for info in cluster.infos(copy)].count(True) >= 2
