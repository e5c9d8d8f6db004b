"""`Export.to_cudf()`: an export as a cudf.DataFrame, zero-copy where cuDF's layout allows.

Through cuDF's documented device-interface entry points only: `pylibcudf.Table.from_arrow` on
an object with `__arrow_c_device_array__` (cuDF 25.08 and later), which views the buffers in
place and releases the Arrow struct when its last column dies, then
`cudf.DataFrame.from_pylibcudf`, which wraps the table without copying. What that path cannot
view is decided from the schema before anything is imported (`plan`), so a caller can ask
`Export.cudf_copies()` what will be copied, and why, without cuDF:

- cuDF converts on import: bit-packed booleans (one byte per value in cuDF), 32-bit dates
  (cast to datetime64[s]), and the null type (an all-null column is allocated);
- cuDF's device import refuses a type it holds differently (binary, large lists, fixed-size
  lists, maps, date64, dictionaries in a DataFrame, ...): those columns are copied to the host
  and loaded with `cudf.DataFrame.from_arrow`, which converts what cuDF supports at all;
- a dataset held in several partitions is concatenated (a device copy);
- timestamps with a time zone are imported as UTC and localized again (cuDF recomputes them).

Decimals keep their values and scale; cuDF widens their precision to its maximum. Timestamps
inside lists and structs keep their values but lose their time zone (UTC).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa

from . import _cdata

log = logging.getLogger("gpu_flight")


class ColumnView(Protocol):
    """What this module reads of an exported column (an `_export.Column`)."""

    def to_arrow(self) -> pa.Array: ...


class PartitionView(Protocol):
    """What this module reads of an export's partition (an `_export.Partition`)."""

    @property
    def device(self) -> int: ...

    @property
    def columns(self) -> Mapping[str, ColumnView]: ...

    def _part(self) -> _cdata.DevicePart: ...


class ExportView(Protocol):
    """What this module reads of an export (an `_export.Export`, whose `to_cudf` and
    `cudf_copies` call it): a protocol, so that this module need not import the one that
    imports it."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> pa.Schema: ...

    @property
    def partitions(self) -> Sequence[PartitionView]: ...


VIEW = "view"
DEVICE = "device"  # cuDF's device import takes it, converting it (a copy on the GPU)
HOST = "host"  # through the host: cuDF's device import refuses the type


def _is(predicate: str, data_type: pa.DataType) -> bool:
    """`pa.types.<predicate>(data_type)`, False where this pyarrow has no such predicate."""
    check = getattr(pa.types, predicate, None)
    return bool(check(data_type)) if check is not None else False


def route(data_type: pa.DataType) -> tuple[str, str]:
    """How a column of `data_type` reaches cuDF: (VIEW, ""), or (DEVICE or HOST, why)."""
    t = _cdata.storage(data_type)
    if pa.types.is_boolean(t):
        return DEVICE, "cuDF stores booleans one per byte: it converts Arrow's bits on the GPU"
    if pa.types.is_date32(t):
        return DEVICE, "cuDF has no 32-bit dates: it casts them to datetime64[s] on the GPU"
    if pa.types.is_null(t):
        return DEVICE, "cuDF has no null type: it allocates an all-null column"
    if pa.types.is_timestamp(t) and t.tz is not None:
        return DEVICE, f"imported as UTC and localized to {t.tz} again, which cuDF recomputes"
    plain = (
        (pa.types.is_integer(t) or pa.types.is_float32(t) or pa.types.is_float64(t))
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_duration(t)
        or _is("is_decimal32", t)  # pyarrow 19 and later
        or _is("is_decimal64", t)
        or pa.types.is_decimal128(t)
    )
    if plain:
        return VIEW, ""
    if pa.types.is_list(t) or pa.types.is_struct(t):
        worst = (VIEW, "")
        for i in range(t.num_fields):
            inner_type = _cdata.storage(t.field(i).type)
            if pa.types.is_timestamp(inner_type):
                continue  # a view; nested, its time zone is dropped (UTC values)
            inner, why = route(inner_type)
            if inner == HOST:
                return HOST, f"it holds {t.field(i).type}, which cuDF's device import refuses"
            if inner == DEVICE and worst[0] == VIEW:
                worst = (DEVICE, f"of its {t.field(i).type} values: {why}")
        return worst
    return HOST, f"cuDF's device import refuses {t}: copied through the host"


def plan(export: ExportView) -> dict[str, str]:
    """{column: why it is copied} for the columns `to_cudf` cannot hand to cuDF in place."""
    copies = {}
    for field in export.schema:
        kind, why = route(field.type)
        if kind != VIEW:
            copies[field.name] = why
        elif len(export.partitions) > 1:
            copies[field.name] = (
                f"the dataset is held in {len(export.partitions)} partitions, which cuDF "
                "concatenates on the GPU"
            )
    return copies


class _Selection:
    """Some columns of a partition, as a record batch on its device: what pylibcudf takes."""

    def __init__(self, partition: PartitionView, indices: Sequence[int]) -> None:
        self._partition = partition
        self._indices = list(indices)

    def __arrow_c_device_array__(self, requested_schema: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        part = self._partition._part()
        schema = pa.schema([part.schema.field(i) for i in self._indices], metadata=part.schema.metadata)
        _cdata.check_request(requested_schema, schema, kwargs)
        chosen = _cdata.DevicePart(
            schema=schema,
            num_rows=part.num_rows,
            columns=[part.columns[i] for i in self._indices],
            bases=[part.bases[i] for i in self._indices],
            device_type=part.device_type,
            device_id=part.device_id,
            sync_event=part.sync_event,
            pin=part.pin,
        )
        return _cdata.device_array_capsules(chosen)


def _child_names(data_type: pa.DataType) -> dict[str, Any]:
    """cuDF's `child_names` for a column: struct fields by name, a list's element under its
    name after "offsets"."""
    t = _cdata.storage(data_type)
    if pa.types.is_struct(t):
        return {t.field(i).name: _child_names(t.field(i).type) for i in range(t.num_fields)}
    if pa.types.is_list(t):
        return {"offsets": {}, t.value_field.name: _child_names(t.value_type)}
    return {}


def _current_device() -> int:
    """The CUDA runtime's current device here: where cuDF allocates and computes."""
    from cuda.bindings import runtime

    error, device = runtime.cudaGetDevice()
    if error != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGetDevice failed: {error}")
    return int(device)


