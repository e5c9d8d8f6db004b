"""The pyarrow.flight conformance suite: drives the real gpu-flight binary as users do."""

import datetime
import decimal
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from conftest import BINARY, new_token


def unique(prefix="t"):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def put(client, name, table, mode=None, chunk=None):
    """Puts `table`; returns the server's JSON summary."""
    if mode is None:
        descriptor = flight.FlightDescriptor.for_path(name)
    else:
        descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": name, "mode": mode}))
    writer, reader = client.do_put(descriptor, table.schema)
    if chunk is None:
        writer.write_table(table)
    else:
        writer.write_table(table, max_chunksize=chunk)
    writer.done_writing()
    result = reader.read()
    writer.close()  # raises the server's error, if the put failed
    return json.loads(result.to_pybytes())


def get(client, name):
    """Reads every endpoint of `name`, in order."""
    info = client.get_flight_info(flight.FlightDescriptor.for_path(name))
    tables = [client.do_get(endpoint.ticket).read_all() for endpoint in info.endpoints]
    return pa.concat_tables(tables) if tables else None


def action(client, name, body=None):
    payload = b"" if body is None else json.dumps(body).encode()
    results = list(client.do_action(flight.Action(name, payload)))
    assert len(results) == 1
    return json.loads(results[0].body.to_pybytes())


def all_types_table(n=200):
    rng = np.random.default_rng(7)
    mask = rng.random(n) < 0.2

    def nullable(values, type_):
        return pa.array(values, type=type_, mask=mask)

    tz = "America/New_York"
    ints = np.arange(n)
    columns = {
        "i8": nullable(ints % 100, pa.int8()),
        "i16": nullable(ints, pa.int16()),
        "i32": nullable(ints, pa.int32()),
        "i64": nullable(ints * -1_000_000_007, pa.int64()),
        "u8": nullable(ints % 200, pa.uint8()),
        "u16": nullable(ints, pa.uint16()),
        "u32": nullable(ints, pa.uint32()),
        "u64": nullable(np.uint64(2**63) + ints.astype(np.uint64), pa.uint64()),
        "f16": nullable((ints / 8).astype(np.float16), pa.float16()),
        "f32": nullable((ints / 3).astype(np.float32), pa.float32()),
        "f64": nullable(ints / 7, pa.float64()),
        "bool": nullable(ints % 3 == 0, pa.bool_()),
        "utf8": nullable([f"ü{i}" * (i % 5) for i in ints], pa.string()),
        "large_utf8": nullable([str(i) for i in ints], pa.large_string()),
        "binary": nullable([bytes([i % 256]) * (i % 4) for i in ints], pa.binary()),
        "large_binary": nullable([b"x" * (i % 3) for i in ints], pa.large_binary()),
        "fixed_binary": nullable([i.to_bytes(4, "little") for i in ints.tolist()], pa.binary(4)),
        "date32": nullable([datetime.date(2020, 1, 1) + datetime.timedelta(days=int(i)) for i in ints], pa.date32()),
        "date64": nullable([datetime.date(2021, 6, 1) + datetime.timedelta(days=int(i)) for i in ints], pa.date64()),
        "time32": nullable(ints.astype(np.int32), pa.time32("ms")),
        "time64": nullable(ints * 1000, pa.time64("ns")),
        "timestamp_tz": nullable(ints * 1_000_000, pa.timestamp("us", tz=tz)),
        "timestamp_naive": nullable(ints, pa.timestamp("s")),
        "duration": nullable(ints, pa.duration("ms")),
        "decimal128": nullable([decimal.Decimal(i) / 100 for i in ints.tolist()], pa.decimal128(12, 2)),
        "decimal256": nullable([decimal.Decimal(i) * 10**40 for i in ints.tolist()], pa.decimal256(60, 0)),
        "list": nullable([[i, None, i + 1][: i % 4] for i in ints.tolist()], pa.list_(pa.int32())),
        "large_list": nullable([["a"] * (i % 3) for i in ints.tolist()], pa.large_list(pa.string())),
        "fixed_list": nullable([[float(i), 0.5] for i in ints.tolist()], pa.list_(pa.float64(), 2)),
        "struct": nullable(
            [{"a": int(i), "b": f"s{i}" if i % 2 else None} for i in ints],
            pa.struct([("a", pa.int64()), ("b", pa.string())]),
        ),
        "map": nullable([[("k", int(i)), ("j", None)] for i in ints], pa.map_(pa.string(), pa.int64())),
        "dictionary": pa.array([["red", "green", None][i % 3] for i in ints.tolist()]).dictionary_encode(),
        "nested": nullable(
            [[{"x": [int(i)]}] if i % 2 else [] for i in ints],
            pa.list_(pa.struct([("x", pa.list_(pa.int16()))])),
        ),
        "all_null": pa.nulls(n, pa.int64()),
    }
    table = pa.table(columns)
    return table.replace_schema_metadata({"origin": "test", "rows": str(n)})


