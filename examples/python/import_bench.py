"""A co-located producer handing 8 int64 columns to the server through ipc-import
(`Client.put_device` of CuPy arrays: the server copies them device to device) against DoPut of
the same table from host memory, side by side in one run, median of N.

    gpu-flight serve --backend cuda --listen 127.0.0.1:8815 &
    python3 examples/python/import_bench.py --server grpc://127.0.0.1:8815 --gib 1 --repeat 7

put_device is timed from the call to its answer (the commit); the columns are on the device
and synchronized before the clock starts. DoPut sends the same values from host memory (a
pyarrow Table built once, outside the timing). Each round creates the dataset afresh (the
previous round's is dropped before the clock starts), so memory for one copy is held at a
time; `put_device_replace_ms_median` times the same import replacing the dataset instead,
which frees the replaced version's device memory inside the call. Prints one JSON line per
size.
"""

import argparse
import json
import statistics
import time

import cupy as cp
import gpu_flight
import numpy as np
import pyarrow as pa

COLUMNS = 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="grpc://127.0.0.1:8815")
    parser.add_argument("--gib", type=int, nargs="+", default=[1])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-doput", action="store_true", help="time put_device only")
    args = parser.parse_args()
    with gpu_flight.connect(args.server) as client:
        for gib in args.gib:
            rows = gib * (1 << 30) // (8 * COLUMNS)
            columns = {f"c{i}": cp.arange(rows, dtype=cp.int64) * (i + 1) for i in range(COLUMNS)}
            cp.cuda.Device().synchronize()
            imports, replacing = [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                result = client.put_device("import-bench", columns, mode="create")
                imports.append(time.perf_counter() - start)
                assert result.rows == rows
                start = time.perf_counter()
                client.put_device("import-bench", columns, mode="replace")
                replacing.append(time.perf_counter() - start)
                client.drop("import-bench")
            puts = []
            if not args.no_doput:
                host = pa.table({name: cp.asnumpy(column) for name, column in columns.items()})
                del columns
                for attempt in range(args.repeat):
                    if attempt:
                        client.drop("import-bench")
                    start = time.perf_counter()
                    client.put("import-bench", host, mode="create")
                    puts.append(time.perf_counter() - start)
                check = client.get("import-bench", columns=["c3"])["c3"].to_numpy()[:3]
                assert np.array_equal(check, np.array([0, 4, 8]))
            if puts:
                client.drop("import-bench")
            nbytes = rows * 8 * COLUMNS
            line = {
                "gib": gib,
                "rows": rows,
                "columns": COLUMNS,
                "repeat": args.repeat,
                "put_device_ms_median": round(statistics.median(imports) * 1e3, 3),
                "put_device_gbps": round(nbytes / statistics.median(imports) / 1e9, 1),
                "put_device_replace_ms_median": round(statistics.median(replacing) * 1e3, 3),
            }
            if puts:
                line["doput_ms_median"] = round(statistics.median(puts) * 1e3, 3)
                line["doput_gbps"] = round(nbytes / statistics.median(puts) / 1e9, 1)
                line["speedup"] = round(statistics.median(puts) / statistics.median(imports), 1)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
