"""The Arrow C device structs and DLPack tensors an export hands out, built over host memory.

On a GPU the structs point into CUDA IPC mappings (tests/python/test_ipc.py checks those on the
GPU machine). Their layout is the same whatever the device, so here, where CI has no GPU, the
same code describes host arrays as export documents do (every buffer at its offset from a
base, here 0) with device type CPU, and pyarrow and NumPy, independent consumers, import them.
"""

import ctypes
import gc

import numpy as np
import pyarrow as pa
import pytest
from gpu_flight import _cdata

from test_flight import all_types_table


class CountingPin:
    """Counts the structs alive, as an export's lease does."""

    def __init__(self):
        self.held = 0
        self.taken = 0

    def acquire(self):
        self.held += 1
        self.taken += 1

    def release(self):
        self.held -= 1
        assert self.held >= 0, "released more often than acquired"


def document(array):
    """The export document of a host array: buffers by kind, offsets from address 0."""
    layout = array.type
    kinds = _cdata.buffer_kinds(layout)
    buffers = [
        {"kind": kind, "offset": buffer.address, "length": buffer.size}
        for kind, buffer in zip(kinds, array.buffers()[: len(kinds)])
        if buffer is not None
    ]
    if pa.types.is_map(layout):
        entries = pa.StructArray.from_arrays(
            [array.keys, array.items], fields=[layout.key_field, layout.item_field]
        )
        children = [document(entries)]
    elif pa.types.is_list(layout) or pa.types.is_large_list(layout) or pa.types.is_fixed_size_list(layout):
        children = [document(array.values)]
    elif pa.types.is_struct(layout):
        children = [document(array.field(i)) for i in range(layout.num_fields)]
    else:
        children = []
    doc = {"length": len(array), "null_count": array.null_count, "buffers": buffers, "children": children}
    if pa.types.is_dictionary(layout):
        doc["dictionary"] = document(array.dictionary)
    return doc


def part_of(batch, pin):
    return _cdata.DevicePart(
        schema=batch.schema,
        num_rows=batch.num_rows,
        columns=[document(column) for column in batch.columns],
        bases=[0] * batch.num_columns,
        device_type=_cdata.ARROW_DEVICE_CPU,
        device_id=-1,
        sync_event=None,
        pin=pin,
    )


def stream_of(capsule):
    pointer = _cdata.capsule_pointer(capsule, b"arrow_device_array_stream")
    return ctypes.cast(pointer, ctypes.POINTER(_cdata.ArrowDeviceArrayStream))


@pytest.fixture
def batch():
    return all_types_table(300).combine_chunks().to_batches()[0]


def test_every_type_imports_equal_and_is_released(batch):
    pin = CountingPin()
    schema_capsule, array_capsule = _cdata.device_array_capsules(part_of(batch, pin))
    assert pin.held > batch.num_columns, "a struct per array, child and dictionary"
    imported = pa.RecordBatch._import_from_c_device_capsule(schema_capsule, array_capsule)
    assert imported.equals(batch)
    assert imported.schema.metadata == batch.schema.metadata
    del schema_capsule, array_capsule
    gc.collect()
    assert pin.held > 0, "the imported batch still uses the memory"
    del imported
    gc.collect()
    assert pin.held == 0


def test_a_capsule_nobody_consumed_releases_its_structs(batch):
    pin = CountingPin()
    capsules = _cdata.device_array_capsules(part_of(batch, pin))
    assert pin.held > 0
    del capsules
    gc.collect()
    assert pin.held == 0


def test_a_child_moved_out_outlives_its_parent():
    pin = CountingPin()
    batch = pa.record_batch({"s": pa.array(["a", None, "ccc"]), "i": pa.array([1, 2, 3], pa.int16())})
    _, capsule = _cdata.device_array_capsules(part_of(batch, pin))
    device_array = ctypes.cast(
        _cdata.capsule_pointer(capsule, b"arrow_device_array"), ctypes.POINTER(_cdata.ArrowDeviceArray)
    ).contents
    # Move the first child out, as a consumer may: copy the struct, mark the original released.
    moved = _cdata.ArrowArray()
    ctypes.memmove(ctypes.addressof(moved), device_array.array.children[0], ctypes.sizeof(moved))
    device_array.array.children[0].contents.release = _cdata.ReleaseArray()
    held = pin.held
    device_array.array.release(ctypes.pointer(device_array.array))
    assert pin.held == 1, (held, pin.held)
    strings = pa.Array._import_from_c(ctypes.addressof(moved), pa.string())
    assert strings.to_pylist() == ["a", None, "ccc"]
    del strings
    gc.collect()
    assert pin.held == 0
    del capsule
    gc.collect()
    assert pin.held == 0, "the capsule's destructor leaves a released array alone"


