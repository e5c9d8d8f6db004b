"""What pinning host memory at start costs the first clients: a CUDA server is started, and
as soon as it says it serves, a 1 MiB put is sent and timed; then the time until its pinned
memory is ready (`status`: `pinned_host_memory_pending_bytes` back at 0), and a second put.
Each server (every `--pinned` size, for `--server` and every `--compare` build) is started
`--repeat` times; the table shows every try.

    cargo build --release --bin gpu-flight
    python3 examples/python/startup_bench.py --pinned default,0,8GiB --compare /tmp/old-gpu-flight

`default` leaves `--pinned-host-memory` out (the server's default); the first put's time is
what a client that connects at once waits, pinning included.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.flight as flight

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def status(client):
    return json.loads(next(iter(client.do_action(flight.Action("status", b"")))).body.to_pybytes())


def timed_put(client, name, table):
    started = time.perf_counter()
    writer, _ = client.do_put(flight.FlightDescriptor.for_path(name), table.schema)
    writer.write_table(table)
    writer.close()
    return time.perf_counter() - started


def one_start(binary, backend, pinned, table):
    argv = [binary, "serve", "--backend", backend, "--listen", "127.0.0.1:0"]
    if pinned != "default":
        argv += ["--pinned-host-memory", pinned]
    started = time.perf_counter()
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = server.stdout.readline()
        serving = time.perf_counter() - started
        if "serving on" not in line:
            raise RuntimeError(f"{binary} said {line!r}")
        location = line.split("serving on ", 1)[1].split()[0]
        client = flight.connect(location)
        first = timed_put(client, "first", table)
        while status(client).get("counters", {}).get("pinned_host_memory_pending_bytes"):
            time.sleep(0.01)
        ready = time.perf_counter() - started
        pinned_bytes = status(client).get("counters", {}).get("pinned_host_memory_bytes", 0)
        second = timed_put(client, "second", table)
        client.close()
        return serving, first, ready, second, pinned_bytes
    finally:
        server.terminate()
        server.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=str(ROOT / "target" / "release" / "gpu-flight"))
    parser.add_argument("--compare", default="", help="other gpu-flight builds, comma-separated")
    parser.add_argument("--pinned", default="default,0", help="--pinned-host-memory values, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args()
    table = pa.table({"v": pa.array(range(1 << 17), type=pa.int64())})  # 1 MiB
    print(f"# {time.strftime('%Y-%m-%d')}: a 1 MiB put sent as soon as the server says it serves")
    print("| server | --pinned-host-memory | serving after, s | first put, ms | pinned memory ready after, s "
          "| pinned, GiB | second put, ms |")
    print("|" + " --- |" * 7, flush=True)
    for binary in [args.server] + [b for b in args.compare.split(",") if b]:
        for pinned in args.pinned.split(","):
            for _ in range(args.repeat):
                serving, first, ready, second, pinned_bytes = one_start(binary, args.backend, pinned, table)
                print(f"| {pathlib.Path(binary).name} | {pinned} | {serving:.3f} | {first * 1e3:.1f} | {ready:.3f} | "
                      f"{pinned_bytes / (1 << 30):.2f} | {second * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
