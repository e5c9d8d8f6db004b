"""Column projection on the server, through pyarrow.flight: a GetFlightInfo (or GetSchema) CMD
`{"name": ..., "columns": [...], "compression": ...}` whose tickets read only those columns."""

import json

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from test_flight import all_types_table, put, unique


def command(name, columns=None, compression=None):
    """A read CMD descriptor; keys left out when None."""
    body = {"name": name}
    if columns is not None:
        body["columns"] = columns
    if compression is not None:
        body["compression"] = compression
    return flight.FlightDescriptor.for_command(json.dumps(body))


def read(client, info):
    """Every endpoint of `info`, in order, as one table."""
    return pa.concat_tables(client.do_get(e.ticket).read_all() for e in info.endpoints)


@pytest.fixture(scope="module")
def dataset(server):
    """A table of every type, put in several batches (so several endpoints on small settings)."""
    table = all_types_table(300)
    name = unique("proj")
    with server.client() as client:
        put(client, name, table, chunk=64)
    return name, table


COLUMNS = ["dictionary", "i32", "struct", "nested", "utf8", "map", "list", "all_null"]


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_projection_selects_and_orders_columns(client, dataset, compression):
    name, table = dataset
    info = client.get_flight_info(command(name, COLUMNS, compression))
    expected = table.select(COLUMNS)
    assert info.schema.equals(expected.schema, check_metadata=True)
    assert info.total_records == table.num_rows
    got = read(client, info)
    assert got.schema.equals(expected.schema, check_metadata=True)
    assert got.equals(expected)
    # The dictionary column keeps its encoding.
    assert pa.types.is_dictionary(got.schema.field("dictionary").type)


def test_projection_counts_only_its_bytes(client, dataset):
    name, table = dataset
    whole = client.get_flight_info(flight.FlightDescriptor.for_path(name))
    one = client.get_flight_info(command(name, ["i8"]))
    assert 0 < one.total_bytes < whole.total_bytes / 10
    every = client.get_flight_info(command(name, table.column_names))
    assert every.total_bytes == whole.total_bytes
    assert read(client, every).equals(table)


def test_get_schema_answers_the_projection(client, dataset):
    name, table = dataset
    schema = client.get_schema(command(name, ["map", "i64"])).schema
    assert schema.equals(table.select(["map", "i64"]).schema, check_metadata=True)
    # Without columns, the whole schema, as for a PATH.
    assert client.get_schema(command(name)).schema.equals(table.schema, check_metadata=True)


def test_no_columns_reads_everything(client, dataset):
    """Today's behaviour, kept (this one passes on a server without projection too)."""
    name, table = dataset
    for descriptor in [flight.FlightDescriptor.for_path(name), command(name)]:
        assert read(client, client.get_flight_info(descriptor)).equals(table)


def test_tickets_carry_the_projection(server, client, dataset):
    name, table = dataset
    info = client.get_flight_info(command(name, ["utf8", "i16"]))
    ticket = info.endpoints[0].ticket
    # Read twice, the second time on a new connection: the ticket alone says which columns.
    first = client.do_get(ticket).read_all()
    with server.client() as other:
        second = other.do_get(ticket).read_all()
    assert first.column_names == ["utf8", "i16"]
    assert first.equals(second)
    assert first.equals(table.select(["utf8", "i16"]).slice(0, first.num_rows))


@pytest.mark.parametrize(
    "columns, phrases",
    [
        (["nope", "i8", "gone"], ["'nope'", "'gone'", '"i8"', '"dictionary"']),
        (["i8", "i8"], ["repeated", '"i8"']),
        ([], ["at least one"]),
        (["I8"], ["'I8'"]),
    ],
)
def test_bad_columns_are_invalid_argument(client, dataset, columns, phrases):
    name, _ = dataset
    for call in (client.get_flight_info, client.get_schema):
        with pytest.raises(pa.ArrowInvalid, match="invalid argument error") as raised:
            call(command(name, columns))
        for phrase in phrases:
            assert phrase in str(raised.value), (phrase, str(raised.value))


@pytest.mark.parametrize("columns", ['"i8"', "[1]", "[null]", '{"i8": 1}'])
def test_columns_must_be_a_list_of_names(client, dataset, columns):
    name, _ = dataset
    raw = '{"name": %s, "columns": %s}' % (json.dumps(name), columns)
    # A list of names is what is asked for; anything else is refused.
    assert client.get_flight_info(command(name, ["i8"])).schema.names == ["i8"]
    with pytest.raises(pa.ArrowInvalid, match="invalid argument error"):
        client.get_flight_info(flight.FlightDescriptor.for_command(raw))


def test_unknown_dataset_is_not_found_whatever_the_columns(client):
    with pytest.raises(pa.ArrowKeyError, match="not found error"):
        client.get_flight_info(command(unique("missing"), ["x"]))


def test_forged_projections_are_refused(client, dataset):
    name, _ = dataset
    info = client.get_flight_info(command(name, ["i8", "i16"]))
    raw = info.endpoints[0].ticket.ticket
    assert raw.startswith(b"\0gpu-flight-ticket/3\n")
    for forged in [b"[999]", b"[0,0]", b"[]"]:
        bad = raw.replace(b'"columns":[0,1]', b'"columns":' + forged)
        assert bad != raw
        with pytest.raises(pa.ArrowInvalid, match="invalid ticket"):
            client.do_get(flight.Ticket(bad)).read_all()