def test_every_type_round_trips_with_metadata(client):
    table = all_types_table()
    name = unique("types")
    summary = put(client, name, table, chunk=64)
    assert summary["name"] == name and summary["rows"] == table.num_rows and summary["bytes"] > 0
    got = get(client, name)
    assert got.schema.equals(table.schema, check_metadata=True)
    assert got.equals(table)
    by_name = client.do_get(flight.Ticket(name.encode())).read_all()
    assert by_name.equals(table)
    assert client.get_schema(flight.FlightDescriptor.for_path(name)).schema.equals(table.schema, check_metadata=True)


@pytest.mark.parametrize("column", list(all_types_table(4).column_names))
def test_each_type_alone(client, column):
    table = all_types_table(50).select([column])
    name = unique(column)
    put(client, name, table)
    assert get(client, name).equals(table)


def test_pandas_frame_round_trips(client):
    frame = pd.DataFrame(
        {
            "city": pd.Categorical(["Paris", "Oslo", "Paris", None]),
            "temp": [12.5, None, 14.0, 3.25],
            "when": pd.date_range("2024-01-01", periods=4, tz="UTC"),
            "n": pd.array([1, None, 3, 4], dtype="Int64"),
        },
        index=pd.Index(["a", "b", "c", "d"], name="key"),
    )
    table = pa.Table.from_pandas(frame)
    name = unique("pandas")
    put(client, name, table)
    got = get(client, name)
    assert got.schema.metadata[b"pandas"] == table.schema.metadata[b"pandas"]
    pd.testing.assert_frame_equal(got.to_pandas(), frame)


def test_sliced_arrays_and_chunked_tables(client):
    base = all_types_table(300)
    table = pa.concat_tables([base.slice(3, 101), base.slice(150, 1), base.slice(299, 1), base.slice(10, 0)])
    name = unique("sliced")
    put(client, name, table)
    assert get(client, name).equals(table)


def test_empty_table_and_zero_row_batches(client):
    schema = pa.schema([("x", pa.int64()), ("s", pa.string())], metadata={"k": "v"})
    name = unique("empty")
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(name), schema)
    writer.done_writing()
    assert json.loads(reader.read().to_pybytes())["rows"] == 0
    writer.close()
    info = client.get_flight_info(flight.FlightDescriptor.for_path(name))
    assert info.total_records == 0 and len(info.endpoints) == 1
    got = client.do_get(info.endpoints[0].ticket).read_all()
    assert got.num_rows == 0 and got.schema.equals(schema, check_metadata=True)

    name = unique("zeros")
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(name), schema)
    writer.write_batch(pa.RecordBatch.from_pylist([], schema=schema))
    writer.write_batch(pa.RecordBatch.from_pylist([{"x": 1, "s": "a"}], schema=schema))
    writer.write_batch(pa.RecordBatch.from_pylist([], schema=schema))
    writer.close()
    assert get(client, name).to_pylist() == [{"x": 1, "s": "a"}]


def test_put_modes(client):
    name = unique("modes")
    first = pa.table({"x": [1, 2, 3]})
    put(client, name, first)
    with pytest.raises(pa.ArrowException, match="already exists error"):
        put(client, name, first)
    summary = put(client, name, pa.table({"x": [4]}), mode="append")
    assert summary["rows"] == 1 and summary["total_rows"] == 4
    assert get(client, name).column("x").to_pylist() == [1, 2, 3, 4]
    with pytest.raises(pa.ArrowInvalid, match="append needs identical fields"):
        put(client, name, pa.table({"y": ["a"]}), mode="append")
    assert get(client, name).column("x").to_pylist() == [1, 2, 3, 4]
    put(client, name, pa.table({"y": ["z"]}), mode="replace")
    assert get(client, name).to_pylist() == [{"y": "z"}]
    with pytest.raises(pa.ArrowInvalid, match="invalid argument error"):
        put(client, name, first, mode="upsert")


