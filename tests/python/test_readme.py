"""The README's first example, run as a user runs it: twice in a row, each time in a fresh
Python interpreter, against a fresh server.

The example is the ```python block right after MARKER in README.md; what it prints is the
```text block that follows it. The example connects to grpc://127.0.0.1:8815, the server's
default address; the test rewrites that one string to the address of the server it started.
"""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- tests/python/test_readme.py runs this example -->"
README_LOCATION = "grpc://127.0.0.1:8815"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def readme_example():
    """The marked example's code and the output the README says it prints."""
    text = README.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, f"README.md must hold {MARKER!r} exactly once"
    after = text.split(MARKER, 1)[1]
    blocks = list(FENCE.finditer(after))
    assert len(blocks) >= 2, "the marker must be followed by a python and a text block"
    code, output = blocks[0], blocks[1]
    assert after[: code.start()].strip() == "", "the python block must follow the marker directly"
    assert code.group(1) == "python", f"the marked block is {code.group(1)!r}, not python"
    assert output.group(1) == "text", "the block after the example must be its output, as text"
    return code.group(2), output.group(2)


def test_readme_example_runs_twice(make_server, tmp_path):
    code, expected = readme_example()
    assert code.count(README_LOCATION) == 1, f"the example must connect to {README_LOCATION} once"
    # A server of its own: the first run finds no dataset, the second finds the first's.
    server = make_server()
    script = tmp_path / "readme_example.py"
    script.write_text(code.replace(README_LOCATION, server.location), encoding="utf-8")

    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"run {run} of the README example failed:\n{done.stderr}"
        assert done.stdout == expected, (
            f"run {run} printed\n{done.stdout}\nbut the README says it prints\n{expected}"
        )
