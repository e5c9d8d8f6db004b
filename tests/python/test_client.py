"""The gpu_flight package's client against the real binary."""

import os
import platform
import subprocess
import sys
import textwrap
import uuid

import gpu_flight
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import trustme

from test_flight import all_types_table


def unique(prefix="c"):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gf(server):
    with gpu_flight.connect(server.location) as client:
        yield client


def test_put_get_round_trips_every_type(gf):
    table = all_types_table()
    name = unique()
    result = gf.put(name, table)
    assert isinstance(result, gpu_flight.PutResult)
    assert (result.name, result.mode, result.rows, result.total_rows) == (name, "create", 200, 200)
    assert result.bytes > 0 and result.total_bytes == result.bytes
    assert gf.get(name).equals(table)
    assert gf.schema(name).equals(table.schema)
    assert gf.info(name).total_records == 200


def test_put_streams_readers_iterables_and_batches(gf):
    table = pa.table({"x": list(range(1000)), "s": [str(i) for i in range(1000)]})
    batches = table.to_batches(max_chunksize=100)
    consumed = []

    def generate():
        for batch in batches:
            consumed.append(batch.num_rows)
            yield batch

    reader = pa.RecordBatchReader.from_batches(table.schema, generate())
    name = unique()
    assert gf.put(name, reader).rows == 1000
    assert consumed == [100] * 10
    assert gf.get(name).equals(table)
    assert gf.put(name, iter(batches), mode="replace").rows == 1000
    assert gf.put(name, batches[0], mode="append").total_rows == 1100
    assert gf.get(name, compression="zstd").num_rows == 1100


def test_large_batches_are_sent_in_slices(gf, monkeypatch):
    from gpu_flight import _client

    monkeypatch.setattr(_client, "PUT_MESSAGE_BYTES", 4096)
    table = pa.table({"x": pa.array(range(10_000), pa.int64())})
    name = unique()
    assert gf.put(name, table, compression="lz4").rows == 10_000
    assert gf.get(name).equals(table)


class SourceFailed(Exception):
    pass


