"""Shared-memory reads against DoGet: a dataset of 8 int64 columns made visible to a co-located
pyarrow process as a Table, by `Client.read_shared` (shm-read: staged once into sealed memory
files, several written at once, mapped without a copy) and by `Client.get` (DoGet over gRPC),
from the same server in the same run. `--shm-writers N` sets how many files a read is written as
at most (the server's hidden flag; default: half its CPUs, at most 8). Each read runs in a fresh
process (spawned, never forked after gRPC started), timed
from the request to the Table in hand; the figure is the median of `--runs`.

    python examples/python/shm_bench.py --binary target/release/gpu-flight --gib 1 --runs 5
    python examples/python/shm_bench.py --binary target/release/gpu-flight --backend cuda --gib 1

Prints one JSON object: sizes, each way's times and rate, and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import gpu_flight

COLUMNS = 8


def read_once(location: str, name: str, way: str, results: Any) -> None:
    """In a fresh process: one read, timed; the Table's rows are checked, not copied."""
    with gpu_flight.connect(location) as client:
        started = time.perf_counter()
        table = client.read_shared(name) if way == "shm" else client.get(name)
        seconds = time.perf_counter() - started
        results.put((seconds, table.num_rows, table.nbytes))


def measure(context: Any, location: str, name: str, way: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        results = context.Queue()
        process = context.Process(target=read_once, args=(location, name, way, results))
        process.start()
        seconds, _rows, _nbytes = results.get(timeout=600)
        process.join()
        times.append(seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default="target/release/gpu-flight")
    parser.add_argument("--backend", default="host")
    parser.add_argument("--gib", type=float, default=1.0, help="dataset size in GiB")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--shm-writers", type=int, default=None, help="files a read is written as at most")
    args = parser.parse_args()
    writers = [] if args.shm_writers is None else ["--shm-writers", str(args.shm_writers)]

    rows = int(args.gib * (1 << 30)) // (8 * COLUMNS)
    with tempfile.TemporaryDirectory() as scratch:
        socket = str(Path(scratch) / "shm.sock")
        server = subprocess.Popen(
            [args.binary, "serve", "--listen", "127.0.0.1:0", "--backend", args.backend, "--shm-socket", socket]
            + writers,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert server.stdout is not None
            match = re.search(r"serving on (grpc://\S+)", server.stdout.readline())
            if not match:
                raise RuntimeError("the server did not start")
            location = match.group(1)
            context = multiprocessing.get_context("spawn")
            name = "shm-bench"
            # The put runs in a spawned process too: this one never holds a gRPC channel.
            putter = context.Process(target=put, args=(location, name, rows))
            putter.start()
            putter.join()
            if putter.exitcode != 0:
                raise RuntimeError("the put failed")
            doget = measure(context, location, name, "doget", args.runs)
            shm = measure(context, location, name, "shm", args.runs)
        finally:
            server.terminate()
            server.wait(timeout=60)
    nbytes = rows * 8 * COLUMNS
    result = {
        "backend": args.backend,
        "rows": rows,
        "columns": COLUMNS,
        "bytes": nbytes,
        "runs": args.runs,
        "shm_writers": args.shm_writers or "default",
        "cpus": os.cpu_count(),
        "doget_seconds": doget,
        "shm_seconds": shm,
        "doget_median_s": statistics.median(doget),
        "shm_median_s": statistics.median(shm),
        "doget_gb_per_s": nbytes / statistics.median(doget) / 1e9,
        "shm_gb_per_s": nbytes / statistics.median(shm) / 1e9,
        "speedup": statistics.median(doget) / statistics.median(shm),
    }
    json.dump(result, sys.stdout, indent=2)
    print()


def put(location: str, name: str, rows: int) -> None:
    step = 1 << 20
    schema = pa.schema([(f"c{i}", pa.int64()) for i in range(COLUMNS)])

    def batches() -> Any:
        for start in range(0, rows, step):
            n = min(step, rows - start)
            base = np.arange(start, start + n, dtype=np.int64)
            yield pa.record_batch([base + i for i in range(COLUMNS)], schema=schema)

    with gpu_flight.connect(location) as client:
        client.put(name, pa.RecordBatchReader.from_batches(schema, batches()), mode="replace")


if __name__ == "__main__":
    main()
