"""Persistence (`--data-dir`) through the real binary, on every backend: a server killed with
SIGKILL in the middle of writes restarts with every dataset at a whole version, and every put
acknowledged under `--durability sync` present; the files are plain Arrow IPC that pyarrow
opens without the server."""

import json
import pathlib
import random
import subprocess
import sys
import textwrap
import time

import gpu_flight
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest
from conftest import Server
from test_flight import get, put
from test_ipc import cuda_only

# A client that writes until it is stopped, printing what the server acknowledged: creates of
# d<i>, and replaces of r (version i), each a table that says which it is.
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np, pyarrow as pa, pyarrow.flight as flight

    def table(seed, rows):
        return pa.table({"seed": np.full(rows, seed, dtype=np.int64), "x": np.arange(rows, dtype=np.int64) * seed,
                         "s": pa.array([f"{seed}-{i}" for i in range(rows % 5000)] + [None] * (rows - rows % 5000))})

    client = flight.connect(sys.argv[1])
    start = int(sys.argv[2])
    for i in range(start, start + 100000):
        for name, mode in ((f"d{i}", "create"), ("r", "replace")):
            data = table(i, 50_000 + 7919 * i % 150_000)
            descriptor = flight.FlightDescriptor.for_command(f'{{"name": "{name}", "mode": "{mode}"}}')
            writer, reader = client.do_put(descriptor, data.schema)
            writer.write_table(data, max_chunksize=30_000)
            writer.done_writing()
            reader.read()
            writer.close()
            print(name, i, flush=True)
    """
)


def table(seed, rows):
    return pa.table(
        {
            "seed": np.full(rows, seed, dtype=np.int64),
            "x": np.arange(rows, dtype=np.int64) * seed,
            "s": pa.array([f"{seed}-{i}" for i in range(rows % 5000)] + [None] * (rows - rows % 5000)),
        }
    )


def expected(seed):
    return table(seed, 50_000 + 7919 * seed % 150_000)


def names(client):
    return sorted(info.descriptor.path[0].decode() for info in client.list_flights())


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_server_killed_mid_write_restarts_with_whole_datasets(tmp_path, durability):
    data_dir = tmp_path / "data"
    flags = ("--data-dir", str(data_dir), "--durability", durability)
    acknowledged = {}  # name -> the last seed acknowledged
    rng = random.Random(7)
    start = 0
    for round in range(4):
        server = Server(*flags)
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, server.location, str(start)], stdout=subprocess.PIPE, text=True
        )
        time.sleep(rng.uniform(0.5, 2.0))
        server.process.kill()  # SIGKILL: no shutdown, writes cut anywhere
        server.process.wait()
        out, _ = writer.communicate(timeout=60)
        for line in out.splitlines():
            name, seed = line.split()
            acknowledged[name] = int(seed)
        start += 1000

        server = Server(*flags)
        with server.client() as client:
            present = names(client)
            for name in present:
                got = get(client, name)
                seed = got.column("seed")[0].as_py()
                assert got.equals(expected(seed)), f"{name} is whole (seed {seed})"
                if name.startswith("d"):
                    assert seed == int(name[1:]), name
            if durability == "sync":
                missing = [n for n in acknowledged if n not in present]
                assert not missing, f"acknowledged puts lost: {missing}"
                if "r" in acknowledged:
                    seed = get(client, "r").column("seed")[0].as_py()
                    assert seed >= acknowledged["r"], "an acknowledged replace was lost"
        assert server.stop() == 0
    assert len(acknowledged) > 2, "the writer got some puts through"


def test_the_files_are_arrow_ipc_that_pyarrow_opens_without_the_server(tmp_path):
    data_dir = tmp_path / "data"
    server = Server("--data-dir", str(data_dir))
    tables = {
        "plain": expected(3),
        "dictionary": pa.table({"d": pa.array(["a", "b", "a", None] * 1000).dictionary_encode()}),
        "empty": pa.table({"x": pa.array([], pa.int64())}),
        "a/b/../c": expected(5),
    }
    with server.client() as client:
        for name, data in tables.items():
            put(client, name, data, chunk=1500)
        put(client, "plain", expected(4), mode="append")
    status = server.status()["persistence"]
    assert status["durability"] == "sync" and status["failures"] == 0, status
    assert server.stop() == 0

    header, body = (data_dir / "manifest.json").read_text().split("\n", 1)
    assert json.loads(header)["format"] == 1
    manifest = json.loads(body)
    assert sorted(manifest["datasets"]) == sorted(tables)
    files = {p.name for p in (data_dir / "segments").iterdir()}
    for name, data in tables.items():
        segments = manifest["datasets"][name]["segments"]
        assert {s["file"] for s in segments} <= files
        read = [pa.ipc.open_file(data_dir / "segments" / s["file"]).read_all() for s in segments]
        got = pa.concat_tables(read)
        want = pa.concat_tables([data, expected(4)]) if name == "plain" else data
        assert got.schema.equals(want.schema), name
        assert got.combine_chunks().equals(want.combine_chunks()) or got.to_pylist() == want.to_pylist(), name

    # And the server serves them again: listed at once from the manifest and the files'
    # footers, each loaded when it is first read.
    server = Server("--data-dir", str(data_dir))
    tiers = server.status()["tiers"]
    assert tiers["loads"] == 0 and tiers["disk_bytes"] > 0, tiers
    with server.client() as client:
        assert names(client) == sorted(tables)
        info = client.get_flight_info(flight.FlightDescriptor.for_path("plain"))
        assert info.total_records == expected(3).num_rows + expected(4).num_rows
        assert json.loads(info.app_metadata)["tiers"]["disk"] > 0
        assert get(client, "plain").to_pylist() == pa.concat_tables([expected(3), expected(4)]).to_pylist()
        assert get(client, "dictionary").to_pylist() == tables["dictionary"].to_pylist()
        assert get(client, "empty").num_rows == 0
        info = client.get_flight_info(flight.FlightDescriptor.for_path("plain"))
        assert json.loads(info.app_metadata)["tiers"]["disk"] == 0
    assert server.status()["tiers"]["loads"] == 2
    assert server.stop() == 0


def test_a_second_server_on_the_same_directory_is_refused(tmp_path):
    data_dir = tmp_path / "data"
    first = Server("--data-dir", str(data_dir))
    with pytest.raises(RuntimeError, match="in use by another process"):
        Server("--data-dir", str(data_dir), log=str(tmp_path / "second.log"))
    assert first.stop() == 0


@cuda_only
def test_after_a_restart_ipc_export_loads_the_files_onto_the_gpu(tmp_path):
    data_dir = tmp_path / "data"
    data = expected(7)
    server = Server("--data-dir", str(data_dir))
    with server.client() as client:
        put(client, "t", data, chunk=20_000)
    assert server.stop() == 0

    server = Server("--data-dir", str(data_dir))
    try:
        assert server.status()["tiers"]["loads"] == 0
        with server.client() as client:
            with gpu_flight.connect(server.location) as gf, gf.export("t") as exported:
                assert exported.to_arrow().to_pylist() == data.to_pylist()
            info = client.get_flight_info(flight.FlightDescriptor.for_path("t"))
            tiers = json.loads(info.app_metadata)["tiers"]
            assert tiers["device"] > 0 and tiers["disk"] == 0 and tiers["host"] == 0, tiers
        assert server.status()["tiers"]["loads"] == 1
    finally:
        assert server.stop() == 0
