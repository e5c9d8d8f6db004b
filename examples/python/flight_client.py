"""One benchmark client process: the pyarrow.flight client of `throughput.py`, which starts N of
these at once, each on its own connection. Same protocol as `examples/flight_client.rs`:
prepare, print `ready`, wait for a line on standard input, transfer, print one JSON line with
`start`, `end` (Unix seconds), `bytes` (Arrow buffer bytes) and `rows`.

    python3 flight_client.py get --location grpc://127.0.0.1:8815 --name bench
    python3 flight_client.py put --location grpc+unix:///tmp/gf.sock --name put-3 --table strings --mib 512

With `--keep-freed-memory` (or `FLIGHT_CLIENT_KEEP_FREED_MEMORY=1`, which `throughput.py
--client-variants` can set), the client first calls `gpu_flight.keep_freed_memory()` (the
package in python/, installed or found beside this file).
"""

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight


def connect(location):
    # gRPC 1.57+ sends a Unix socket's path as the HTTP/2 authority, which gpu-flight's HTTP/2
    # library refuses; name one (the README says why).
    options = [("grpc.default_authority", "localhost")] if location.startswith("grpc+unix") else []
    return flight.connect(location, generic_options=options)


def make_table(kind, mib):
    """The tables the Rust client builds, in the same shapes and sizes."""
    if kind == "int64":
        rows = (mib << 20) // 64
        base = np.arange(rows, dtype=np.int64) * 8
        return pa.table({f"c{c}": base + c for c in range(8)})
    if kind == "strings":
        rows = (mib << 20) // 44
        pool = pa.array([format(i, f"0{16 + i % 33}d") for i in range(4096)])
        indices = pa.array(np.arange(rows, dtype=np.int64) % len(pool))
        return pa.table({"id": np.arange(rows, dtype=np.int64), "s": pool.take(indices)})
    raise SystemExit(f"unknown table {kind}")


def keep_freed_memory():
    try:
        import gpu_flight
    except ImportError:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python" / "src"))
        import gpu_flight
    if not gpu_flight.keep_freed_memory():
        raise SystemExit("keep_freed_memory: not applied (the C library is not glibc)")


def ready():
    print("ready", flush=True)
    sys.stdin.readline()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("op", choices=["get", "put"])
    parser.add_argument("--location", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--table", default="int64")
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--batch-rows", type=int, default=131_072)
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        default=os.environ.get("FLIGHT_CLIENT_KEEP_FREED_MEMORY") == "1",
    )
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()

    client = connect(args.location)
    if args.op == "get":
        client.wait_for_available()
        ready()
        start = time.time()
        reader = client.do_get(flight.Ticket(args.name.encode()))
        rows = nbytes = 0
        for chunk in reader:
            rows += chunk.data.num_rows
            nbytes += chunk.data.nbytes
    else:
        table = make_table(args.table, args.mib)
        client.wait_for_available()
        ready()
        start = time.time()
        writer, reader = client.do_put(flight.FlightDescriptor.for_path(args.name), table.schema)
        writer.write_table(table, max_chunksize=args.batch_rows)
        writer.done_writing()
        reader.read()
        writer.close()
        rows, nbytes = table.num_rows, table.nbytes
    print(json.dumps({"start": start, "end": time.time(), "bytes": nbytes, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