def _cudf_version(cudf: Any) -> tuple[int, int]:
    major, minor = str(cudf.__version__).split(".")[:2]
    return int(major), int(minor)


def to_cudf(export: ExportView) -> Any:
    try:
        import cudf
        import pylibcudf as plc
    except ImportError as error:
        raise ImportError("to_cudf needs cuDF (the 'cudf' package, 25.08 or later)") from error
    if _cudf_version(cudf) < (25, 8):
        raise ImportError(
            f"to_cudf needs cuDF 25.08 or later (pylibcudf.Table.from_arrow), not {cudf.__version__}"
        )
    current = _current_device()
    elsewhere = sorted({p.device for p in export.partitions if p.device != current})
    if elsewhere:
        raise ValueError(
            f"{export.name!r} is mapped on CUDA device(s) {elsewhere}, and this process computes on "
            f"device {current}: cuDF builds the frame there, so export it onto that GPU with "
            f"client.export(name, device={current})"
        )
    copies = plan(export)
    for name, why in copies.items():
        log.info("to_cudf copies column %r of %r: %s", name, export.name, why)
    fields = list(export.schema)
    on_device = [i for i, f in enumerate(fields) if route(f.type)[0] != HOST]
    through_host = [i for i, f in enumerate(fields) if route(f.type)[0] == HOST]
    frame: Any = None
    if on_device:
        tables = [plc.Table.from_arrow(_Selection(p, on_device)) for p in export.partitions]
        table = tables[0] if len(tables) == 1 else plc.concatenate.concatenate(tables)
        metadata: dict[str, Any] = {"columns": [fields[i].name for i in on_device]}
        if _cudf_version(cudf) >= (26, 4):  # earlier, struct fields are named "0", "1", ...
            metadata["child_names"] = {fields[i].name: _child_names(fields[i].type) for i in on_device}
        frame = cudf.DataFrame.from_pylibcudf(table, metadata=metadata)
        for i in on_device:
            t = _cdata.storage(fields[i].type)
            if pa.types.is_timestamp(t) and t.tz is not None:
                frame[fields[i].name] = frame[fields[i].name].dt.tz_localize("UTC").dt.tz_convert(t.tz)
    if through_host:
        names = [fields[i].name for i in through_host]
        host = pa.Table.from_batches(
            [
                pa.record_batch([p.columns[n].to_arrow() for n in names], names=names)
                for p in export.partitions
            ]
        )
        try:
            loaded = cudf.DataFrame.from_arrow(host)
        except (TypeError, NotImplementedError, ValueError) as error:
            raise TypeError(
                f"cuDF cannot hold columns {names} of {export.name!r} ({error}); "
                "leave them out with client.export(name, columns=...)"
            ) from error
        if frame is None:
            frame = loaded
        else:
            for name in names:  # both have the same RangeIndex
                frame[name] = loaded[name]
    return frame[[f.name for f in fields]]