def test_the_stream_yields_every_part_then_ends(batch):
    pin = CountingPin()
    parts = [part_of(batch.slice(0, 0) if i == 1 else batch, pin) for i in range(3)]
    capsule = _cdata.device_stream_capsule(_cdata.ARROW_DEVICE_CPU, batch.schema, iter(parts), pin)
    stream = stream_of(capsule)
    assert stream.contents.device_type == _cdata.ARROW_DEVICE_CPU
    schema_memory = ctypes.create_string_buffer(128)  # sizeof(struct ArrowSchema) is 72
    assert stream.contents.get_schema(stream, ctypes.addressof(schema_memory)) == 0
    schema = pa.Schema._import_from_c(ctypes.addressof(schema_memory))
    assert schema.equals(batch.schema)
    got = []
    while True:
        out = _cdata.ArrowDeviceArray()
        assert stream.contents.get_next(stream, ctypes.byref(out)) == 0
        if not out.array.release:
            break
        assert out.device_type == _cdata.ARROW_DEVICE_CPU
        got.append(pa.RecordBatch._import_from_c_device(ctypes.addressof(out), schema))
    assert [b.num_rows for b in got] == [batch.num_rows, 0, batch.num_rows]
    assert pa.Table.from_batches(got).equals(pa.Table.from_batches([batch, batch.slice(0, 0), batch]))
    stream.contents.release(stream)
    assert not stream.contents.release
    del got
    gc.collect()
    assert pin.held == 0
    del capsule
    gc.collect()
    assert pin.held == 0


def test_a_failing_part_is_the_streams_last_error(batch):
    pin = CountingPin()

    def parts():
        yield part_of(batch, pin)
        raise RuntimeError("the export was closed")

    capsule = _cdata.device_stream_capsule(_cdata.ARROW_DEVICE_CPU, batch.schema, parts(), pin)
    stream = stream_of(capsule)
    first = _cdata.ArrowDeviceArray()
    assert stream.contents.get_next(stream, ctypes.byref(first)) == 0
    first.array.release(ctypes.pointer(first.array))
    second = _cdata.ArrowDeviceArray()
    assert stream.contents.get_next(stream, ctypes.byref(second)) != 0
    assert not second.array.release
    message = ctypes.cast(stream.contents.get_last_error(stream), ctypes.c_char_p).value
    assert message == b"RuntimeError: the export was closed"
    del capsule
    gc.collect()
    assert pin.held == 0, "an unconsumed stream is released with its capsule"


def test_a_requested_schema_with_other_fields_or_unknown_keywords_is_refused(batch):
    _cdata.check_request(None, batch.schema, {"future_option": None})
    _cdata.check_request(batch.schema.__arrow_c_schema__(), batch.schema, {})
    cast = pa.schema([pa.field(f.name, pa.string()) for f in batch.schema])
    _cdata.check_request(cast.__arrow_c_schema__(), batch.schema, {})  # best effort: our own schema
    other = pa.schema([pa.field("i8", pa.int64())])
    with pytest.raises(ValueError, match="fields"):
        _cdata.check_request(other.__arrow_c_schema__(), batch.schema, {})
    with pytest.raises(NotImplementedError, match="future_option"):
        _cdata.check_request(None, batch.schema, {"future_option": 1})


def test_types_without_a_described_layout_are_named():
    with pytest.raises(NotImplementedError, match="string_view"):
        _cdata.buffer_kinds(pa.string_view())
    with pytest.raises(NotImplementedError, match="union"):
        _cdata.buffer_kinds(pa.dense_union([pa.field("a", pa.int8())]))


class Tensor:
    def __init__(self, values, pin):
        self.values, self.pin = values, pin

    def __dlpack_device__(self):
        return (_cdata.DLPACK_CPU, 0)

    def __dlpack__(self, **_):
        dtype = _cdata.dlpack_type(self.values.dtype.kind, self.values.dtype.itemsize)
        return _cdata.dlpack_capsule(
            self.values.ctypes.data, len(self.values), dtype, _cdata.DLPACK_CPU, 0, self.pin
        )


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "int64", "float16", "float32", "float64"])
def test_dlpack_tensors_are_views_until_their_deleter_runs(dtype):
    pin = CountingPin()
    values = np.arange(1000).astype(dtype)
    view = np.from_dlpack(Tensor(values, pin))
    assert view.dtype == values.dtype
    assert np.array_equal(view, values)
    assert view.ctypes.data == values.ctypes.data, "no copy"
    assert pin.held == 1
    del view
    gc.collect()
    assert pin.held == 0
    capsule = Tensor(values, pin).__dlpack__()
    assert pin.held == 1
    del capsule
    gc.collect()
    assert pin.held == 0, "a capsule nobody took deletes its tensor"


