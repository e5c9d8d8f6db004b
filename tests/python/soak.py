#!/usr/bin/env python3
"""Soak test: many client processes doing everything at once, with faults, for a set time.

    python tests/python/soak.py --binary target/release/gpu-flight --minutes 60 --clients 32 --seed 1

starts gpu-flight (or uses --location), runs --clients worker processes (multiprocessing, spawn)
that each pick operations at random until the time is up:

- puts (create, replace, append) of varied tables: integers, floats with nulls, strings,
  dictionaries, lists, structs, decimals, timestamps, null columns, in varied batch sizes;
- DoGet of a whole dataset by name, and of every GetFlightInfo endpoint in parallel;
  ListFlights, status, drop;
- faults: a client process SIGKILLed mid-put or mid-get, SIGSTOPped and later killed, puts and
  gets abandoned (their deadline passes mid-stream), oversize requests, malformed arrays, JSON
  arrays for objects, zero-column and null batches of billions of rows.

Every put to the shared datasets writes one *block*: rows carrying the put's unique `version`,
its row count `put_rows` and the row's index `row`, and payload columns that are a function of
the version. A read must be a sequence of whole blocks, each at most once, each with exactly
its payload: a read mixing two versions of a dataset, a partial put made visible, or corrupt
data all break that. Killed and frozen clients put to shared names too, so a partial commit of
theirs would show up in readers; those putting to `soak-victim/*` names must never appear.

Checked continuously: every outcome's gRPC code is one the README documents for that request
(INTERNAL, UNKNOWN, UNAVAILABLE, a deadline on a normal request, an unexpected success of a
hostile request are violations); the server is alive; its RSS stays below --memory-limit plus a
stated overhead; `used_bytes` stays within `limit_bytes`. At the end, after the workers stop and
every dataset is dropped: `used_bytes` is back at its baseline, the server exits 0 on SIGTERM,
and its log has no 'panicked'. Prints counts per operation and outcome, and exits 1 on any
violation.

If the binary has the keepalive and message-size flags, the server is started with pings every
second and a 16 MiB put message limit, and oversize put messages join the faults.
"""

import argparse
import collections
import json
import multiprocessing
import os
import pathlib
import queue
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# --- Tables ------------------------------------------------------------------------------------

VARIANTS = 4
STRUCTURE = ("version", "put_rows", "row", "variant")


def _strings(rng, rows, max_len, nulls):
    lengths = rng.integers(0, max_len + 1, rows)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    data = rng.integers(97, 123, int(offsets[-1]), dtype=np.uint8)
    array = pa.Array.from_buffers(pa.utf8(), rows, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes())])
    if nulls:
        mask = rng.random(rows) < nulls
        array = pc.if_else(pa.array(mask), pa.nulls(rows, pa.utf8()), array)
    return array


def _payload(rng, rows, variant):
    if variant == 0:
        mask = rng.random(rows) < 0.1
        return {
            "a": pa.array(rng.integers(-(2**62), 2**62, rows)),
            "f": pa.array(rng.random(rows), mask=mask),
            "u": pa.array(rng.integers(0, 255, rows, dtype=np.uint8)),
        }
    if variant == 1:
        words = [f"w{i}-" + "x" * (i % 7) for i in range(int(rng.integers(2, 40)))]
        keys = rng.integers(0, len(words), rows).astype(np.int32)
        return {
            "s": _strings(rng, rows, 40, 0.05),
            "d": pa.DictionaryArray.from_arrays(pa.array(keys), pa.array(words)),
        }
    if variant == 2:
        lengths = rng.integers(0, 5, rows)
        offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = pa.array(rng.integers(-1000, 1000, int(offsets[-1]), dtype=np.int32))
        return {
            "l": pa.ListArray.from_arrays(pa.array(offsets), values),
            "st": pa.StructArray.from_arrays(
                [pa.array(rng.integers(0, 10**6, rows)), _strings(rng, rows, 8, 0.2)], names=["n", "t"]
            ),
        }
    return {
        "b": pa.array(rng.random(rows) < 0.5),
        "ts": pa.array(rng.integers(0, 2**50, rows)).cast(pa.timestamp("us", tz="UTC")),
        "dec": pa.array(rng.integers(-(10**9), 10**9, rows)).cast(pa.decimal128(22, 2)),
        "n": pa.nulls(rows),
        "ls": _strings(rng, rows, 20, 0).cast(pa.large_utf8()),
    }


