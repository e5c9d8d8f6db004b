"""A JVM client against the real binary: tests/java/FlightJavaClient.java, gRPC stubs compiled from
Arrow's Flight.proto (tests/java/proto) with protoc and Debian's grpc-java, and Arrow Java's IPC
reader and writer from the jars pyspark ships. It decodes the server's FlightData with Arrow Java
as they come (data_header the IPC Message, data_body its body) and puts batches Arrow Java encoded,
which shows that Spark's and other JVM Arrow readers take our streams unchanged.

Compiled once per session (a few seconds). Skipped, saying what is missing, where a tool or jar is
absent; tests/run-all.sh installs them from Debian.

Netty: grpc-netty 1.41 (Debian) fails on netty 4.2, which pyspark ships (netty 4.2's HTTP/2 decoder
iterates the response headers, and grpc-netty 1.41's header class refuses that with
UnsupportedOperationException), and a classpath holds one netty. So the client runs on Debian's
netty 4.1, which grpc-netty was packaged with; Arrow Java's allocator (arrow-memory-netty) runs on
it too. The decoding this tests is arrow-vector's and does not touch netty.
"""

import dataclasses
import datetime
import decimal
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from conftest import ROOT, Server, new_token

JAVA_SOURCES = ROOT / "tests" / "java"
DEBIAN_JARS = pathlib.Path("/usr/share/java")
PROTO_INCLUDE = pathlib.Path("/usr/include")  # google/protobuf/timestamp.proto (libprotobuf-dev)
GRPC_JAVA_PLUGIN = "/usr/bin/grpc_java_plugin"
# gRPC, protobuf and what they need, and netty 4.1 (see the module's docstring), from Debian.
DEBIAN = [
    "grpc-api", "grpc-context", "grpc-core", "grpc-netty", "grpc-protobuf", "grpc-protobuf-lite",
    "grpc-stub", "protobuf", "guava", "perfmark-api",
    "geronimo-annotation-1.3-spec",  # javax.annotation.Generated, on the generated stubs
    "netty-buffer", "netty-codec", "netty-codec-http", "netty-codec-http2", "netty-common",
    "netty-handler", "netty-resolver", "netty-transport",
]  # fmt: skip
# Arrow Java and what it needs, from pyspark's jars/ (file names carry versions).
PYSPARK = [
    "arrow-vector", "arrow-memory-core", "arrow-memory-netty", "arrow-memory-netty-buffer-patch",
    "arrow-format", "flatbuffers-java", "jackson-annotations", "jackson-core", "jackson-databind",
    "slf4j-api",
]  # fmt: skip
# Arrow Java's allocator reads direct buffers' addresses.
JVM_FLAGS = ["--add-opens=java.base/java.nio=ALL-UNNAMED"]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class JavaClient:
    """The compiled client; `run` returns its exit status, stdout and stderr."""

    java: str
    classpath: str

    def run(self, *args: str, token: Optional[str] = None) -> "subprocess.CompletedProcess[str]":
        env = {key: value for key, value in os.environ.items() if key != "GPU_FLIGHT_TOKEN"}
        if token is not None:
            env["GPU_FLIGHT_TOKEN"] = token
        return subprocess.run(
            [self.java, *JVM_FLAGS, "-cp", self.classpath, "FlightJavaClient", *args],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip

    def ok(self, *args: str, token: Optional[str] = None) -> Any:
        """Runs the client, which must succeed; returns its last line of output, parsed as JSON."""
        done = self.run(*args, token=token)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def grpc_error(self, *args: str, token: Optional[str] = None) -> str:
        """Runs the client, which must fail with a gRPC error; returns its line."""
        done = self.run(*args, token=token)
        assert done.returncode == 2, (done.stdout, done.stderr)
        return next(line for line in done.stderr.splitlines() if line.startswith("grpc error: "))


def jar_paths() -> tuple[list[pathlib.Path], list[str]]:
    """The classpath's jars, and what is missing."""
    jars: list[pathlib.Path] = []
    missing: list[str] = []
    for name in DEBIAN:
        path = DEBIAN_JARS / f"{name}.jar"
        if path.is_file():
            jars.append(path)
        else:
            missing.append(str(path))
    spec = importlib.util.find_spec("pyspark")
    locations = [] if spec is None else list(spec.submodule_search_locations or [])
    if not locations:
        return jars, [*missing, "pyspark (its jars/ hold Arrow Java)"]
    pyspark_jars = pathlib.Path(locations[0]) / "jars"
    for name in PYSPARK:
        found = sorted(pyspark_jars.glob(f"{name}-[0-9]*.jar"))
        if found:
            jars.append(found[-1])
        else:
            missing.append(str(pyspark_jars / f"{name}-*.jar"))
    return jars, missing


@pytest.fixture(scope="session")
def java_client(tmp_path_factory: pytest.TempPathFactory) -> JavaClient:
    packages = {
        "java": "openjdk-17-jdk-headless",
        "javac": "openjdk-17-jdk-headless",
        "protoc": "protobuf-compiler",
    }
    tools = {name: shutil.which(name) for name in packages}
    missing = [f"{name} ({packages[name]})" for name, path in tools.items() if not path]
    if not os.access(GRPC_JAVA_PLUGIN, os.X_OK):
        missing.append(f"{GRPC_JAVA_PLUGIN} (protobuf-compiler-grpc-java-plugin)")
    if not (PROTO_INCLUDE / "google" / "protobuf" / "timestamp.proto").is_file():
        missing.append(f"{PROTO_INCLUDE}/google/protobuf/timestamp.proto (libprotobuf-dev)")
    jars, missing_jars = jar_paths()
    missing += missing_jars
    if missing:
        pytest.skip(f"the JVM client needs what tests/run-all.sh installs; missing: {', '.join(missing)}")

    build = tmp_path_factory.mktemp("java")
    generated, classes = build / "src", build / "classes"
    generated.mkdir()
    classes.mkdir()
    subprocess.run(
        [
            str(tools["protoc"]), f"--proto_path={JAVA_SOURCES / 'proto'}", f"--proto_path={PROTO_INCLUDE}",
            f"--plugin=protoc-gen-grpc-java={GRPC_JAVA_PLUGIN}", f"--java_out={generated}",
            f"--grpc-java_out={generated}", "Flight.proto",
        ],
        check=True,
    )  # fmt: skip
    classpath = os.pathsep.join(map(str, jars))
    sources = [*map(str, sorted(generated.rglob("*.java"))), str(JAVA_SOURCES / "FlightJavaClient.java")]
    subprocess.run(
        [str(tools["javac"]), "-nowarn", "-d", str(classes), "-cp", classpath, *sources], check=True
    )
    return JavaClient(str(tools["java"]), os.pathsep.join([classpath, str(classes)]))


@pytest.fixture(scope="module")
def endpoints_server() -> Iterator[Any]:
    """A server that lists one endpoint per 300 rows, so a read crosses several DoGet streams."""
    server = Server("--rows-per-endpoint", "300")
    yield server
    server.stop()


def source(n: int = 1000) -> pa.Table:
    start = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
    return pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "small": pa.array([i % 100 - 50 if i % 11 else None for i in range(n)], pa.int8()),
            "f": pa.array([i / 4 if i % 7 else None for i in range(n)], pa.float64()),
            "flag": pa.array([i % 3 == 0 if i % 13 else None for i in range(n)]),
            "s": pa.array([None if i % 5 == 0 else f"s{i}-é" * (i % 4) for i in range(n)]),
            "ls": pa.array([f"long {i}" if i % 9 else None for i in range(n)], pa.large_string()),
            "bin": pa.array([bytes([i % 256]) * (i % 5) if i % 6 else None for i in range(n)], pa.binary()),
            "day": pa.array([datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in range(n)]),
            "ts": pa.array(
                [start + datetime.timedelta(seconds=i) if i % 8 else None for i in range(n)],
                pa.timestamp("us", tz="UTC"),
            ),
            "dec": pa.array([decimal.Decimal(i) / 1000 for i in range(n)], pa.decimal128(12, 3)),
            "ints": pa.array(
                [[i, i + 1][: i % 3] if i % 10 else None for i in range(n)], pa.list_(pa.int32())
            ),
            "pair": pa.array(
                [{"a": i, "b": f"b{i}"} if i % 15 else None for i in range(n)],
                pa.struct([("a", pa.int32()), ("b", pa.string())]),
            ),
        }
    )