def failing_source(table, batches=2):
    """Yields `batches` batches of `table`, then raises SourceFailed."""

    def generate():
        yield from table.to_batches(max_chunksize=table.num_rows // (batches + 1))[:batches]
        raise SourceFailed("the source broke")

    return generate()


@pytest.mark.parametrize("wrap", ["iterable", "reader"])
def test_a_source_that_raises_abandons_the_put(make_server, wrap):
    server = make_server()
    table = pa.table({"x": pa.array(range(30_000), pa.int64())})
    kept = pa.table({"x": pa.array([-1, -2], pa.int64())})

    def source():
        batches = failing_source(table)
        return batches if wrap == "iterable" else pa.RecordBatchReader.from_batches(table.schema, batches)

    with gpu_flight.connect(server.location) as gf:
        with pytest.raises(SourceFailed, match="the source broke"):
            gf.put("fresh", source())
        assert "fresh" not in gf.list()
        gf.put("kept", kept)
        baseline = server.used_bytes()
        for mode in ("append", "replace"):
            with pytest.raises(SourceFailed):
                gf.put("kept", source(), mode=mode)
            assert gf.get("kept").equals(kept)
        assert gf.list() == ["kept"]
        assert server.used_bytes() == baseline
        # The connection still serves puts.
        assert gf.put("kept", table, mode="append").total_rows == 30_002


def test_a_batch_that_cannot_be_sent_abandons_the_put(make_server):
    """A reader does not check its batches against its schema; the writer refuses the odd one
    only after the batches before it went out. The put must be abandoned, not committed."""
    server = make_server()
    kept = pa.table({"a": pa.array([7], pa.int64())})

    def batches():
        yield pa.record_batch({"a": pa.array([1, 2], pa.int64())})
        yield pa.record_batch({"a": pa.array(["x"], pa.string())})

    with gpu_flight.connect(server.location) as gf:
        gf.put("kept", kept)
        reader = pa.RecordBatchReader.from_batches(kept.schema, batches())
        with pytest.raises(pa.ArrowInvalid):
            gf.put("kept", reader, mode="replace")
        assert gf.get("kept").equals(kept)


def test_reader_is_lazy_and_in_endpoint_order(make_server):
    server = make_server("--rows-per-endpoint", "100")
    with gpu_flight.connect(server.location) as gf:
        table = pa.table({"x": list(range(450))})
        gf.put("ordered", table)
        assert len(gf.info("ordered").endpoints) == 5
        reader = gf.reader("ordered")
        assert reader.schema.equals(table.schema)
        assert reader.read_all().equals(table)


def test_modes_and_errors_carry_the_servers_message(gf):
    name = unique()
    gf.put(name, pa.table({"x": [1, 2]}))
    with pytest.raises(pa.ArrowException, match="already exists"):
        gf.put(name, pa.table({"x": [3]}))
    with pytest.raises(pa.ArrowInvalid, match="append needs identical fields"):
        gf.put(name, pa.table({"y": ["a"]}), mode="append")
    assert gf.get(name).column("x").to_pylist() == [1, 2]
    with pytest.raises(pa.ArrowInvalid, match="invalid argument"):
        gf.put(name, pa.table({"x": [3]}), mode="upsert")
    with pytest.raises(pa.ArrowKeyError, match="not found"):
        gf.get("no-such-dataset")
    with pytest.raises(pa.ArrowKeyError, match="not found"):
        gf.drop("no-such-dataset")
    with pytest.raises(pa.ArrowInvalid, match="invalid argument"):
        gf.info("bad\x01name")
    gf.put(name, pa.table({"y": ["z"]}), mode="replace")
    assert gf.get(name).to_pylist() == [{"y": "z"}]


def test_list_drop_status_move_copy(gf):
    prefix = unique("admin")
    gf.put(f"{prefix}-a", pa.table({"x": [1, 2, 3]}))
    assert gf.list(prefix) == [f"{prefix}-a"]
    assert [info.total_records for info in gf.infos(prefix)] == [3]
    status = gf.status()
    assert status["backend"] and status["datasets"] >= 1
    copied = gf.copy(f"{prefix}-a", f"{prefix}-b")
    assert (copied.name, copied.as_name) == (f"{prefix}-a", f"{prefix}-b")
    with pytest.raises(pa.ArrowException, match="already exists"):
        gf.copy(f"{prefix}-a", f"{prefix}-b")
    moved = gf.move(f"{prefix}-b", status["devices"][0]["device"])
    assert moved.name == f"{prefix}-b"
    assert sorted(gf.list(prefix)) == [f"{prefix}-a", f"{prefix}-b"]
    dropped = gf.drop(f"{prefix}-a")
    assert (dropped.name, dropped.rows) == (f"{prefix}-a", 3)
    assert gf.get(f"{prefix}-b").column("x").to_pylist() == [1, 2, 3]
    gf.drop(f"{prefix}-b")
    assert gf.list(prefix) == []


def test_columns_project_on_the_server(gf):
    # Needs server-side projection (issue 24, item 3).
    table = pa.table({"a": [1, 2], "b": ["x", "y"], "c": [0.5, 1.5]})
    name = unique()
    gf.put(name, table)
    assert gf.schema(name, columns=["c", "a"]).names == ["c", "a"]
    info = gf.info(name, columns=["b"])
    assert info.schema.names == ["b"]
    assert gf.get(name, columns=["c", "a"]).equals(table.select(["c", "a"]))
    with pytest.raises(pa.ArrowInvalid, match="nope"):
        gf.get(name, columns=["a", "nope"])


def test_columns_must_be_a_sequence_of_names(gf):
    with pytest.raises(TypeError, match="sequence of column names"):
        gf.get("anything", columns="a")


def test_token_and_basic_login(make_server, tmp_path):
    from conftest import new_token

    entry, token = new_token("writer", "write")
    path = tmp_path / "tokens.toml"
    path.write_text(entry)
    path.chmod(0o600)
    server = make_server("--auth-tokens", str(path))
    with (
        gpu_flight.connect(server.location) as anonymous,
        pytest.raises(flight.FlightUnauthenticatedError, match="Bearer"),
    ):
        anonymous.list()
    with gpu_flight.connect(server.location, token=token, timeout=30) as gf:
        gf.put("secret", pa.table({"x": [1]}))
        assert gf.get("secret").num_rows == 1
    with (
        gpu_flight.connect(server.location, token="made-up") as gf,
        pytest.raises(flight.FlightUnauthenticatedError),
    ):
        gf.get("secret")
    with pytest.raises(ValueError, match="not both"):
        gpu_flight.connect(server.location, token=token, username="u", password="p")


def test_imports_without_gpu_libraries():
    script = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("cupy", "cudf", "torch", "dask", "distributed", "cuda"):
                    raise ImportError(f"{name} is blocked")
                return None

        sys.meta_path.insert(0, Block())
        import gpu_flight
        import gpu_flight.dask as gd
        assert not {"cupy", "cudf", "torch", "dask", "cuda"} & set(sys.modules)
        try:
            gd.read_dataset("grpc://127.0.0.1:1", "x")
        except ImportError as error:
            assert "gpu-flight[dask]" in str(error), error
        else:
            raise AssertionError("read_dataset without dask")
        try:  # device=0 needs CUDA before anything is sent
            gpu_flight.connect("grpc://127.0.0.1:1").export("x", device=0)
        except ImportError as error:
            assert "cuda-bindings" in str(error) and "gpu-flight[cuda]" in str(error), error
        else:
            raise AssertionError("export without cuda-bindings")
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _glibc_version() -> tuple[int, ...]:
    name, version = platform.libc_ver()
    if name != "glibc":
        return ()
    return tuple(int(part) for part in version.split(".") if part.isdigit())


@pytest.mark.skipif(_glibc_version() < (2, 33), reason="glibc 2.33 or newer (mallinfo2)")
def test_keep_freed_memory_keeps_large_blocks_in_the_heap():
    # In a process of its own: the settings are the whole process's, and none may come from
    # the environment (GLIBC_TUNABLES, MALLOC_*), nor another allocator be preloaded. A
    # chunk's size word, just before it, has the bit of value 2 set where glibc mapped it.
    script = textwrap.dedent(
        """
        import ctypes

        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]

        class Mallinfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        libc.mallinfo2.restype = Mallinfo2
        MIB = 1 << 20

        def mapped(size):
            block = libc.malloc(size)
            flags = ctypes.c_size_t.from_address(block - 8).value
            libc.free(block)
            return bool(flags & 2)

        # Freeing a mapped block raises glibc's threshold to its size (24 MiB here): 28 MiB
        # would still be mapped, and 3 x 28 MiB freed at the heap's top given back.
        before = mapped(24 * MIB)
        import gpu_flight
        applied = gpu_flight.keep_freed_memory()
        after = mapped(28 * MIB)
        blocks = [libc.malloc(28 * MIB) for _ in range(3)]
        for block in reversed(blocks):
            libc.free(block)
        kept = libc.mallinfo2().fordblks >= 84 * MIB
        print(before, applied, after, kept)
        """
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("GLIBC_TUNABLES", "LD_PRELOAD") and not key.startswith("MALLOC_")
    }
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False", "True"]


def test_tls_mutual_certificates_and_basic_login(make_server, tmp_path):
    """connect() over TLS: the server verified against tls_root_certs, the client's own
    certificate for mutual TLS, and a Basic login whose session token rides on every call."""
    from test_security import tls_flags, user_entry

    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    leaf.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    (tmp_path / "server.pem").write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    users = tmp_path / "tokens.toml"
    users.write_text(user_entry("carol", "write", "correct horse"))
    users.chmod(0o600)
    server = make_server(*tls_flags(tmp_path, mutual=True), "--auth-tokens", str(users))
    location = server.location.replace("127.0.0.1", "localhost")
    mine = ca.issue_cert("client@example.com")
    keys = {
        "tls_root_certs": ca.cert_pem.bytes(),
        "cert_chain": b"".join(blob.bytes() for blob in mine.cert_chain_pems),
        "private_key": mine.private_key_pem.bytes(),
    }
    with gpu_flight.connect(location, username="carol", password="correct horse", **keys) as gf:
        gf.put("tls", pa.table({"x": [1, 2, 3]}))
        assert gf.get("tls").to_pydict() == {"x": [1, 2, 3]}
        assert gf.list() == ["tls"]
    with pytest.raises(flight.FlightUnauthenticatedError, match="wrong password"):
        gpu_flight.connect(location, username="carol", password="wrong", **keys)
    stranger = {**keys, "tls_root_certs": trustme.CA().cert_pem.bytes()}
    with (
        gpu_flight.connect(location, token="x", timeout=5, **stranger) as gf,
        pytest.raises(flight.FlightUnavailableError),
    ):
        gf.list()
