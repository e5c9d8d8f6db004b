"""DoGet and DoPut throughput with N client processes, each on its own connection, against
gpu-flight (each backend asked for, over TCP and a Unix socket) and a plain pyarrow.flight
server (examples/pyarrow_server.py), beside the raw-socket ceiling for the same N: all in one
run, on one machine.

    cargo build --release --bin gpu-flight --example flight_client
    python3 examples/python/throughput.py --backends host,cuda --clients 1,4,8,16 --mib 1024

Each client process (examples/python/flight_client.py for pyarrow, `--client rust` for
target/release/examples/flight_client) prepares, then all start together; a figure is the
Arrow bytes all clients moved divided by the time from the first start to the last end, in
GB/s (1e9 bytes), best of `--repeat`. DoGet: every client reads the whole dataset (`--mib`) in
one stream. DoPut: every client puts its own table of `--mib`. The raw ceiling moves `--mib`
per connection through a bare socket (one write and one read copy, no framing): the most any
server could do with these clients. The CPU columns are what each client process and the
server kept busy during the best run, in cores (from /proc): a client near 1.0 is its own
limit, whatever the server does. "clients CPU s/GB" is what all the clients together spent per
GB: on a machine whose cores the clients and the server fill, a server that makes its clients'
work dearer (smaller messages, for pyarrow's client) is slower for it. Nothing else should run
on the machine meanwhile.

`--doget-encoders framed,plain` starts one server per DoGet encoder (the hidden
`--doget-encoder` flag: `framed`, the server's own framing that hands the socket the Arrow
buffers without copying them, and `plain`, arrow-flight's encoder through the generated server),
so one run measures both side by side; puts go to the first encoder's server only. The
"server CPU s/GB" column is the CPU seconds each server spent per GB moved in the best run.

    python3 examples/python/throughput.py --backends host,cuda --clients 8,16 --mib 1024 \
        --ops get --doget-encoders framed,plain

`--server-variants` starts one server per backend and variant, the variants differing only in
extra flags (the hidden tuning flags: `--h2-max-frame-bytes`, `--h2-stream-window-bytes`,
`--h2-connection-window-bytes`, `--h2-adaptive-window`, `--read-chunk-bytes`,
`--read-prefetch`, `--doget-encode-ahead`, `--put-pipeline-depth`) and leading `NAME=value`
environment settings (`TOKIO_WORKER_THREADS=8`), so that one run A/Bs them all:

    python3 examples/python/throughput.py --backends host,cuda --clients 8,16 --mib 1024 \
        --server-variants 'base=;prefetch4=--read-prefetch 4;w8=TOKIO_WORKER_THREADS=8'

`--client-variants` measures every row once per variant, its clients (pyarrow's and ours
alike) started with extra environment settings, each labelled `[NAME]` and compared with
pyarrow's server read or written by the same clients: what a client-side setting is worth.
pyarrow readers spend much of their CPU on glibc's malloc handing each message's memory back to
the kernel and faulting it in again (README, Clients):

    python3 examples/python/throughput.py --backends host,cuda --clients 8 --mib 1024 --ops get \
        --client-variants 'default=;kept=GLIBC_TUNABLES=glibc.malloc.trim_threshold=4294967295:glibc.malloc.mmap_threshold=33554432'

Every server is a row of its own: GB/s, and its ratio to pyarrow's; the CPU cores each client
and the server kept busy; the server's CPU seconds per GB, and their ratio to pyarrow's; and,
for gpu-flight, where its streams' time went per GB (the `stages` of its `status`: for DoGet
waiting for the backend's chunks, encoding, waiting for the client; for DoPut waiting for the
client's messages, decoding, uploading), summed over the streams, in seconds per GB; for DoPut on
the cuda backend also how its uploads split (`upload_allocate`: device memory, `upload_fill`: the
CPU copy into staging, `upload_copy`: the copy to the GPU), summed over the uploads.
"""

import argparse
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import pyarrow.flight as flight
from flight_client import connect  # beside this script

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class Process:
    """A child that announces itself on its first line of standard output."""

    def __init__(self, argv, pattern, env=None):
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, **env} if env else None)
        line = self.process.stdout.readline()
        match = re.search(pattern, line)
        if not match:
            self.stop()
            raise RuntimeError(f"{argv[0]} said {line!r}, expected {pattern!r}")
        self.match = match

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def client_argv(kind, op, location, name, args, table):
    if kind == "rust":
        argv = [str(args.rust_client), op, "--location", location, "--name", name]
        if op == "put":
            argv += ["--table", table, "--mib", str(args.mib)]
        return argv
    argv = [sys.executable, str(HERE / "flight_client.py"), op, "--location", location, "--name", name]
    return argv + ["--table", table, "--mib", str(args.mib)]


