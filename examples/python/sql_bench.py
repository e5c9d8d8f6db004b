"""Flight SQL read throughput with N client processes, each on its own connection, against one
gpu-flight server: a plain DoGet of the whole dataset beside ADBC (adbc-driver-flightsql)
`SELECT *` and filtered `SELECT`s keeping about 1% and 50% of the rows, all in one run.

    cargo build --release --bin gpu-flight
    python3 examples/python/sql_bench.py --gib 1 --clients 1,4
    python3 examples/python/sql_bench.py --location grpc://127.0.0.1:8815 --server-pid 1234

It starts a server (`--server`, `--backend`) unless given `--location`, puts one dataset of
`--gib` GiB (8 int64 columns c0..c7 and a string column s; c1 is spread over 0..999,999 so that
`c1 < 10000` keeps 1% of the rows, scattered through every batch), then for each query and
client count starts the clients together: each reads the whole result in its own process,
spawned (never forked) and connected on its own. Figures are for all clients together, from the
first start to the last end, best of `--repeat`: result rows/s, result GB/s (1e9 Arrow bytes
of the batches received), the CPU cores each client process and the server kept busy, and the
server's CPU seconds per GB of result. The server's CPU is read from /proc, so it is known for a
server this script started or one given by `--server-pid`. Helpers and the client protocol
(prepare, print `ready`, wait for a line, read, print one JSON line) are throughput.py's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, Optional

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Integers of c1 are below this; a query keeping fraction f asks for c1 < f * SPREAD.
SPREAD = 1_000_000
BATCH_ROWS = 131_072
# Bytes a row takes: eight int64s, and a string of 16..48 characters (32 on average) with its
# 4-byte offset.
ROW_BYTES = 8 * 8 + 32 + 4


def queries(name: str) -> list[tuple[str, Optional[str]]]:
    """(label, SQL) of each measured read; no SQL for the plain DoGet."""
    table = f'"{name}"'
    return [
        ("DoGet (whole dataset)", None),
        ("ADBC SELECT *", f"SELECT * FROM {table}"),
        ("ADBC WHERE c1 < 1% (all columns)", f"SELECT * FROM {table} WHERE c1 < {SPREAD // 100}"),
        ("ADBC WHERE c1 < 50% (all columns)", f"SELECT * FROM {table} WHERE c1 < {SPREAD // 2}"),
    ]


# The client processes: `sql_bench.py put|select|drop ...`, started by `main`.


def make_batches(gib: float) -> Iterator[Any]:
    """The dataset's record batches, made as they are sent."""
    import numpy as np
    import pyarrow as pa

    rows = int(gib * (1 << 30)) // ROW_BYTES
    pool = pa.array([format(i, f"0{16 + i % 33}d") for i in range(4096)])
    for start in range(0, rows, BATCH_ROWS):
        index = np.arange(start, min(start + BATCH_ROWS, rows), dtype=np.int64)
        columns = {f"c{c}": index * 8 + c for c in range(8)}
        columns["c1"] = (index * 2_654_435_761) % SPREAD
        columns["s"] = pool.take(pa.array(index % len(pool)))
        yield pa.record_batch(columns)


def put(location: str, name: str, gib: float) -> None:
    import pyarrow.flight as flight
    from flight_client import connect  # beside this script

    batches = make_batches(gib)
    first = next(batches)
    command = json.dumps({"name": name, "mode": "replace"})
    with connect(location) as client:
        writer, reader = client.do_put(flight.FlightDescriptor.for_command(command), first.schema)
        rows = nbytes = 0
        for batch in [first, *batches]:
            writer.write_batch(batch)
            rows, nbytes = rows + batch.num_rows, nbytes + batch.nbytes
        writer.done_writing()
        reader.read()
        writer.close()
    print(json.dumps({"rows": rows, "bytes": nbytes, "columns": len(first.schema)}))


def select(location: str, sql: str) -> None:
    """One client of `throughput.run_together`: reads every batch of `sql`'s result."""
    import adbc_driver_flightsql.dbapi as flight_sql

    with flight_sql.connect(location, autocommit=True) as connection, connection.cursor() as cursor:
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.time()
        cursor.execute(sql)
        rows = nbytes = 0
        for batch in cursor.fetch_record_batch():
            rows += batch.num_rows
            nbytes += batch.nbytes
        end = time.time()
    print(json.dumps({"start": start, "end": end, "bytes": nbytes, "rows": rows}), flush=True)


