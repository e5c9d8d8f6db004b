"""gpu_flight.dask on a two-process distributed cluster against the real binary."""

import time
import uuid

import gpu_flight
import pandas as pd
import pyarrow as pa
import pytest

dask = pytest.importorskip("dask")
dd = pytest.importorskip("dask.dataframe")
distributed = pytest.importorskip("distributed")
from gpu_flight.dask import read_dataset, write_dataset  # noqa: E402


def unique(prefix="d"):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def cluster():
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as c,
        distributed.Client(c) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def dask_server(make_module_server):
    return make_module_server


@pytest.fixture(scope="module")
def make_module_server():
    from conftest import Server

    server = Server("--rows-per-endpoint", "250")
    yield server
    server.stop()


def source(n=1000):
    return pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "f": pa.array([i / 3 if i % 7 else None for i in range(n)], pa.float64()),
            "s": [f"s{i}" for i in range(n)],
            "b": [i % 2 == 0 for i in range(n)],
            "t": pa.array(range(n), pa.timestamp("ms")),
        }
    )


def frame(ddf):
    return ddf.compute().reset_index(drop=True)


def test_read_equals_the_source(cluster, dask_server):
    table = source()
    name = unique()
    with gpu_flight.connect(dask_server.location) as gf:
        gf.put(name, table)
    ddf = read_dataset(dask_server.location, name)
    assert ddf.npartitions == 4
    assert list(ddf.columns) == table.column_names
    pd.testing.assert_frame_equal(frame(ddf), table.to_pandas(), check_dtype=False)


def test_no_data_is_read_while_building_the_graph(cluster, dask_server):
    name = unique()
    with gpu_flight.connect(dask_server.location) as gf:
        gf.put(name, source())
        ddf = read_dataset(dask_server.location, name)
        # The graph's tickets are for the version current at build time: dropping the dataset
        # before computing proves no task ran yet, and computing then fails with NOT_FOUND.
        gf.drop(name)
    with pytest.raises(pa.ArrowKeyError, match="not found"):
        ddf.compute()


def test_columns_and_dask_projection(cluster, dask_server):
    # Needs server-side projection (issue 24, item 3).
    table = source()
    name = unique()
    with gpu_flight.connect(dask_server.location) as gf:
        gf.put(name, table)
    ddf = read_dataset(dask_server.location, name, columns=["s", "i"])
    assert list(ddf.columns) == ["s", "i"]
    pd.testing.assert_frame_equal(frame(ddf), table.select(["s", "i"]).to_pandas(), check_dtype=False)
    whole = read_dataset(dask_server.location, name)
    pd.testing.assert_frame_equal(frame(whole[["f"]]), table.select(["f"]).to_pandas(), check_dtype=False)


def test_a_projection_whose_tickets_list_fewer_endpoints_still_reads(cluster, make_server):
    """A wide projection's tickets repeat its column list, so its FlightInfo lists fewer
    endpoints than the graph's (docs/protocol.md): each task then reads its own endpoint and
    keeps the projected columns."""
    server = make_server("--rows-per-endpoint", "1")
    table = pa.table({f"c{i}": pa.array(range(200), pa.int16()) for i in range(1501)})
    name = unique()
    with gpu_flight.connect(server.location) as gf:
        gf.put(name, table)
        wide = table.column_names[1:]
        assert len(gf.info(name, columns=wide).endpoints) < 200 == len(gf.info(name).endpoints)
    projected = read_dataset(server.location, name)[wide]
    for i in (0, 180):  # one task each: a whole wide frame of 200 partitions is slow to build
        got = frame(projected.partitions[i])
        pd.testing.assert_frame_equal(got, table.slice(i, 1).select(wide).to_pandas(), check_dtype=False)


def test_write_then_read_back(cluster, dask_server):
    table = source()
    pdf = table.to_pandas()
    ddf = dd.from_pandas(pdf, npartitions=3)
    name = unique()
    assert write_dataset(ddf, dask_server.location, name) == 1000
    with gpu_flight.connect(dask_server.location) as gf:
        back = gf.get(name)
        assert gf.list(f"{name}.tmp-") == []
    pd.testing.assert_frame_equal(back.to_pandas(), pdf, check_dtype=False)
    with pytest.raises(pa.ArrowException, match="already exists"):
        write_dataset(ddf, dask_server.location, name)
    assert write_dataset(ddf.head(10, compute=False), dask_server.location, name, mode="replace") == 10
    pd.testing.assert_frame_equal(
        frame(read_dataset(dask_server.location, name)), pdf.head(10), check_dtype=False
    )


def explode(part):
    if (part["i"] >= 500).any():
        raise RuntimeError("task failed on purpose")
    return part


def test_a_failed_task_leaves_the_target_as_it_was(cluster, dask_server):
    table = source()
    name = unique()
    with gpu_flight.connect(dask_server.location) as gf:
        gf.put(name, table.slice(0, 5))
        before = gf.get(name)
        bad = dd.from_pandas(table.to_pandas(), npartitions=4).map_partitions(explode)
        for mode in ("replace", "append"):
            with pytest.raises(RuntimeError, match="on purpose"):
                write_dataset(bad, dask_server.location, name, mode=mode)
            assert gf.get(name).equals(before)
        assert gf.list(f"{name}.tmp-") == []


def test_a_failed_task_on_a_local_scheduler_leaves_no_temporary(dask_server, monkeypatch):
    """The local schedulers re-raise a task's failure while the other tasks still run: the
    temporaries those put later must be dropped all the same."""
    import gpu_flight.dask as gfd

    def no_cluster():
        raise ValueError("no distributed client")

    real = gfd._write_partition

    def write(frame, name, schema, uri, connect_kwargs):
        if name.endswith("-0"):
            # Strings where the schema says int64: this partition's put fails at once.
            return real(frame.assign(i=frame["i"].astype(str) + "x"), name, schema, uri, connect_kwargs)
        time.sleep(1.0)  # the others are still being put when it does
        return real(frame, name, schema, uri, connect_kwargs)

    monkeypatch.setattr(distributed, "default_client", no_cluster)
    monkeypatch.setattr(gfd, "_write_partition", write)
    name = unique()
    ddf = dd.from_pandas(source().to_pandas(), npartitions=4)
    with dask.config.set(scheduler="threads", num_workers=4), pytest.raises(pa.ArrowException):
        write_dataset(ddf, dask_server.location, name, mode="create")
    time.sleep(2.0)  # anything still running has finished its put by now
    with gpu_flight.connect(dask_server.location) as gf:
        assert gf.list(name) == []