@pytest.mark.parametrize("path", [("a", "b"), ("",), ("bad\x01name",), ("x" * 257,)])
def test_invalid_descriptors(client, path):
    with pytest.raises(pa.ArrowInvalid, match="invalid argument error"):
        client.get_flight_info(flight.FlightDescriptor.for_path(*path))
    table = pa.table({"x": [1]})
    with pytest.raises(pa.ArrowInvalid, match="invalid argument error"):
        writer, _ = client.do_put(flight.FlightDescriptor.for_path(*path), table.schema)
        writer.write_table(table)
        writer.close()


def test_unknown_names_and_tickets(client):
    with pytest.raises(pa.ArrowKeyError, match="not found error"):
        client.get_flight_info(flight.FlightDescriptor.for_path("no-such-dataset"))
    with pytest.raises(pa.ArrowKeyError, match="not found error"):
        client.do_get(flight.Ticket(b"no-such-dataset")).read_all()
    with pytest.raises(pa.ArrowKeyError, match="not found error"):
        action(client, "drop", {"name": "no-such-dataset"})
    with pytest.raises(pa.ArrowInvalid, match="invalid ticket"):
        client.do_get(flight.Ticket(b"\x00gpu-flight-ticket/1\n{garbage")).read_all()
    with pytest.raises(pa.ArrowNotImplementedError, match="unknown action"):
        action(client, "explode")


def test_endpoints_and_sizes(make_server):
    server = make_server("--rows-per-endpoint", "1000")
    with server.client() as client:
        table = pa.table({"a": np.arange(2500, dtype=np.int64), "b": np.arange(2500, dtype=np.float64)})
        put(client, "sized", table)
        info = client.get_flight_info(flight.FlightDescriptor.for_path("sized"))
        assert info.total_records == 2500
        assert info.total_bytes == 2500 * 16
        assert [client.do_get(e.ticket).read_all().num_rows for e in info.endpoints] == [1000, 1000, 500]
        # A ticket issued before a replace is refused rather than mixing versions.
        put(client, "sized", table.slice(0, 10), mode="replace")
        with pytest.raises(pa.ArrowKeyError, match="GetFlightInfo again"):
            client.do_get(info.endpoints[0].ticket).read_all()


def test_small_receive_limit_reads_100_mb(server, client):
    name = unique("big")
    table = pa.table({f"c{i}": np.arange(1_600_000, dtype=np.int64) * i for i in range(8)})
    put(client, name, table)
    limited = flight.FlightClient(
        server.location, generic_options=[("grpc.max_receive_message_length", 4 * 1024 * 1024)]
    )
    with limited:
        got = limited.do_get(flight.Ticket(name.encode())).read_all()
    assert got.equals(table)
    action(client, "drop", {"name": name})