def make_table(version, rows, variant, start=0, put_rows=None):
    """Rows [start, start + rows) of the put `version`: structure columns, then the variant's
    payload (a function of version, rows and start only)."""
    rng = np.random.default_rng([version, rows, start])
    columns = {
        "version": pa.array(np.full(rows, version, dtype=np.int64)),
        "put_rows": pa.array(np.full(rows, rows if put_rows is None else put_rows, dtype=np.int64)),
        "row": pa.array(np.arange(start, start + rows, dtype=np.int64)),
        "variant": pa.array(np.full(rows, variant, dtype=np.int8)),
    }
    columns.update(_payload(rng, rows, variant))
    return pa.table(columns)


def _decoded(table):
    return pa.table(
        {
            name: column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column
            for name, column in zip(table.column_names, table.columns)
        }
    )


def check_read(table, verify_payload=True):
    """Problems with a read of a shared dataset: [] if it is a sequence of whole, distinct,
    uncorrupted blocks."""
    if table.num_rows == 0:
        return []
    if table.column_names[: len(STRUCTURE)] != list(STRUCTURE):
        return [f"unexpected columns {table.column_names}"]
    version = table.column("version").to_numpy()
    put_rows = table.column("put_rows").to_numpy()
    row = table.column("row").to_numpy()
    variant = table.column("variant").to_numpy()
    if len(set(variant.tolist())) != 1:
        return [f"variants {sorted(set(variant.tolist()))} in one dataset"]
    starts = np.flatnonzero(np.diff(version)) + 1
    bounds = [0, *starts.tolist(), table.num_rows]
    seen = set()
    problems = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        v = int(version[begin])
        n = end - begin
        if v in seen:
            problems.append(f"version {v} appears twice")
        seen.add(v)
        if not (put_rows[begin:end] == put_rows[begin]).all() or int(put_rows[begin]) != n:
            problems.append(f"version {v}: {n} rows where the put had {int(put_rows[begin])} (partial or mixed)")
            continue
        if not (row[begin:end] == np.arange(n)).all():
            problems.append(f"version {v}: rows out of order")
            continue
        if verify_payload:
            expected = _decoded(make_table(v, n, int(variant[begin]))).combine_chunks()
            got = _decoded(table.slice(begin, n)).combine_chunks()
            if not got.equals(expected):
                problems.append(f"version {v}: payload differs from what was put")
    return problems


# --- Outcomes ----------------------------------------------------------------------------------

WORDS = {
    "invalid argument": "INVALID_ARGUMENT",
    "resource exhausted": "RESOURCE_EXHAUSTED",
    "not found": "NOT_FOUND",
    "already exists": "ALREADY_EXISTS",
    "unimplemented": "UNIMPLEMENTED",
    "precondition failed": "FAILED_PRECONDITION",
    "failed precondition": "FAILED_PRECONDITION",
    "cancelled": "CANCELLED",
    "unavailable": "UNAVAILABLE",
    "internal": "INTERNAL",
    "timeout": "DEADLINE_EXCEEDED",
    "unknown": "UNKNOWN",
    "unauthenticated": "UNAUTHENTICATED",
    "unauthorized": "PERMISSION_DENIED",
}


def code_of(error):
    """The gRPC code a pyarrow.flight exception stands for; CLIENT:<type> if none."""
    if isinstance(error, flight.FlightTimedOutError):
        return "DEADLINE_EXCEEDED"
    if isinstance(error, flight.FlightCancelledError):
        return "CANCELLED"
    if isinstance(error, flight.FlightUnavailableError):
        return "UNAVAILABLE"
    if isinstance(error, flight.FlightInternalError):
        return "INTERNAL"
    match = re.search(r"(?:Flight|gRPC) returned (.+?) error", str(error))
    if match and match.group(1).lower() in WORDS:
        return WORDS[match.group(1).lower()]
    return f"CLIENT:{type(error).__name__}"