def drop(location: str, name: str) -> None:
    import pyarrow.flight as flight
    from flight_client import connect

    with connect(location) as client:
        list(client.do_action(flight.Action("drop", json.dumps({"name": name}).encode())))


# The benchmark.


def client_argv(location: str, name: str, sql: Optional[str]) -> list[str]:
    if sql is None:
        return [sys.executable, str(HERE / "flight_client.py"), "get", "--location", location, "--name", name]
    return [sys.executable, str(HERE / "sql_bench.py"), "select", "--location", location, "--sql", sql]


def one_report(argv: list[str]) -> dict[str, Any]:
    """Runs one client alone (untimed: it warms the server and says what one client reads)."""
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate("go\n", timeout=600)
    lines = out.splitlines()
    if process.returncode != 0 or len(lines) != 2 or lines[0] != "ready":
        raise RuntimeError(f"a client failed ({process.returncode}): {out!r}")
    report: dict[str, Any] = json.loads(lines[1])
    return report


def figure(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def measure(args: argparse.Namespace, location: str, server_pid: int) -> None:
    import throughput  # beside this script: its clients' protocol, timing and /proc helpers

    clients = [int(n) for n in args.clients.split(",")]
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / "sql_bench.py"),
            "put",
            "--location",
            location,
            "--name",
            args.name,
            "--gib",
            str(args.gib),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    dataset = json.loads(done.stdout)
    print(
        f"# {time.strftime('%Y-%m-%d')}, {location}, dataset {args.name}: {dataset['rows']:,} rows, "
        f"{dataset['bytes'] / 1e9:.2f} GB of Arrow, {dataset['columns']} columns (8 int64, 1 string); "
        f"best of {args.repeat}; GB/s = 1e9 Arrow bytes of result per second, all clients together",
        flush=True,
    )
    print(
        "| read | clients | result rows each | rows/s | GB/s | CPU cores: each client / server "
        "| server CPU s/GB |"
    )
    print("|" + " --- |" * 7)
    try:
        for label, sql in queries(args.name):
            argv = client_argv(location, args.name, sql)
            alone = one_report(argv)
            rows_per_byte = alone["rows"] / alone["bytes"] if alone["bytes"] else 0.0
            for n in clients:
                rate = throughput.best(
                    args, functools.partial(throughput.run_together, [argv] * n, server_pid)
                )
                rows_per_second = float(rate) * 1e9 * rows_per_byte
                print(
                    f"| {label} | {n} | {alone['rows']:,} | {rows_per_second:,.0f} | {float(rate):.3f} "
                    f"| {rate.client_cores:.2f} / {figure(rate.server_cores, 1)} "
                    f"| {figure(rate.server_cores / float(rate))} |",
                    flush=True,
                )
    finally:
        drop(location, args.name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "role", nargs="?", choices=["bench", "put", "select", "drop"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--location", help="a running server's grpc:// URI (default: start one)")
    parser.add_argument("--server-pid", type=int, help="the running server's process id, for its CPU time")
    parser.add_argument("--server", default=str(ROOT / "target" / "release" / "gpu-flight"))
    parser.add_argument("--backend", default="host", help="the backend of the server started (host, cuda)")
    parser.add_argument("--gib", type=float, default=1.0, help="the dataset's size in GiB of Arrow data")
    parser.add_argument("--clients", default="1,4", help="client counts, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--name", default="sql-bench")
    parser.add_argument("--sql", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.role == "put":
        put(args.location, args.name, args.gib)
    elif args.role == "select":
        select(args.location, args.sql)
    elif args.role == "drop":
        drop(args.location, args.name)
    elif args.location:
        measure(args, args.location, args.server_pid or 0)  # no /proc/0: CPU figures are "-"
    else:
        import throughput

        # The server logs each call at info; its warnings are what matters beside the figures.
        os.environ.setdefault("RUST_LOG", "warn")
        server = throughput.Process(
            [
                args.server,
                "serve",
                "--backend",
                args.backend,
                "--listen",
                "127.0.0.1:0",
                "--max-put-message-bytes",
                "2GiB",
            ],
            r"serving on (grpc://\S+) \(backend: (\w+)\)",
        )
        try:
            if server.match.group(2) != args.backend:
                raise SystemExit(f"asked for backend {args.backend}, got {server.match.group(2)}")
            measure(args, server.match.group(1), server.process.pid)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