def test_to_cudf_plans_its_copies_from_the_schema_alone():
    """What `Export.cudf_copies()` answers, without cuDF: the routes cuDF's device import
    gives every type of the all-types batch (python/src/gpu_flight/_cudf.py says why)."""
    from types import SimpleNamespace

    from gpu_flight import _cudf

    schema = all_types_table(4).schema
    one = _cudf.plan(SimpleNamespace(schema=schema, partitions=[None]))
    converted = {"bool", "date32", "timestamp_tz"}
    refused = {"f16", "binary", "large_binary", "fixed_binary", "date64", "time32", "time64"}
    refused |= {"decimal256", "large_list", "fixed_list", "map", "dictionary"}
    assert set(one) == converted | refused
    for name in converted:
        assert _cudf.route(schema.field(name).type)[0] == _cudf.DEVICE, name
    for name in refused:
        assert _cudf.route(schema.field(name).type)[0] == _cudf.HOST, name
    assert "one per byte" in one["bool"] and "America/New_York" in one["timestamp_tz"]
    assert _cudf.route(pa.list_(pa.bool_()))[0] == _cudf.DEVICE
    assert _cudf.route(pa.struct([("a", pa.int8()), ("b", pa.binary())]))[0] == _cudf.HOST
    views = set(schema.names) - set(one)
    assert {"i64", "utf8", "list", "struct", "nested", "all_null"} <= views
    several = _cudf.plan(SimpleNamespace(schema=schema, partitions=[None, None]))
    assert set(several) == set(schema.names)
    assert all("2 partitions" in several[name] for name in views)


def test_cudf_child_names_follow_the_nesting():
    from gpu_flight import _cudf

    nested = pa.list_(pa.struct([("x", pa.list_(pa.int16())), ("y", pa.string())]))
    assert _cudf._child_names(nested) == {
        "offsets": {},
        "item": {"x": {"offsets": {}, "item": {}}, "y": {}},
    }
    assert _cudf._child_names(pa.int64()) == {}


def test_a_document_that_fails_halfway_releases_what_was_filled():
    inner = pa.StructArray.from_arrays([pa.array([1, 2, 3], pa.int8())], names=["c"])
    batch = pa.record_batch(
        {
            "ok": pa.array([1, 2, 3], pa.int64()),
            "s": pa.StructArray.from_arrays([pa.array([1, 2, 3], pa.int32()), inner], names=["a", "b"]),
        }
    )
    pin = CountingPin()
    part = part_of(batch, pin)
    part.columns[1]["children"][1]["children"] = []  # the inner struct's child is missing
    with pytest.raises(ValueError, match="children"):
        _cdata.device_array_capsules(part)
    assert pin.held == 0, "nothing filled before the failure keeps its pin"
    assert pin.taken > 0
    capsule = _cdata.device_stream_capsule(_cdata.ARROW_DEVICE_CPU, batch.schema, iter([part]), pin)
    stream = stream_of(capsule)
    out = _cdata.ArrowDeviceArray()
    assert stream.contents.get_next(stream, ctypes.byref(out)) == 5
    del capsule, stream
    gc.collect()
    assert pin.held == 0


def test_an_interrupt_while_streaming_is_an_error_not_the_end(batch):
    pin = CountingPin()

    def parts():
        yield part_of(batch, pin)
        raise KeyboardInterrupt

    capsule = _cdata.device_stream_capsule(_cdata.ARROW_DEVICE_CPU, batch.schema, parts(), pin)
    stream = stream_of(capsule)
    first = _cdata.ArrowDeviceArray()
    assert stream.contents.get_next(stream, ctypes.byref(first)) == 0
    first.array.release(ctypes.pointer(first.array))
    assert stream.contents.get_next(stream, ctypes.byref(_cdata.ArrowDeviceArray())) == 5
    message = ctypes.cast(stream.contents.get_last_error(stream), ctypes.c_char_p).value
    assert message == b"KeyboardInterrupt: "


SHUTDOWN = """
import sys
sys.path[:0] = [{tests!r}]
import numpy as np
import pyarrow as pa
from test_device_interface import CountingPin, part_of
from gpu_flight import _cdata

pin = CountingPin()
values = np.arange(1000)

def work():
    batch = pa.record_batch({{"i": pa.array(range(3000), pa.int64())}})
    schema, array = _cdata.device_array_capsules(part_of(batch, pin))
    imported = pa.RecordBatch._import_from_c_device_capsule(schema, array)
    capsule = _cdata.dlpack_capsule(values.ctypes.data, 1000, _cdata.dlpack_type("i", 8), 1, 0, pin)
    view = np.from_dlpack(type("T", (), {{"__dlpack__": lambda self, **k: capsule,
                                         "__dlpack_device__": lambda self: (1, 0)}})())
    try:
        raise ValueError("views alive in this frame")
    except ValueError as error:
        saved = error  # a frame <-> traceback cycle, collected at exit with the module's globals
        return saved

kept = work()
print(pin.held > 0, flush=True)
"""


def test_structs_still_held_at_interpreter_exit_are_released_safely():
    import pathlib
    import subprocess
    import sys

    script = SHUTDOWN.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "True"
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]


def test_the_cudf_plan_works_without_pyarrows_newer_decimal_predicates(monkeypatch):
    """pyarrow 17 and 18 (which the package allows) have no is_decimal32/64."""
    from types import SimpleNamespace

    from gpu_flight import _cudf

    monkeypatch.delattr(pa.types, "is_decimal32", raising=False)
    monkeypatch.delattr(pa.types, "is_decimal64", raising=False)
    schema = all_types_table(4).schema
    assert set(_cudf.plan(SimpleNamespace(schema=schema, partitions=[None]))) >= {"bool", "map"}
    assert _cudf.route(pa.decimal128(10, 2))[0] == _cudf.VIEW