OK = "OK"
# The codes the README documents for each operation under this load. Anything else is a
# violation; so is OK for a hostile request.
ALLOWED = {
    "put": {OK, "ALREADY_EXISTS", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"},
    "get_whole": {OK, "NOT_FOUND"},
    "get_endpoints": {OK, "NOT_FOUND"},
    "list": {OK},
    "status": {OK},
    "drop": {OK, "NOT_FOUND"},
    "abandon_put": {"DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "ALREADY_EXISTS"},
    "abandon_get": {OK, "NOT_FOUND", "DEADLINE_EXCEEDED", "CANCELLED"},
    "malformed": {"INVALID_ARGUMENT"},
    "oversize_request": {"INVALID_ARGUMENT"},
    "json_array": {"INVALID_ARGUMENT"},
    "rows_over_2_31": {"INVALID_ARGUMENT"},
    "null_rows_over_budget": {"RESOURCE_EXHAUSTED"},
    "oversize_put_message": {"RESOURCE_EXHAUSTED"},
    "kill_put": {"killed", "victim-exited", "victim-timeout"},
    "kill_get": {"killed", "victim-exited", "victim-timeout", "absent"},
    "freeze_put": {"killed", "victim-exited", "victim-timeout"},
    "freeze_get": {"killed", "victim-exited", "victim-timeout", "absent"},
}


def parse_size(text):
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = (match.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]


# --- Workers -----------------------------------------------------------------------------------

CALL = flight.FlightCallOptions(timeout=120)


class Worker:
    """One client process: a random walk over operations until the deadline."""

    def __init__(self, index, config, events):
        self.index = index
        self.config = config
        self.events = events
        self.rng = random.Random(config["seed"] * 1000 + index)
        self.location = config["location"]
        self.client = flight.connect(self.location)
        self.pool = ThreadPoolExecutor(4)
        self.counts = collections.Counter()
        self.sequence = 0
        self.victims = []

    # Helpers.
    def version(self):
        self.sequence += 1
        return (self.config["seed"] % 1000 * 1000 + self.index + 1) * 10**9 + self.sequence

    def violation(self, op, text):
        self.events.put(("violation", self.index, op, text))

    def record(self, op, outcome, detail=""):
        self.counts[(op, outcome)] += 1
        if outcome not in ALLOWED[op]:
            self.violation(op, f"{outcome}: {detail}"[:500])

    def attempt(self, op, function):
        """Runs `function`; records OK or the error's code; returns its result or None."""
        try:
            result = function()
        except (pa.ArrowException, OSError) as error:
            self.record(op, code_of(error), str(error).split(". gRPC client debug context")[0])
            if code_of(error) == "UNAVAILABLE":
                self.reconnect()
            return None
        self.record(op, OK, "the server accepted it")
        return result

    def reconnect(self):
        try:
            self.client.close()
        except Exception:
            pass
        self.client = flight.connect(self.location)

    def shared(self):
        return self.rng.choice(self.config["shared"])

    def canonical_variant(self, name):
        return self.config["shared"].index(name) % VARIANTS

    def random_rows(self):
        if self.rng.random() < 0.05:
            return self.rng.randint(100_000, 400_000)
        return int(10 ** self.rng.uniform(0, 5))

    def chunk_rows(self, table):
        """Rows per message: sometimes whole tables, otherwise messages of about 16 KB to 2 MB
        (under --max-put-message-bytes where the soak sets it)."""
        if not self.config["hardened"] and self.rng.random() < 0.2:
            return None
        per_row = max(1, table.nbytes // max(1, table.num_rows))
        return max(1, int(10 ** self.rng.uniform(4.2, 6.3)) // per_row)

    def put_table(self, descriptor, table, chunk, options=CALL):
        """Puts a table (or one record batch, as one message); returns the put summary."""
        writer, reader = self.client.do_put(descriptor, table.schema, options=options)
        if isinstance(table, pa.RecordBatch):
            writer.write_batch(table)
        elif chunk is None:
            writer.write_table(table)
        else:
            writer.write_table(table, max_chunksize=chunk)
        writer.done_writing()
        result = reader.read()
        writer.close()
        return json.loads(result.to_pybytes())

    def read(self, op, name, by_endpoints):
        def whole():
            return self.client.do_get(flight.Ticket(name.encode()), options=CALL).read_all()

        def endpoints():
            info = self.client.get_flight_info(flight.FlightDescriptor.for_path(name), options=CALL)
            parts = list(self.pool.map(lambda e: self.client.do_get(e.ticket, options=CALL).read_all(), info.endpoints))
            return pa.concat_tables(parts)

        table = self.attempt(op, endpoints if by_endpoints else whole)
        if table is not None:
            problems = check_read(table, self.config["verify_payload"])
            if problems:
                self.violation(op, f"read of {name} ({table.num_rows} rows): " + "; ".join(problems[:5]))
        return table

    # Operations.
    def op_put(self):
        name = self.shared()
        variant = self.canonical_variant(name) if self.rng.random() < 0.85 else self.rng.randrange(VARIANTS)
        mode = self.rng.choices(["create", "replace", "append"], [2, 4, 4])[0]
        table = make_table(self.version(), self.random_rows(), variant)
        if mode == "create" and self.rng.random() < 0.5:
            descriptor = flight.FlightDescriptor.for_path(name)
        else:
            descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": name, "mode": mode}))
        summary = self.attempt("put", lambda: self.put_table(descriptor, table, self.chunk_rows(table)))
        if summary is not None and summary.get("rows") != table.num_rows:
            self.violation("put", f"summary {summary} for a put of {table.num_rows} rows")
        if summary is not None and summary.get("total_rows", 0) > 2_000_000:
            self.attempt("drop", lambda: self.drop(name))

    def drop(self, name):
        return list(self.client.do_action(flight.Action("drop", json.dumps({"name": name}).encode()), options=CALL))

    def op_get_whole(self):
        self.read("get_whole", self.shared(), by_endpoints=False)

    def op_get_endpoints(self):
        self.read("get_endpoints", self.shared(), by_endpoints=True)

    def op_list(self):
        infos = self.attempt("list", lambda: list(self.client.list_flights(options=CALL)))
        for info in infos or []:
            if info.total_records < 0 or not info.endpoints:
                self.violation("list", f"{info.descriptor.path}: {info.total_records} rows, {len(info.endpoints)} endpoints")

    def op_status(self):
        body = self.attempt(
            "status", lambda: list(self.client.do_action(flight.Action("status", b""), options=CALL))[0].body.to_pybytes()
        )
        if body is not None:
            device = json.loads(body)["devices"][0]
            if device["used_bytes"] > device["limit_bytes"]:
                self.violation("status", f"used_bytes {device['used_bytes']} over limit_bytes {device['limit_bytes']}")

    def op_drop(self):
        self.attempt("drop", lambda: self.drop(self.shared()))

    def op_abandon_put(self):
        """A put whose deadline passes mid-stream: cancelled, never committed. Half go to a
        shared name (a partial commit would break readers), half to a name checked here."""
        shared = self.rng.random() < 0.5
        name = self.shared() if shared else f"soak-victim/{self.index}-{self.sequence}-abandoned"
        variant = self.canonical_variant(name) if shared else 0
        version = self.version()
        chunk = make_table(version, 1000, variant, put_rows=10**9)
        options = flight.FlightCallOptions(timeout=self.rng.uniform(0.3, 1.5))
        descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": name, "mode": "append"}))

        def run():
            writer, _ = self.client.do_put(descriptor, chunk.schema, options=options)
            for start in range(0, 10**9, 1000):
                writer.write_table(make_table(version, 1000, variant, start=start, put_rows=10**9))
                time.sleep(0.05)

        self.attempt("abandon_put", run)
        if not shared:
            self.check_absent("abandon_put", name)

    def op_abandon_get(self):
        name = self.shared()
        options = flight.FlightCallOptions(timeout=self.rng.uniform(0.3, 1.5))

        def run():
            reader = self.client.do_get(flight.Ticket(name.encode()), options=options)
            try:
                reader.read_chunk()
            except StopIteration:
                return
            if self.rng.random() < 0.5:
                reader.cancel()
                return
            time.sleep(2)  # past the deadline
            reader.read_all()

        self.attempt("abandon_get", run)

    def check_absent(self, op, name):
        try:
            self.client.get_flight_info(flight.FlightDescriptor.for_path(name), options=CALL)
        except pa.ArrowException as error:
            if code_of(error) != "NOT_FOUND":
                self.violation(op, f"GetFlightInfo({name}) after the fault: {code_of(error)}")
            return
        self.violation(op, f"{name} exists after {op}, which must never commit")

    def op_malformed(self):
        int32s = lambda *v: pa.py_buffer(np.array(v, dtype=np.int32).tobytes())  # noqa: E731
        cases = [
            pa.Array.from_buffers(pa.decimal128(3, 0), 1, [None, pa.py_buffer((12345).to_bytes(16, "little"))]),
            pa.Array.from_buffers(pa.utf8(), 2, [None, int32s(0, 1, 3), pa.py_buffer(b"a\xff\xfe")]),
            pa.Array.from_buffers(pa.utf8(), 2, [None, int32s(0, 100, 3), pa.py_buffer(b"abc")]),
            pa.DictionaryArray.from_arrays(pa.array([0, 5], pa.int32()), pa.array(["a", "b"]), safe=False),
            pa.Array.from_buffers(pa.list_(pa.int32()), 2, [None, int32s(0, 3, 1)], children=[pa.array([1, 2, 3], pa.int32())]),
        ]
        index = self.rng.randrange(len(cases))
        table = pa.table({"c": cases[index]})
        name = f"soak-victim/{self.index}-{self.version()}-malformed{index}"
        self.attempt("malformed", lambda: self.put_table(flight.FlightDescriptor.for_path(name), table, None))
        self.check_absent("malformed", name)

    def op_oversize_request(self):
        big = 1 << 20
        kind = self.rng.randrange(4)
        if kind == 0:
            self.attempt("oversize_request", lambda: self.client.do_get(flight.Ticket(b"t" * big), options=CALL).read_all())
        elif kind == 1:
            body = json.dumps({"name": "n" * big}).encode()
            self.attempt("oversize_request", lambda: list(self.client.do_action(flight.Action("drop", body), options=CALL)))
        elif kind == 2:
            descriptor = flight.FlightDescriptor.for_path("p" * big)
            self.attempt("oversize_request", lambda: self.client.get_flight_info(descriptor, options=CALL))
        else:
            self.attempt("oversize_request", lambda: list(self.client.list_flights(b"x" * big, options=CALL)))

    def op_json_array(self):
        name = f"soak-victim/{self.index}-{self.version()}-json"
        if self.rng.random() < 0.5:
            descriptor = flight.FlightDescriptor.for_command(json.dumps([name, "create"]))
            self.attempt("json_array", lambda: self.put_table(descriptor, pa.table({"x": [1]}), None))
            self.check_absent("json_array", name)
        else:
            body = json.dumps([name]).encode()
            self.attempt("json_array", lambda: list(self.client.do_action(flight.Action("drop", body), options=CALL)))

    def op_huge_rows(self):
        name = f"soak-victim/{self.index}-{self.version()}-rows"
        over_budget = self.config["memory_limit"] * 8 + 8
        if self.rng.random() < 0.5 or over_budget > 2**31 - 1:
            batch = pa.RecordBatch.from_arrays([pa.Array.from_buffers(pa.null(), 2**31, [None])], names=["n"]).drop_columns(["n"])
            op = "rows_over_2_31"
        else:
            batch = pa.RecordBatch.from_arrays([pa.Array.from_buffers(pa.null(), over_budget, [None])], names=["n"])
            op = "null_rows_over_budget"
        self.attempt(op, lambda: self.put_table(flight.FlightDescriptor.for_path(name), batch, None))
        self.check_absent(op, name)

    def op_oversize_put_message(self):
        name = f"soak-victim/{self.index}-{self.version()}-oversize"
        table = pa.table({"x": np.arange(3_000_000, dtype=np.int64)})  # one 24 MB message
        self.attempt("oversize_put_message", lambda: self.put_table(flight.FlightDescriptor.for_path(name), table, None))
        self.check_absent("oversize_put_message", name)

    def victim(self, op, kind, freeze):
        """A client process killed (after SIGSTOP if `freeze`) in the middle of a put or get."""
        if kind == "put":
            shared = self.rng.random() < 0.5
            name = self.shared() if shared else f"soak-victim/{self.index}-{self.sequence}-killed"
            variant = self.canonical_variant(name) if shared else 0
            mode = self.rng.choice(["replace", "append"])
            args = ["put", name, str(self.version()), mode, str(variant)]
        else:
            shared, name = True, self.shared()
            args = ["get", name]
        process = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()), "--victim", self.location, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.victims.append(process)
        try:
            ready, _, _ = select.select([process.stdout], [], [], 60)
            line = process.stdout.readline().strip() if ready else ""
            if line == "absent":
                outcome = "absent"
            elif line != "started":
                outcome = "victim-exited" if process.poll() is not None else "victim-timeout"
            else:
                time.sleep(self.rng.uniform(0, 1.0))
                if freeze:
                    process.send_signal(signal.SIGSTOP)
                    time.sleep(self.rng.uniform(0.5, 5))
                outcome = "killed"
        finally:
            process.kill()
            process.wait()
            self.victims.remove(process)
        self.record(op, outcome)
        if kind == "put" and not shared and outcome == "killed":
            time.sleep(0.5)
            self.check_absent(op, name)

    def op_kill_put(self):
        self.victim("kill_put", "put", freeze=False)

    def op_kill_get(self):
        self.victim("kill_get", "get", freeze=False)

    def op_freeze_put(self):
        self.victim("freeze_put", "put", freeze=True)

    def op_freeze_get(self):
        self.victim("freeze_get", "get", freeze=True)

    WEIGHTS = {
        "put": 30,
        "get_whole": 15,
        "get_endpoints": 15,
        "list": 5,
        "status": 5,
        "drop": 3,
        "abandon_put": 3,
        "abandon_get": 3,
        "kill_put": 2,
        "kill_get": 2,
        "freeze_put": 1,
        "freeze_get": 1,
        "malformed": 2,
        "oversize_request": 2,
        "json_array": 1,
        "huge_rows": 1,
        "oversize_put_message": 1,
    }

    def run(self, deadline):
        weights = dict(self.WEIGHTS)
        if not self.config["hardened"]:
            del weights["oversize_put_message"]
        ops, w = list(weights), list(weights.values())
        last_report = time.monotonic()
        while time.monotonic() < deadline:
            op = self.rng.choices(ops, w)[0]
            try:
                getattr(self, f"op_{op}")()
            except Exception:
                self.violation(op, "the soak client itself failed: " + traceback.format_exc()[-1500:])
            if time.monotonic() - last_report > 5:
                self.events.put(("counts", self.index, dict(self.counts)))
                self.counts.clear()
                last_report = time.monotonic()
        self.events.put(("counts", self.index, dict(self.counts)))

    def close(self):
        for process in self.victims:
            process.kill()
        self.pool.shutdown(wait=False)
        self.client.close()


def _exit_on_sigterm(*_):
    raise SystemExit(1)


def worker_main(index, config, deadline, events):
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `finally` kills this worker's victims
    pa.enable_signal_handlers(False)  # calls from several threads; Ctrl-C goes to the conductor
    worker = Worker(index, config, events)
    try:
        worker.run(deadline)
    finally:
        worker.close()
        events.put(("done", index))


def victim_main(location, kind, name, *args):
    """A client that is killed mid-stream: prints 'started' once its stream is under way, then
    streams slowly for ever."""
    parent = os.getppid()

    def orphaned():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    pa.enable_signal_handlers(False)
    client = flight.connect(location)
    if kind == "put":
        version, mode, variant = int(args[0]), args[1], int(args[2])
        total = 10**9
        first = make_table(version, 2000, variant, put_rows=total)
        descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": name, "mode": mode}))
        writer, _ = client.do_put(descriptor, first.schema)
        for start in range(0, total, 2000):
            writer.write_table(make_table(version, 2000, variant, start=start, put_rows=total))
            if start == 2000:
                print("started", flush=True)
            time.sleep(0.02)
    else:
        try:
            reader = client.do_get(flight.Ticket(name.encode()))
            reader.read_chunk()
        except (pa.ArrowException, StopIteration):
            print("absent", flush=True)
            return
        print("started", flush=True)
        try:
            while True:
                reader.read_chunk()
                time.sleep(0.05)
        except StopIteration:
            pass
        time.sleep(3600)


# --- The conductor -----------------------------------------------------------------------------


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def mib(n):
    return f"{n / (1 << 20):.1f} MiB"


class Conductor:
    def __init__(self, args):
        self.args = args
        self.violations = collections.defaultdict(list)
        self.counts = collections.Counter()
        self.server = None
        self.max_rss = 0
        self.log_path = None
        self.datasets_at_start = 0
        self.started = time.monotonic()

    def violation(self, where, text):
        self.violations[where].append(text)
        if len(self.violations[where]) <= 3:
            print(f"VIOLATION [{where}] {text}", flush=True)

    def start_server(self):
        args = self.args
        help_text = subprocess.run([args.binary, "serve", "--help"], capture_output=True, text=True).stdout
        flags = ["--memory-limit", str(args.memory_limit)]
        hardened = "--keepalive-interval-seconds" in help_text and "--max-put-message-bytes" in help_text
        if hardened:
            flags += ["--keepalive-interval-seconds", "1", "--keepalive-timeout-seconds", "2"]
            flags += ["--max-put-message-bytes", "16MiB"]
        flags += args.server_arg
        self.log_path = args.log or os.path.join(tempfile.mkdtemp(prefix="gpu-flight-soak-"), "server.log")
        with open(self.log_path, "wb") as log:
            self.server = subprocess.Popen(
                [args.binary, "serve", "--listen", "127.0.0.1:0", "--backend", args.backend, *flags],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        line = self.server.stdout.readline()
        match = re.search(r"serving on (grpc://\S+)", line)
        if not match:
            self.server.kill()
            sys.exit(f"gpu-flight did not start ({line!r}); its log: {self.log_path}")
        print(f"server: {' '.join(self.server.args)}\n  at {match.group(1)}, pid {self.server.pid}, log {self.log_path}")
        return match.group(1), hardened

    def status(self, client):
        result = list(client.do_action(flight.Action("status", b""), options=flight.FlightCallOptions(timeout=30)))
        return json.loads(result[0].body.to_pybytes())

    def run(self):
        args = self.args
        hardened = args.hardened
        if args.location:
            location = args.location
        else:
            location, detected = self.start_server()
            hardened = hardened or detected
        client = flight.connect(location)
        initial = self.status(client)
        baseline = initial["devices"][0]["used_bytes"]
        limit_bytes = initial["devices"][0]["limit_bytes"]
        self.datasets_at_start = initial["datasets"]
        overhead = args.rss_overhead if args.rss_overhead is not None else (256 << 20) + args.clients * (24 << 20)
        rss_limit = limit_bytes + overhead
        print(
            f"soak: {args.clients} clients, {args.minutes} min, seed {args.seed}, "
            f"{'hardened flags' if hardened else 'no hardening flags (binary lacks them)'}; "
            f"memory limit {mib(limit_bytes)}, RSS bound {mib(rss_limit)} (limit + {mib(overhead)} stated overhead), "
            f"baseline used_bytes {baseline}",
            flush=True,
        )
        config = {
            "location": location,
            "seed": args.seed,
            "shared": [f"soak/{i}" for i in range(args.datasets)],
            "verify_payload": not args.no_verify_payload,
            "hardened": hardened,
            "memory_limit": limit_bytes,
        }
        context = multiprocessing.get_context("spawn")
        events = context.Queue()
        start = time.monotonic()
        deadline = start + args.minutes * 60
        workers = [
            context.Process(target=worker_main, args=(i, config, deadline, events), daemon=True) for i in range(args.clients)
        ]
        for worker in workers:
            worker.start()
        done = set()
        last_print = last_check = start
        while len(done) < len(workers):
            try:
                event = events.get(timeout=1)
            except queue.Empty:
                event = None
            if event is not None:
                if event[0] == "violation":
                    _, index, op, text = event
                    self.violation(op, f"client {index}: {text}")
                elif event[0] == "counts":
                    self.counts.update({tuple(k): v for k, v in event[2].items()})
                elif event[0] == "done":
                    done.add(event[1])
            now = time.monotonic()
            if now - last_check >= 1:
                self.check_server(client, limit_bytes, rss_limit)
                last_check = now
            if now - last_print > 10:
                total = sum(self.counts.values())
                rss = f", server RSS {mib(self.max_rss)} max" if self.server else ""
                print(f"  {now - start:6.0f} s: {total} operations, {sum(map(len, self.violations.values()))} violations{rss}", flush=True)
                last_print = now
            if now > deadline + 180:
                for index, worker in enumerate(workers):
                    if index not in done:
                        self.violation("shutdown", f"client {index} still running 3 minutes after the deadline")
                        worker.kill()
                break
            for index, worker in enumerate(workers):
                if index not in done and worker.exitcode not in (None, 0):
                    self.violation("client", f"client {index} died with exit code {worker.exitcode}")
                    done.add(index)
        for worker in workers:
            worker.join(timeout=30)
        self.drain(events)
        self.final_checks(client, baseline, rss_limit)
        self.summary(time.monotonic() - start, overhead, rss_limit)
        return 1 if self.violations else 0

    def drain(self, events):
        while True:
            try:
                event = events.get(timeout=0.2)
            except queue.Empty:
                return
            if event[0] == "violation":
                self.violation(event[2], f"client {event[1]}: {event[3]}")
            elif event[0] == "counts":
                self.counts.update({tuple(k): v for k, v in event[2].items()})

    def check_server(self, client, limit_bytes, rss_limit):
        if self.server is not None:
            if self.server.poll() is not None:
                self.violation("server", f"gpu-flight exited with {self.server.returncode}")
                raise SystemExit(self.report_and_exit())
            rss = rss_bytes(self.server.pid)
            self.max_rss = max(self.max_rss, rss)
            if rss > rss_limit:
                self.violation("server", f"RSS {mib(rss)} above the bound {mib(rss_limit)}")
        try:
            device = self.status(client)["devices"][0]
        except pa.ArrowException as error:
            self.violation("server", f"status failed: {code_of(error)}: {error}")
            return
        if device["used_bytes"] > limit_bytes:
            self.violation("server", f"used_bytes {device['used_bytes']} over limit_bytes {limit_bytes}")

    def final_checks(self, client, baseline, rss_limit):
        print("workers stopped; checking every dataset, dropping them, waiting for memory", flush=True)
        options = flight.FlightCallOptions(timeout=120)
        for info in list(client.list_flights(options=options)):
            name = info.descriptor.path[0].decode()
            if name.startswith("soak-victim/"):
                self.violation("final", f"{name} exists: a put that was refused, abandoned or killed was committed")
            elif not name.startswith("soak/"):
                continue  # not ours (a server given by --location may hold other datasets)
            else:
                try:
                    table = client.do_get(flight.Ticket(name.encode()), options=options).read_all()
                    problems = check_read(table, not self.args.no_verify_payload)
                except pa.ArrowException as error:
                    problems = [f"{code_of(error)}: {error}"]
                if problems:
                    self.violation("final", f"{name}: " + "; ".join(problems[:5]))
            try:
                list(client.do_action(flight.Action("drop", json.dumps({"name": name}).encode()), options=options))
            except pa.ArrowException as error:
                if code_of(error) != "NOT_FOUND":
                    self.violation("final", f"drop {name}: {code_of(error)}")
        deadline = time.monotonic() + 60
        while True:
            status = self.status(client)
            used = status["devices"][0]["used_bytes"]
            if used == baseline and status["datasets"] == self.datasets_at_start:
                print(f"memory back at baseline ({baseline} bytes)", flush=True)
                break
            if time.monotonic() > deadline:
                self.violation("final", f"used_bytes {used} (baseline {baseline}), {status['datasets']} datasets, 60 s after the last drop")
                break
            time.sleep(0.5)
        client.close()
        if self.server is None:
            return
        self.check_server_log(rss_limit)

    def check_server_log(self, rss_limit):
        self.max_rss = max(self.max_rss, rss_bytes(self.server.pid))
        if self.max_rss > rss_limit:
            self.violation("server", f"peak RSS {mib(self.max_rss)} above the bound {mib(rss_limit)}")
        self.server.terminate()
        try:
            code = self.server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.server.kill()
            code = "none (killed after 60 s)"
        if code != 0:
            self.violation("server", f"exit code {code} on SIGTERM")
        with open(self.log_path, errors="replace") as log:
            panics = [line.strip() for line in log if "panicked" in line]
        for line in panics[:5]:
            self.violation("server", f"log: {line[:300]}")

    def report_and_exit(self):
        self.summary(0, 0, 0)
        return 1

    def summary(self, elapsed, overhead, rss_limit):
        by_op = collections.defaultdict(collections.Counter)
        for (op, outcome), n in self.counts.items():
            by_op[op][outcome] += n
        print(f"\n== summary: {elapsed:.0f} s, {sum(self.counts.values())} operations ==")
        width = max((len(op) for op in by_op), default=10)
        for op in sorted(by_op):
            outcomes = ", ".join(f"{outcome} {n}" for outcome, n in by_op[op].most_common())
            print(f"  {op:<{width}}  {sum(by_op[op].values()):6}  {outcomes}")
        if self.server is not None and rss_limit:
            print(f"server peak RSS {mib(self.max_rss)}; bound {mib(rss_limit)} = memory limit + {mib(overhead)} overhead")
            print(f"server log: {self.log_path}")
        if not self.violations:
            print("no violations")
            return
        total = sum(map(len, self.violations.values()))
        print(f"\n== {total} violations ==")
        for where, texts in sorted(self.violations.items()):
            print(f"  [{where}] x{len(texts)}")
            for text in list(dict.fromkeys(texts))[:3]:
                print(f"      {text[:400]}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--victim":
        victim_main(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default=str(ROOT / "target" / "release" / "gpu-flight"))
    parser.add_argument("--location", help="a running server to use instead of starting one (no RSS, log or exit checks)")
    parser.add_argument("--backend", default=os.environ.get("GPU_FLIGHT_BACKEND", "host"))
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--datasets", type=int, default=6, help="shared dataset names")
    parser.add_argument("--memory-limit", type=parse_size, default=parse_size("192MiB"))
    parser.add_argument(
        "--rss-overhead", type=parse_size, default=None, help="RSS allowed beyond the memory limit (default 256 MiB + 24 MiB a client)"
    )
    parser.add_argument("--server-arg", action="append", default=[], help="an extra flag for the server (repeatable)")
    parser.add_argument("--hardened", action="store_true", help="assume the hardening flags (with --location)")
    parser.add_argument("--no-verify-payload", action="store_true", help="check blocks' structure only")
    parser.add_argument("--log", help="where the server's log goes (default: a temporary file)")
    args = parser.parse_args()
    if args.clients < 1 or args.minutes <= 0:
        parser.error("--clients and --minutes must be positive")
    conductor = Conductor(args)
    try:
        return conductor.run()
    except KeyboardInterrupt:
        conductor.summary(time.monotonic() - conductor.started, 0, 0)
        print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