def pyarrow_put(client: Any, name: str, table: pa.Table, options: Any = None) -> None:
    writer, reader = client.do_put(flight.FlightDescriptor.for_path(name), table.schema, options=options)
    writer.write_table(table, max_chunksize=250)
    writer.done_writing()
    reader.read()
    writer.close()


def pyarrow_get(client: Any, name: str, options: Any = None) -> pa.Table:
    info = client.get_flight_info(flight.FlightDescriptor.for_path(name), options=options)
    return pa.concat_tables(client.do_get(e.ticket, options=options).read_all() for e in info.endpoints)


def test_java_reads_what_pyarrow_put(
    java_client: JavaClient, endpoints_server: Any, tmp_path: pathlib.Path
) -> None:
    table = source()
    name = unique("java-read")
    with endpoints_server.client() as client:
        pyarrow_put(client, name, table)
        endpoints = len(client.get_flight_info(flight.FlightDescriptor.for_path(name)).endpoints)
        seen = pyarrow_get(client, name)
    assert endpoints == 4

    out = tmp_path / "read.arrow"
    summary = java_client.ok("get", endpoints_server.location, name, str(out))
    assert summary["endpoints"] == endpoints and summary["rows"] == table.num_rows
    read = pa.ipc.open_file(out).read_all()
    assert read.schema.equals(seen.schema, check_metadata=True)
    assert read.equals(seen)
    assert read.equals(table)


