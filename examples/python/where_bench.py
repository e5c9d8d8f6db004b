"""Filtered reads (a read command's "where", as Flight SQL statements filter) with the filter
run where the rows live against the same filter run on the host after the rows were copied
there: two servers of one build in one run (the hidden `--filter-on device|host` flag), the
same table in each, read by this process, one stream at a time.

    cargo build --release --bin gpu-flight
    python3 examples/python/where_bench.py --backend cuda --gib 1

The table is 8 int64 columns; `c0` holds the row number, so `c0 < N` keeps the first N rows
and `c0 % K` is never asked (only comparisons are). Each predicate keeps the fraction given
(`--keep`, spread over the whole table with `c1`, a permutation of the rows). A figure is the
median seconds of `--repeat` reads of every endpoint, the rows kept, and the bytes the backend
copied from its device to host memory meanwhile (the cuda backend's `read_bytes` counter), beside
a plain read of the whole table on the same server.
"""

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import time

import numpy as np
import pyarrow as pa
from pyarrow import flight

ROOT = pathlib.Path(__file__).resolve().parents[2]
COLUMNS = 8
CHUNK_ROWS = 1 << 20


def start(binary: str, backend: str, filter_on: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            binary,
            "serve",
            "--backend",
            backend,
            "--listen",
            "127.0.0.1:0",
            "--filter-on",
            filter_on,
            "--max-put-message-bytes",
            "2GiB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = process.stdout.readline()
    match = re.search(r"serving on (grpc://\S+) \(backend: (\w+)\)", line)
    if not match or match.group(2) != backend:
        process.terminate()
        raise SystemExit(f"the server said {line!r}")
    return process, match.group(1)


def put(client: flight.FlightClient, rows: int) -> None:
    schema = pa.schema([(f"c{i}", pa.int64()) for i in range(COLUMNS)])
    # c1: a permutation of the rows, so a threshold on it keeps rows spread over every chunk.
    permutation = np.random.default_rng(27).permutation(rows).astype(np.int64)
    descriptor = flight.FlightDescriptor.for_command(
        json.dumps({"name": "t", "mode": "replace"})
    )
    writer, _ = client.do_put(descriptor, schema)
    for start_row in range(0, rows, CHUNK_ROWS):
        end = min(start_row + CHUNK_ROWS, rows)
        base = np.arange(start_row, end, dtype=np.int64)
        columns = [base, permutation[start_row:end]] + [
            base * (i + 1) for i in range(2, COLUMNS)
        ]
        writer.write_batch(pa.record_batch(columns, schema=schema))
    writer.close()


def counters(client: flight.FlightClient) -> dict:
    result = next(client.do_action(flight.Action("status", b"{}")))
    return json.loads(result.body.to_pybytes()).get("counters", {})


def read(client: flight.FlightClient, where: str | None) -> tuple[float, int, int]:
    """Seconds, rows and device-to-host bytes of one read of every endpoint."""
    command = {"name": "t"} | ({"where": where} if where else {})
    before = counters(client)
    began = time.perf_counter()
    info = client.get_flight_info(
        flight.FlightDescriptor.for_command(json.dumps(command))
    )
    rows = 0
    for endpoint in info.endpoints:
        for chunk in client.do_get(endpoint.ticket):
            rows += chunk.data.num_rows
    seconds = time.perf_counter() - began
    after = counters(client)
    # A "device" figure measured on the host path would be a lie: say so.
    if after.get("filter_fallbacks", 0) != before.get("filter_fallbacks", 0):
        print(f"# warning: {where!r} fell back to host filtering on some chunks")
    return seconds, rows, after.get("read_bytes", 0) - before.get("read_bytes", 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--server", default=str(ROOT / "target" / "release" / "gpu-flight")
    )
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--keep", default="0.001,0.01,0.1,0.5")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows = int(args.gib * (1 << 30)) // (8 * COLUMNS)
    servers = {on: start(args.server, args.backend, on) for on in ("device", "host")}
    try:
        clients = {
            on: flight.connect(location) for on, (_, location) in servers.items()
        }
        for client in clients.values():
            put(client, rows)
            read(client, None)  # warms the server's staging buffers
        print(
            f"# {time.strftime('%Y-%m-%d')}, backend {args.backend}, {rows:,} rows x {COLUMNS} int64 "
            f"({rows * 8 * COLUMNS / 1e9:.2f} GB), median of {args.repeat}; server {args.server}"
        )
        print(
            "| read | rows kept | filter on device: s | D2H GB | filter on host: s | D2H GB | host s / device s |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        cases = [("plain read", None)] + [
            (
                f"c1 < {int(rows * float(k))} (keeps {float(k):g})",
                f"c1 < {int(rows * float(k))}",
            )
            for k in args.keep.split(",")
        ]
        for label, where in cases:
            cells, medians = [], []
            # Interleaved, so that neither server has the machine to itself.
            runs: dict[str, list[tuple[float, int, int]]] = {"device": [], "host": []}
            for _ in range(args.repeat):
                for on in ("device", "host"):
                    runs[on].append(read(clients[on], where))
            for on in ("device", "host"):
                seconds = statistics.median(r[0] for r in runs[on])
                kept, copied = runs[on][-1][1], runs[on][-1][2]
                medians.append(seconds)
                cells.append(f"{seconds:.4f} | {copied / 1e9:.3f}")
            print(
                f"| {label} | {kept:,} | {cells[0]} | {cells[1]} | {medians[1] / medians[0]:.2f} |",
                flush=True,
            )
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