def cpu_seconds(pid):
    """User plus system CPU time of a process, also after it exited if not yet reaped."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Rate(float):
    """GB/s, with the CPU cores busy meanwhile: per client process, and in the server."""

    def __new__(cls, rate, client_cores, server_cores):
        self = super().__new__(cls, rate)
        self.client_cores, self.server_cores = client_cores, server_cores
        return self


def run_together(argvs, server_pid, probe=None, env=None):
    """Starts every process (with `env` added to their environment), waits until all are ready,
    says go, and returns the aggregate GB/s from their reports, with the CPU the clients and the
    server used meanwhile and, given a `probe` (a function returning a dict of counters), how
    much each counter grew per GB."""
    environment = {**os.environ, **(env or {})}
    processes = [subprocess.Popen(a, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment)
                 for a in argvs]
    try:
        for p in processes:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a client said {line!r} instead of ready: {' '.join(argvs[0])}")
        counted = probe() if probe else {}
        client_cpu = [cpu_seconds(p.pid) for p in processes]
        server_cpu = cpu_seconds(server_pid)
        for p in processes:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for i, p in enumerate(processes):
            line = p.stdout.readline()
            client_cpu[i] = cpu_seconds(p.pid) - client_cpu[i]  # read before reaping
            if p.wait(timeout=600) != 0 or not line:
                raise RuntimeError(f"a client failed: {' '.join(argvs[0])}")
            reports.append(json.loads(line))
        server_cpu = cpu_seconds(server_pid) - server_cpu
        if probe:
            counted = {k: v - counted.get(k, 0) for k, v in probe().items()}
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    gb = sum(r["bytes"] for r in reports) / 1e9
    rate = Rate(gb / seconds, sum(client_cpu) / seconds / len(processes), server_cpu / seconds)
    rate.per_gb = {k: v / gb for k, v in counted.items()}
    return rate


STAGES = {"get": ("doget", ["staging", "encode", "send_wait"]),
          "put": ("put", ["receive_wait", "decode", "upload"])}
# The cuda backend's own split of an upload (its `status` counters, in ns, summed over GPUs):
# waiting for device memory, the CPU copy into staging, the copy to the device.
UPLOAD_PARTS = {"allocate": "upload_allocate_ns", "fill": "upload_fill_ns", "copy": "upload_copy_ns"}


def stage_probe(location, op):
    """Reads the stage seconds of `op` from a gpu-flight server's `status`, and for puts on
    the cuda backend how its uploads split."""
    key, names = STAGES[op]

    def probe():
        with connect(location) as client:
            document = json.loads(next(iter(client.do_action(flight.Action("status", b"")))).body.to_pybytes())
        stages = document.get("stages", {}).get(key, {})
        figures = {name: stages.get(f"{name}_seconds", float("nan")) for name in names}
        counters = document.get("counters", {})
        if op == "put" and document.get("backend") == "cuda":
            for name, counter in UPLOAD_PARTS.items():
                figures[f"upload_{name}"] = sum(v for k, v in counters.items()
                                                if k == counter or k.endswith(f"_{counter}")) / 1e9
        return figures
    return probe


def wait_for_pinned_memory(location, seconds=30.0):
    """Waits until a cuda server has pinned its host memory (`--pinned-host-memory`, pinned in
    the background at start, a core busy meanwhile), so that no measurement shares the machine
    with it; returns at once for a server that pins none."""
    deadline = time.time() + seconds
    with connect(location) as client:
        while time.time() < deadline:
            document = json.loads(next(iter(client.do_action(flight.Action("status", b"")))).body.to_pybytes())
            if not document.get("counters", {}).get("pinned_host_memory_pending_bytes"):
                return
            time.sleep(0.1)


def best(args, measure):
    return max((measure() for _ in range(args.repeat)), key=float)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="host", help="gpu-flight backends, comma-separated (host, cuda)")
    parser.add_argument("--clients", default="1,4,8,16", help="client counts, comma-separated")
    parser.add_argument("--tables", default="int64,strings")
    parser.add_argument("--ops", default="get,put")
    parser.add_argument("--mib", type=int, default=512, help="MiB each client moves")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--client", choices=["python", "rust"], default="python")
    parser.add_argument("--no-uds", action="store_true", help="skip gpu-flight over a Unix socket")
    parser.add_argument("--doget-encoders", default="framed",
                        help="DoGet encoders, comma-separated (framed, plain): one server each")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the raw-socket ceiling (it needs the Rust client, --rust-client)")
    parser.add_argument("--server", default=str(ROOT / "target" / "release" / "gpu-flight"))
    parser.add_argument("--rust-client", default=str(ROOT / "target" / "release" / "examples" / "flight_client"))
    parser.add_argument("--server-args", default="", help="more gpu-flight flags, e.g. '--max-message-bytes 8MiB'")
    parser.add_argument("--server-variants", default="", metavar="NAME=FLAGS[;NAME=FLAGS...]",
                        help="one server per backend and variant, each with these extra flags (and leading "
                             "VAR=value environment settings), e.g. 'base=;big=--h2-max-frame-bytes 4MiB'")
    parser.add_argument("--client-variants", default="", metavar="NAME=[VAR=value ...][;...]",
                        help="measure every row once per variant, its clients started with these environment "
                             "settings, e.g. 'default=;tuned=GLIBC_TUNABLES=glibc.malloc.trim_threshold=4294967295'; "
                             "each row's ratios are to pyarrow's with the same clients")
    parser.add_argument("--compare", metavar="BINARY[,BINARY...]", default="",
                        help="other gpu-flight builds (e.g. an earlier commit's) to run beside --server, "
                             "TCP only, each labelled with its file name")
    args = parser.parse_args()
    clients = [int(n) for n in args.clients.split(",")]
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="gpu-flight-bench-"))

    encoders = args.doget_encoders.split(",")
    variants = [v.split("=", 1) for v in args.server_variants.split(";") if v.strip()] or [["", ""]]
    client_variants = [(name.strip(), settings(flags)) for name, _, flags in
                       (v.partition("=") for v in args.client_variants.split(";") if v.strip())] or [("", {})]
    # targets: (label, location, is gpu-flight, server pid, takes puts)
    servers, targets = [], []
    try:
        # (label suffix, binary, encoder, extra argv, extra environment, takes puts)
        builds = []
        for name, flags in variants:
            env, extra = {}, shlex.split(flags)
            while extra and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", extra[0]):
                key, value = extra.pop(0).split("=", 1)
                env[key] = value
            for encoder in encoders:
                suffix = (f" {name.strip()}" if name.strip() else "") + (f" {encoder}" if len(encoders) > 1 else "")
                builds.append((suffix, args.server, encoder, extra, env, encoder == encoders[0]))
        builds += [(f" ({pathlib.Path(b).name})", b, None, [], {}, True) for b in args.compare.split(",") if b]
        for backend in args.backends.split(","):
            for suffix, binary, encoder, extra, env, puts in builds:
                sock = scratch / f"{backend}{len(servers)}.sock"
                chosen = ["--doget-encoder", encoder] if encoder else []
                server = Process([binary, "serve", "--backend", backend, "--listen", "127.0.0.1:0",
                                  "--listen", f"unix://{sock}", "--max-put-message-bytes", "2GiB",
                                  *chosen, *shlex.split(args.server_args), *extra],
                                 r"serving on (grpc://\S+) \(backend: (\w+)\)", env=env)
                if server.match.group(2) != backend:
                    raise SystemExit(f"asked for backend {backend}, got {server.match.group(2)}")
                servers.append(server)
                targets.append((f"gpu-flight {backend}{suffix}", server.match.group(1), True, server.process.pid,
                                puts))
                if not args.no_uds and encoder == encoders[0] and suffix == builds[0][0]:
                    targets.append((f"gpu-flight {backend}{suffix} uds", f"grpc+unix://{sock}", True,
                                    server.process.pid, True))
        for label, location, ours, _, _ in targets:
            if ours and "cuda" in label:
                wait_for_pinned_memory(location)
        baseline = Process([sys.executable, str(ROOT / "examples" / "pyarrow_server.py")], r"serving on (grpc://\S+)")
        servers.append(baseline)
        targets.append(("pyarrow", baseline.match.group(1), False, baseline.process.pid, True))

        print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {args.client} clients, "
              f"{args.mib} MiB per client, best of {args.repeat}; GB/s = 1e9 Arrow bytes/s; "
              f"server {args.server} {args.server_args}".rstrip()
              + (f"; compare {args.compare}" if args.compare else "")
              + (f"; variants {args.server_variants}" if args.server_variants else "")
              + f"; DoGet encoders {args.doget_encoders}", flush=True)
        print("| table | op | clients | server | GB/s | GB/s / pyarrow | GB/s / raw TCP | CPU cores: each client | "
              "clients CPU s/GB | server cores | server CPU s/GB | s/GB / pyarrow | stages, s/GB |")
        print("|" + " --- |" * 13, flush=True)
        raw = {}
        for table in args.tables.split(","):
            for _, location, _, pid, _ in targets:  # the dataset every DoGet client reads, once a server
                if not location.startswith("grpc+unix"):
                    run_together([client_argv("python", "put", location, f"bench-{table}", args, table)], pid)
            for op in args.ops.split(","):
                for n in clients:
                    for index, (variant, client_env) in enumerate(client_variants):
                        measure_row(args, table, op, n, targets, raw, scratch, variant, client_env,
                                    with_raw=index == 0)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def settings(flags):
    """`VAR=value` words as an environment mapping."""
    env = {}
    for word in shlex.split(flags):
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
            raise SystemExit(f"a client variant takes VAR=value settings only, not {word!r}")
        key, value = word.split("=", 1)
        env[key] = value
    return env


def measure_row(args, table, op, n, targets, raw, scratch, variant, client_env, with_raw):
    """Measures `op` on `table` with `n` clients (started with `client_env`) against every target,
    and prints a row for each, its ratios to pyarrow's with the same clients; `with_raw`: the
    raw-socket rows too (whose clients no variant changes: measured once for `n`)."""
    figures = []
    for label, location, ours, pid, puts in targets:
        probe = stage_probe(location, op) if ours else None
        if op == "put" and not puts:
            figures.append(None)  # the same server as the first encoder's
        elif op == "get":
            argvs = [client_argv(args.client, "get", location, f"bench-{table}", args, table)] * n
            figures.append(best(args, lambda: run_together(argvs, pid, probe, client_env)))
        else:
            names = [f"put-{i}" for i in range(n)]

            def put_all():
                rate = run_together([client_argv(args.client, "put", location, name, args, table)
                                     for name in names], pid, probe, client_env)
                drop_names(location, names, ours)
                return rate
            figures.append(best(args, put_all))
    if n not in raw:
        raw[n] = [None, None] if args.no_raw else [
            best(args, lambda: raw_rate(args, n, address)) for address in
            ("127.0.0.1:0", f"unix://{scratch / 'raw.sock'}")]
    tcp, uds = raw[n]
    pyarrow = figures[-1]
    suffix = f" [{variant}]" if variant else ""
    rows = [(label + suffix, f) for (label, *_), f in zip(targets, figures) if f is not None]
    if with_raw:
        rows += [(name, f) for name, f in (("raw TCP", tcp), ("raw UDS", uds)) if f is not None]
    for label, f in rows:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in getattr(f, "per_gb", {}).items())
        # A tiny run can end within one clock tick of the server's CPU time.
        cpu_ratio = (f"{(f.server_cores / f) / (pyarrow.server_cores / pyarrow):.2f}x"
                     if pyarrow.server_cores > 0 else "-")
        print(f"| {table} | {op} | {n} | {label} | {f:.2f} | {f / pyarrow:.2f}x | "
              + (f"{f / tcp:.0%}" if tcp else "-")
              + f" | {f.client_cores:.2f} | {f.client_cores * n / f:.3f} | {f.server_cores:.2f} | "
              + f"{f.server_cores / f:.3f} | "
              + f"{cpu_ratio} | " + (stages or "-") + " |", flush=True)


def drop_names(location, names, ours):
    with connect(location) as client:
        for name in names:
            body = json.dumps({"name": name}).encode() if ours else name.encode()
            list(client.do_action(flight.Action("drop", body)))


def raw_rate(args, n, address):
    sink = Process([str(args.rust_client), "sink", "--address", address, "--connections", str(n)],
                   r"listening (\S+)")
    try:
        target = sink.match.group(1)
        return run_together([[str(args.rust_client), "send", "--address", target, "--mib", str(args.mib)]] * n,
                            sink.process.pid)
    finally:
        sink.process.wait(timeout=60)


if __name__ == "__main__":
    main()