def test_java_reads_messages_of_several_mib(
    java_client: JavaClient, server: Any, tmp_path: pathlib.Path
) -> None:
    # Messages of 1 MiB or more end in a padding field FlightData does not use (Java's reader
    # of FlightData is Arrow's own, not generated protobuf code).
    n = 400_000
    table = pa.table({f"c{c}": pa.array(range(c, c + n), pa.int64()) for c in range(2)})
    name = unique("java-large")
    with server.client() as client:
        writer, reader = client.do_put(flight.FlightDescriptor.for_path(name), table.schema)
        writer.write_table(table)
        writer.done_writing()
        reader.read()
        writer.close()
    out = tmp_path / "large.arrow"
    summary = java_client.ok("get", server.location, name, str(out))
    assert summary["rows"] == n
    assert pa.ipc.open_file(out).read_all().equals(table)


def test_java_puts_what_pyarrow_reads(
    java_client: JavaClient, endpoints_server: Any, tmp_path: pathlib.Path
) -> None:
    table = source(1234)
    file = tmp_path / "put.arrow"
    with pa.ipc.new_file(file, table.schema) as writer:
        writer.write_table(table, max_chunksize=400)  # four batches, four DoPut messages
    name = unique("java-put")

    summary = java_client.ok("put", endpoints_server.location, name, str(file))
    assert summary["name"] == name and summary["mode"] == "create" and summary["rows"] == table.num_rows
    with endpoints_server.client() as client:
        back = pyarrow_get(client, name)
    assert back.schema.equals(table.schema, check_metadata=True)
    assert back.equals(table)

    # A PATH descriptor means create, as with pyarrow: the name is taken now.
    error = java_client.grpc_error("put", endpoints_server.location, name, str(file))
    assert error.startswith("grpc error: ALREADY_EXISTS: "), error


def test_a_missing_dataset_is_not_found(java_client: JavaClient, server: Any, tmp_path: pathlib.Path) -> None:
    error = java_client.grpc_error("get", server.location, unique("absent"), str(tmp_path / "none.arrow"))
    assert error.startswith("grpc error: NOT_FOUND: ") and "does not exist" in error, error


def test_bearer_tokens_and_roles(
    java_client: JavaClient, make_server: Callable[..., Any], tmp_path: pathlib.Path
) -> None:
    writer_entry, writer = new_token("writer", "write")
    reader_entry, reader = new_token("reader", "read")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(writer_entry + "\n" + reader_entry)
    tokens.chmod(0o600)
    server = make_server("--auth-tokens", str(tokens))
    table = source(300)
    file = tmp_path / "in.arrow"
    with pa.ipc.new_file(file, table.schema) as out:
        out.write_table(table, max_chunksize=100)
    name = unique("java-token")

    assert java_client.ok("put", server.location, name, str(file), token=writer)["rows"] == 300
    read = tmp_path / "read.arrow"
    assert java_client.ok("get", server.location, name, str(read), token=reader)["rows"] == 300
    assert pa.ipc.open_file(read).read_all().equals(table)

    for token in (None, "made-up"):
        error = java_client.grpc_error("get", server.location, name, str(read), token=token)
        assert error.startswith("grpc error: UNAUTHENTICATED: "), error
    error = java_client.grpc_error("put", server.location, unique("refused"), str(file), token=reader)
    assert error.startswith("grpc error: PERMISSION_DENIED: ") and "write role" in error, error
