"""The startup benchmark (examples/python/startup_bench.py) stays runnable: a tiny run on the
host backend, which pins nothing, must print a row for every start it was asked for, with a
put timed after each start. Not a measurement."""

import subprocess
import sys

from conftest import BINARY, ROOT

SCRIPT = ROOT / "examples" / "python" / "startup_bench.py"


def test_a_tiny_run_prints_a_row_for_every_start():
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--backend",
            "host",
            "--pinned",
            "default,0",
            "--repeat",
            "2",
            "--server",
            BINARY,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header = [cell.strip() for cell in rows.pop(0).strip("|").split("|")]
    assert header[:2] == ["server", "--pinned-host-memory"], header
    pinned = []
    for row in rows:
        cells = dict(zip(header, (cell.strip() for cell in row.strip("|").split("|"))))
        pinned.append(cells["--pinned-host-memory"])
        assert float(cells["serving after, s"]) > 0, row
        assert float(cells["first put, ms"]) > 0 and float(cells["second put, ms"]) > 0, row
        assert float(cells["pinned, GiB"]) == 0, row  # the host backend pins nothing
    assert pinned == ["default", "default", "0", "0"], done.stdout
