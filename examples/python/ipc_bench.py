"""A co-located consumer obtaining a dataset through ipc-export (export + opening every handle)
against DoGet of the same dataset, at 1 GiB and 10 GiB of 8 int64 columns.

    gpu-flight serve --backend cuda --listen 127.0.0.1:8815 &
    python3 examples/python/ipc_bench.py --server grpc://127.0.0.1:8815 --gib 1 10

IPC time is export + open (the handles are mapped and usable after it); "export" is the
ipc-export round trip alone; close (unmap + ipc-release) is timed separately. DoGet streams every batch to this process and drops it.

Across GPUs: `--put-device 0 --consumer-device 1` puts the dataset on the server's device 0
and maps it from this process's GPU 1 (peer access); add `--copy` to have the server copy it
onto GPU 1 for each lease instead.
"""

import argparse
import json
import statistics
import time

import cupy as cp
import gpu_flight
import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

COLUMNS = 8
CHUNK_ROWS = 1 << 20  # 64 MiB per batch of 8 int64 columns


def put_dataset(client, name, gib, device=None):
    rows = gib * (1 << 30) // (8 * COLUMNS)
    schema = pa.schema([(f"c{i}", pa.int64()) for i in range(COLUMNS)])

    def batches():
        for start in range(0, rows, CHUNK_ROWS):
            base = np.arange(start, start + min(CHUNK_ROWS, rows - start), dtype=np.int64)
            yield pa.record_batch([base * (i + 1) for i in range(COLUMNS)], schema=schema)

    client.put(name, pa.RecordBatchReader.from_batches(schema, batches()), mode="replace", device=device)
    return rows


def action(client, name, body):
    raw = client.flight_client
    results = list(raw.do_action(flight.Action(name, json.dumps(body).encode()), options=client.call_options))
    return json.loads(results[0].body.to_pybytes())


def time_export_action(client, name, repeat, consumer):
    """The ipc-export round trip alone (no handle opened), released right after."""
    body = {"name": name, "version": 2, **consumer}
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        document = action(client, "ipc-export", body)
        times.append(time.perf_counter() - started)
        action(client, "ipc-release", {"lease": document["lease"]})
    return times


def time_ipc(client, name, repeat, device, copy):
    opens, closes = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        exported = client.export(name, device=device, copy=copy)
        opened = time.perf_counter()
        exported.close()
        closed = time.perf_counter()
        opens.append(opened - started)
        closes.append(closed - opened)
    with client.export(name, device=device, copy=copy) as exported:  # the mapped bytes are the data
        last = cp.asarray(exported.partitions[-1]["c7"])[-1].item()
        handles = len({c["handle"] for p in exported.document["partitions"] for c in p["columns"]})
        access = ",".join(p.access for p in exported.partitions)
    return opens, closes, last, handles, access


def time_do_get(client, name, repeat):
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        rows = sum(batch.num_rows for batch in client.reader(name))
        best = min(best, time.perf_counter() - started)
    return best, rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="grpc://127.0.0.1:8815")
    parser.add_argument("--gib", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--get-repeat", type=int, default=2)
    parser.add_argument("--put-device", type=int, help="the server's device to put the dataset on")
    parser.add_argument("--consumer-device", type=int, help="this process's GPU (its CUDA ordinal)")
    parser.add_argument("--copy", action="store_true", help="replicate onto the consumer's GPU per lease")
    args = parser.parse_args()
    consumer = {}
    if args.consumer_device is not None:
        consumer = {"device": gpu_flight.device_uuid(args.consumer_device), "copy": args.copy}
    client = gpu_flight.connect(args.server)
    print(f"{COLUMNS} int64 columns; IPC = ipc-export + opening every handle (median / best of {args.repeat})")
    print(f"put on server device {args.put_device}; consumer on GPU {args.consumer_device}; copy {args.copy}")
    print(
        f"{'size':>6} {'handles':>8} {'IPC ms':>16} {'(export ms)':>12} {'close ms':>9}"
        f" {'DoGet s':>8} {'DoGet GB/s':>11} {'speedup':>9}"
    )
    for gib in args.gib:
        name = f"ipc-bench-{gib}g"
        rows = put_dataset(client, name, gib, args.put_device)
        opens, closes, last, handles, access = time_ipc(client, name, args.repeat, args.consumer_device, args.copy)
        export_only = statistics.median(time_export_action(client, name, args.repeat, consumer))
        assert last == (rows - 1) * COLUMNS, "the mapped memory holds the data"
        get_s, got_rows = time_do_get(client, name, args.get_repeat)
        assert got_rows == rows
        ipc_median = statistics.median(opens)
        nbytes = rows * 8 * COLUMNS
        print(
            f"{gib:>4} GiB {handles:>8} {ipc_median * 1e3:>8.3f} / {min(opens) * 1e3:<6.3f}"
            f" {export_only * 1e3:>12.3f} {statistics.median(closes) * 1e3:>9.3f} {get_s:>8.2f} {nbytes / get_s / 1e9:>11.2f}"
            f" {get_s / ipc_median:>8.0f}x  ({access})"
        )
        client.drop(name)


if __name__ == "__main__":
    main()
