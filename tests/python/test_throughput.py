"""The throughput benchmark (examples/python/throughput.py) stays runnable: a tiny run on the
host backend against pyarrow.flight, with two server variants (one with every hidden tuning
flag's kind: an environment setting, an HTTP/2 setting, a read depth), DoGet and DoPut, both
tables, must print a row of figures for every server, with the CPU columns present, and
CPU time measured for each of our servers. Not a measurement: the sizes are too small to mean anything. (The raw-socket rows
need the Rust client and are left out, to stay quick.)"""

import pathlib
import re
import subprocess
import sys

import pytest

from conftest import BINARY, ROOT

SCRIPT = ROOT / "examples" / "python" / "throughput.py"


def test_a_tiny_run_prints_every_row_with_cpu_columns():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "host", "--clients", "2", "--mib", "16",
         "--tables", "int64,strings", "--ops", "get,put", "--repeat", "1", "--no-uds",
         "--no-raw", "--server", BINARY,
         "--server-variants", "base=;tuned=TOKIO_WORKER_THREADS=2 --h2-max-frame-bytes 16KiB --read-prefetch 3",
         ],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header = [cell.strip() for cell in rows.pop(0).strip("|").split("|")]
    assert header[:4] == ["table", "op", "clients", "server"], header
    servers = ["gpu-flight host base", "gpu-flight host tuned", "pyarrow"]
    seen = {}
    cpu: dict[str, float] = {}
    for row in rows:
        cells = dict(zip(header, (cell.strip() for cell in row.strip("|").split("|"))))
        seen.setdefault((cells["table"], cells["op"]), []).append(cells["server"])
        assert float(cells["GB/s"]) > 0, row
        assert re.fullmatch(r"\d+\.\d\dx", cells["GB/s / pyarrow"]), row
        # CPU time comes from /proc in clock ticks (10 ms): a server can move 32 MiB within
        # one (pyarrow's, and a release build of ours on a fast machine), so a row may read 0;
        # each of our servers' rows together must not.
        for column in ["server CPU s/GB", "server cores", "CPU cores: each client", "clients CPU s/GB"]:
            assert float(cells[column]) >= 0, row
        assert float(cells["CPU cores: each client"]) > 0, row
        # All the clients' CPU per GB: each client's cores, times the clients, over the rate,
        # within what rounding the two printed figures (to 0.005 each) leaves of it.
        cores, rate, n = float(cells["CPU cores: each client"]), float(cells["GB/s"]), int(cells["clients"])
        low = max(cores - 0.005, 0.0) * n / (rate + 0.005)
        high = (cores + 0.005) * n / max(rate - 0.005, 1e-9)
        assert low - 0.001 <= float(cells["clients CPU s/GB"]) <= high + 0.001, row
        if cells["server"].startswith("gpu-flight"):
            cpu[cells["server"]] = cpu.get(cells["server"], 0.0) + float(cells["server CPU s/GB"])
            assert re.fullmatch(r"\d+\.\d\dx|-", cells["s/GB / pyarrow"]), row
            names = ["staging", "encode", "send_wait"] if cells["op"] == "get" else ["receive_wait", "decode", "upload"]
            stages = dict(part.split() for part in cells["stages, s/GB"].split(", "))
            assert list(stages) == names, row
            assert all(float(v) >= 0 for v in stages.values()), row
    assert seen == {(t, op): servers for t in ("int64", "strings") for op in ("get", "put")}, done.stdout
    assert all(cpu[server] > 0 for server in servers[:2]), (cpu, done.stdout)


RUST_CLIENT = pathlib.Path(BINARY).parent / "examples" / "flight_client"


@pytest.mark.skipif(not RUST_CLIENT.exists(), reason=f"no Rust client at {RUST_CLIENT} (cargo test builds it)")
def test_raw_socket_rows_come_once_whatever_the_client_variants():
    # The raw ceiling's clients are the Rust client's, which no variant changes.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "host", "--clients", "1", "--mib", "4",
         "--tables", "int64", "--ops", "get", "--repeat", "1", "--no-uds", "--server", BINARY,
         "--rust-client", str(RUST_CLIENT), "--client-variants", "plain=;other=SOME_SETTING=1"],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    servers = [line.split("|")[4].strip() for line in done.stdout.splitlines()
               if line.startswith("| int64 ")]
    assert servers == [
        "gpu-flight host [plain]", "pyarrow [plain]", "raw TCP", "raw UDS",
        "gpu-flight host [other]", "pyarrow [other]",
    ], done.stdout


def test_client_variants_measure_every_server_with_each_set_of_clients():
    # Each row once per client variant, its ratio to pyarrow's server read by the same clients
    # (so pyarrow's own rows read 1.00x in every variant).
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "host", "--clients", "1", "--mib", "8",
         "--tables", "int64", "--ops", "get", "--repeat", "1", "--no-uds", "--no-raw", "--server", BINARY,
         "--client-variants", "plain=;kept=GLIBC_TUNABLES=glibc.malloc.trim_threshold=4294967295"],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header = [cell.strip() for cell in rows.pop(0).strip("|").split("|")]
    cells = [dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")))) for row in rows]
    assert [c["server"] for c in cells] == [
        "gpu-flight host [plain]", "pyarrow [plain]", "gpu-flight host [kept]", "pyarrow [kept]",
    ], done.stdout
    assert all(float(c["GB/s"]) > 0 for c in cells), done.stdout
    assert [c["GB/s / pyarrow"] for c in cells if c["server"].startswith("pyarrow")] == ["1.00x", "1.00x"]
    # A setting that is not VAR=value is refused before anything runs.
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--server", BINARY, "--client-variants", "bad=--flag"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert refused.returncode != 0 and "VAR=value" in refused.stderr, refused.stderr[-2000:]