def test_memory_limit(make_server):
    # Room for a small dataset on every backend (a GPU rounds allocations up to 2 MiB).
    server = make_server("--memory-limit", "8MiB", "--host-memory-limit", "0")
    with server.client() as client:
        small = pa.table({"x": np.arange(10_000, dtype=np.int64)})
        put(client, "small", small)
        used = server.used_bytes()
        big = pa.table({"x": np.arange(2_000_000, dtype=np.int64)})
        with pytest.raises(pa.ArrowException, match="resource exhausted error"):
            put(client, "big", big)
        assert server.used_bytes() == used
        assert get(client, "small").equals(small)
        with pytest.raises(pa.ArrowKeyError):
            client.get_flight_info(flight.FlightDescriptor.for_path("big"))


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np, pyarrow as pa, pyarrow.flight as flight
    client = flight.connect(sys.argv[1])
    table = pa.table({"x": np.arange(1_000_000, dtype=np.int64)})
    writer, _ = client.do_put(flight.FlightDescriptor.for_path("killed"), table.schema)
    writer.write_table(table, max_chunksize=100_000)
    print("sent", flush=True)
    time.sleep(600)
    """
)


def test_killed_client_leaves_no_trace(make_server):
    server = make_server()
    baseline = server.used_bytes()
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, server.location], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "sent"
        server.wait_for(lambda: server.used_bytes() > baseline)
    finally:
        writer.kill()
        writer.wait()
    server.wait_for(lambda: server.used_bytes() == baseline)
    status = server.status()
    assert status["datasets"] == 0 and status["bytes"] == 0
    with server.client() as client, pytest.raises(pa.ArrowKeyError):
        client.get_flight_info(flight.FlightDescriptor.for_path("killed"))


def test_parallel_clients(server):
    def work(i):
        with server.client() as client:
            name = unique(f"par{i}")
            table = pa.table({"x": np.arange(i * 1000, (i + 1) * 1000 + 50_000), "s": [str(i)] * 51_000})
            for part in (table.slice(0, 20_000), table.slice(20_000)):
                put(client, name, part, mode="append")
            for _ in range(3):
                assert get(client, name).equals(table)
            action(client, "drop", {"name": name})
            return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(16)))


def test_list_flights_actions_and_status(make_server):
    server = make_server()
    with server.client() as client:
        for name in ("sales/2024", "sales/2025", "users"):
            put(client, name, pa.table({"x": [1, 2, 3]}))
        listed = [info.descriptor.path[0].decode() for info in client.list_flights(b"sales/")]
        assert listed == ["sales/2024", "sales/2025"]
        assert all(info.total_records == 3 for info in client.list_flights())
        actions = {a.type: a.description for a in client.list_actions()}
        assert {"drop", "status"} <= set(actions) and all(actions.values())
        status = action(client, "status")
        assert status["datasets"] == 3 and status["data_bytes"] == 72
        assert status["backend"] == os.environ.get("GPU_FLIGHT_BACKEND", "host")
        device = status["devices"][0]
        assert device["used_bytes"] == status["bytes"] >= 72 and device["total_bytes"] > 0
        assert action(client, "drop", {"name": "users"}) == {"name": "users", "rows": 3, "bytes": 24}
        assert action(client, "status")["datasets"] == 2


def test_dictionary_keeps_its_encoding(client):
    name = unique("dict")
    table = pa.table({"d": pa.array(["a", "b", "a", None] * 100).dictionary_encode()})
    put(client, name, table)
    got = get(client, name)
    assert pa.types.is_dictionary(got.schema.field("d").type)
    assert got.equals(table)


def test_sigterm_exits_cleanly(make_server):
    server = make_server()
    with server.client() as client:
        put(client, "t", pa.table({"x": [1]}))
    assert server.stop() == 0


@pytest.fixture(scope="module")
def credentials_file(tmp_path_factory):
    entry, _ = new_token("ops", "admin")
    path = tmp_path_factory.mktemp("auth") / "tokens.toml"
    path.write_text(entry)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_right_after_start_is_handled(make_server, credentials_file, signal_name):
    """Supervisors signal as soon as the server says it serves: the handlers must already be
    there (they once went in only when the server loop first ran, and such a SIGTERM killed
    the process). SIGHUP reloads the token file and the server goes on."""
    for _ in range(5):
        server = make_server("--auth-tokens", str(credentials_file))
        server.process.send_signal(getattr(signal, signal_name))
        if signal_name == "SIGHUP":
            time.sleep(0.2)
            assert server.process.poll() is None, "SIGHUP must not stop the server"
        assert server.stop() == 0


def test_appended_categoricals_come_back_as_one_categorical(client):
    name = unique("cats")
    first = pd.DataFrame({"city": pd.Categorical(["Paris", "Oslo", "Paris"])})
    second = pd.DataFrame({"city": pd.Categorical(["Lima", None, "Oslo"])})
    put(client, name, pa.Table.from_pandas(first, preserve_index=False))
    put(client, name, pa.Table.from_pandas(second, preserve_index=False), mode="append")
    frame = get(client, name).to_pandas()
    assert frame["city"].tolist()[:3] == ["Paris", "Oslo", "Paris"]
    assert frame["city"].tolist()[3] == "Lima" and pd.isna(frame["city"].tolist()[4])
    assert sorted(frame["city"].cat.categories) == ["Lima", "Oslo", "Paris"]


def unix_client(path):
    """pyarrow over a Unix socket, as it connects by default."""
    return flight.connect(f"grpc+unix://{path}")


def test_unix_socket_listener(make_server, tmp_path):
    """`--listen unix:///path` beside TCP: the same datasets through either, the peer's
    process in the log, the socket file gone after shutdown."""
    path = tmp_path / "gpu-flight.sock"
    log = tmp_path / "server.log"
    server = make_server("--listen", f"unix://{path}", log=log)
    assert server.process.stdout.readline().startswith(f"gpu-flight serving on grpc+unix://{path} ")
    assert path.is_socket()
    table = pa.table({"x": pa.array(range(100_000), pa.int64()), "s": [str(i) for i in range(100_000)]})
    with unix_client(path) as over_unix, server.client() as over_tcp:
        assert put(over_unix, "local", table)["rows"] == 100_000
        assert get(over_tcp, "local").equals(table)
        assert get(over_unix, "local").equals(table)
    assert server.stop() == 0
    assert not path.exists(), "the socket file is removed at shutdown"
    assert re.search(rf'method="DoPut" dataset="local" .*peer="unix pid={os.getpid()} uid={os.getuid()}"',
                     log.read_text())


def test_stock_grpc_clients_work_on_the_unix_socket(make_server, tmp_path):
    """gRPC 1.57+ clients, pyarrow's and grpcio's, left to name the HTTP/2 authority
    themselves, send the socket's %-encoded path, which the server's HTTP/2 library (h2) would
    reset as malformed before the server sees the call (hyperium/h2#487). The server serves
    them as `localhost` instead, saying so once per connection at debug level; an authority the
    client names is kept."""
    path = tmp_path / "gpu-flight.sock"
    log = tmp_path / "server.log"
    server = make_server("--listen", f"unix://{path}", log=log,
                         env={"RUST_LOG": "info,gpu_flight::server=debug"})
    table = pa.table({"x": pa.array(range(100_000), pa.int64()), "s": [str(i) for i in range(100_000)]})
    with flight.connect(f"grpc+unix://{path}") as stock:
        assert put(stock, "stock", table)["rows"] == 100_000
        assert get(stock, "stock").equals(table)
        assert [f.descriptor.path for f in stock.list_flights()] == [[b"stock"]]
    with grpc.insecure_channel(f"unix://{path}") as channel:
        # HealthCheckRequest{service: ""} is empty; the answer is {status: SERVING (1)}.
        answer = channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)
        assert answer == b"\x08\x01"
    with flight.connect(f"grpc+unix://{path}",
                        generic_options=[("grpc.default_authority", "localhost:1234")]) as named:
        assert get(named, "stock").num_rows == 100_000
    encoded = str(path).lstrip("/").replace("/", "%2F")
    replaced = re.compile(rf'served as localhost .*authority="{re.escape(encoded)}"')
    server.wait_for(lambda: len(replaced.findall(log.read_text())) == 2)
    assert "localhost:1234" not in log.read_text()
    assert "malformed" not in log.read_text()


def test_a_unix_socket_in_use_is_not_taken_over(make_server, tmp_path):
    path = tmp_path / "gpu-flight.sock"
    make_server("--listen", f"unix://{path}")
    second = subprocess.run([BINARY, "--backend", "host", "--listen", f"unix://{path}"],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode != 0 and "another server is listening" in second.stderr, second.stderr


def environment(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_freed_memory_is_kept_for_reuse_unless_configured(make_server):
    """The server keeps freed memory 10 s before returning it (MIMALLOC_PURGE_DELAY, read by
    the allocator at start: the process sets it and re-executes itself); an operator's own
    value stands."""
    default = make_server()
    expected = os.environ.get("MIMALLOC_PURGE_DELAY", "10000").encode()
    assert environment(default.process.pid)[b"MIMALLOC_PURGE_DELAY"] == expected
    chosen = make_server(env={"MIMALLOC_PURGE_DELAY": "0"})
    assert environment(chosen.process.pid)[b"MIMALLOC_PURGE_DELAY"] == b"0"
    with chosen.client() as client:
        put(client, "t", pa.table({"x": [1, 2]}))
        assert get(client, "t").num_rows == 2


def test_a_full_server_evicts_silent_tcp_connections_for_unix_clients(make_server, tmp_path):
    """TCP and Unix listeners share --max-connections, and eviction picks across both: sockets
    that never start HTTP/2 cannot lock clients of the other listener out."""
    path = tmp_path / "gpu-flight.sock"
    server = make_server("--listen", f"unix://{path}", "--max-connections", "2")
    host, port = server.location.removeprefix("grpc://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(2)]
    try:
        time.sleep(0.5)  # both accepted: they hold the whole budget
        with unix_client(path) as client:
            assert list(client.list_flights()) == []
    finally:
        for connection in silent:
            connection.close()
