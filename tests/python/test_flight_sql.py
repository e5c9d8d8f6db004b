"""Flight SQL through ADBC (adbc-driver-flightsql, the Go driver ADBC ships) and Polars, against
the real binary: the catalog, SELECT statements with projection, filters and limits, prepared
statements with parameters, bulk ingestion in every mode, and errors as ADBC's exceptions."""

import datetime
import decimal

import adbc_driver_flightsql.dbapi as flight_sql
import adbc_driver_manager
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from test_flight import all_types_table, get, put, unique


@pytest.fixture
def conn(server):
    with flight_sql.connect(server.location, autocommit=True) as connection:
        yield connection


def query(conn, sql, parameters=None):
    with conn.cursor() as cursor:
        cursor.execute(sql, parameters)
        return cursor.fetch_arrow_table()


def numbers(n=1000):
    return pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "f": pa.array([i / 4 if i % 9 else None for i in range(n)], pa.float64()),
            "s": pa.array([f"s{i % 50}" for i in range(n)]),
            "b": pa.array([i % 3 == 0 for i in range(n)]),
            "d": pa.array([datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in range(n)]),
            "t": pa.array(
                [datetime.datetime(2024, 1, 1) + datetime.timedelta(hours=i) for i in range(n)],
                pa.timestamp("us", tz="UTC"),
            ),
            "m": pa.array([decimal.Decimal(i) / 100 for i in range(n)], pa.decimal128(10, 2)),
        }
    )


def test_select_star_equals_do_get_for_every_type(server, client, conn):
    name = unique("sql")
    put(client, name, all_types_table(500), chunk=97)
    got = query(conn, f'SELECT * FROM "{name}"')
    assert got.equals(get(client, name))


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("i < 10", lambda t: pc.less(t["i"], 10)),
        ("i >= 990 OR i = 3", lambda t: pc.or_(pc.greater_equal(t["i"], 990), pc.equal(t["i"], 3))),
        ("f IS NULL", lambda t: pc.is_null(t["f"])),
        ("f IS NOT NULL AND f > 240.5", lambda t: pc.and_(pc.is_valid(t["f"]), pc.greater(t["f"], 240.5))),
        ("s IN ('s1', 's2')", lambda t: pc.is_in(t["s"], pa.array(["s1", "s2"]))),
        (
            "i BETWEEN 100 AND 110",
            lambda t: pc.and_(pc.greater_equal(t["i"], 100), pc.less_equal(t["i"], 110)),
        ),
        ("NOT b", lambda t: pc.invert(t["b"])),
        ("d >= DATE '2026-01-01'", lambda t: pc.greater_equal(t["d"], pa.scalar(datetime.date(2026, 1, 1)))),
        ("m > 9.5", lambda t: pc.greater(t["m"], pa.scalar(decimal.Decimal("9.50"), pa.decimal128(10, 2)))),
        ("i > 2.5 AND i < 5", lambda t: pc.and_(pc.greater(t["i"], 2), pc.less(t["i"], 5))),
        # More digits than the column's scale: compared exactly, not refused.
        (
            "m > 9.499",
            lambda t: pc.greater_equal(t["m"], pa.scalar(decimal.Decimal("9.50"), pa.decimal128(10, 2))),
        ),
    ],
)
def test_where_filters_like_arrow(client, conn, where, expected):
    table = numbers()
    name = unique("where")
    put(client, name, table, chunk=128)
    got = query(conn, f'SELECT i, s FROM "{name}" WHERE {where}')
    want = table.filter(expected(table)).select(["i", "s"])
    assert got.equals(want), where


def test_projection_and_limit(client, conn):
    table = numbers()
    name = unique("limit")
    put(client, name, table, chunk=100)
    got = query(conn, f'SELECT s, i FROM "{name}" LIMIT 250')
    assert got.equals(table.select(["s", "i"]).slice(0, 250))
    first = query(conn, f'SELECT i FROM "{name}" WHERE i > 500 LIMIT 3')
    assert first.column("i").to_pylist() == [501, 502, 503]
    assert query(conn, f'SELECT i FROM "{name}" LIMIT 0').num_rows == 0


def test_parameters_are_bound_through_a_prepared_statement(client, conn):
    table = numbers()
    name = unique("params")
    put(client, name, table)
    got = query(conn, f'SELECT i FROM "{name}" WHERE i >= ? AND s = ?', (995, "s46"))
    assert got.column("i").to_pylist() == [996]
    with conn.cursor() as cursor:
        cursor.adbc_prepare(f'SELECT i FROM "{name}" WHERE i < ?')
        for bound in (3, 5):
            cursor.execute(f'SELECT i FROM "{name}" WHERE i < ?', (bound,))
            assert cursor.fetch_arrow_table().column("i").to_pylist() == list(range(bound))


def test_prepare_says_the_type_of_each_parameter(client, conn):
    """Each parameter has the type of the column it is compared with, named parameter_1, ...;
    a batch built from that schema binds."""
    table = numbers()
    name = unique("ptypes")
    put(client, name, table, chunk=300)
    sql = (
        f"SELECT i FROM \"{name}\" WHERE i >= ? AND s IN (?, 's9') AND m BETWEEN ? AND ? AND (d = ? OR t < ?)"
    )
    types = [
        pa.int64(),
        pa.string(),
        pa.decimal128(10, 2),
        pa.decimal128(10, 2),
        pa.date32(),
        pa.timestamp("us", tz="UTC"),
    ]
    expected = pa.schema([pa.field(f"parameter_{n}", t) for n, t in enumerate(types, 1)])
    with conn.cursor() as cursor:
        assert cursor.adbc_prepare(sql) == expected
        start = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
        values = [
            100,
            "s1",
            decimal.Decimal("1.00"),
            decimal.Decimal("9.00"),
            datetime.date(2024, 5, 31),
            start + datetime.timedelta(hours=160),
        ]
        cursor.execute(
            sql, pa.record_batch([pa.array([v], t) for v, t in zip(values, types)], schema=expected)
        )
        assert cursor.fetch_arrow_table().column("i").to_pylist() == [101, 109, 151, 159]
        assert cursor.adbc_prepare(f'SELECT * FROM "{name}" LIMIT 5') == pa.schema([])
        # One parameter beside columns of two types has no one type: the spec's Null wildcard.
        mixed = f'SELECT i FROM "{name}" WHERE i = $1 OR f = $1'
        assert cursor.adbc_prepare(mixed) == pa.schema([pa.field("parameter_1", pa.null())])
        cursor.execute(mixed, (9.25,))
        assert cursor.fetch_arrow_table().column("i").to_pylist() == [37]
        with pytest.raises(adbc_driver_manager.dbapi.ProgrammingError, match="has no type") as refused:
            cursor.adbc_prepare(f'SELECT i FROM "{name}" WHERE $1 = $2')
        assert refused.value.status_code == adbc_driver_manager.AdbcStatusCode.INVALID_ARGUMENT


def test_a_statement_made_room_for_is_not_found(client, conn):
    """A statement the server closed (its principal's oldest, making room for the 257th) is
    NOT_FOUND, which ADBC raises as a ProgrammingError with that status and the server's word."""
    name = unique("evicted")
    put(client, name, numbers(10))
    sql = f'SELECT i FROM "{name}" WHERE i < ?'
    newer = []
    with conn.cursor() as oldest:
        oldest.adbc_prepare(sql)
        try:
            for i in range(256):
                cursor = conn.cursor()
                cursor.adbc_prepare(f'SELECT i FROM "{name}" WHERE i > {i % 5}')
                newer.append(cursor)
            with pytest.raises(
                adbc_driver_manager.dbapi.ProgrammingError, match="no such prepared statement"
            ) as gone:
                oldest.execute(sql, (3,))
            assert gone.value.status_code == adbc_driver_manager.AdbcStatusCode.NOT_FOUND
            assert "NOT_FOUND" in str(gone.value)
        finally:
            for cursor in newer:
                cursor.close()
        # Prepared again (another statement replaces it on the cursor), it runs.
        oldest.execute(f'SELECT i FROM "{name}" WHERE i < ? AND i > ?', (3, 0))
        assert oldest.fetch_arrow_table().column("i").to_pylist() == [1, 2]


def test_the_catalog_lists_datasets_as_tables(client, conn):
    table = numbers(10)
    name = unique("cat")
    put(client, name, table)
    assert conn.adbc_get_table_schema(name).equals(table.schema)
    objects = conn.adbc_get_objects(depth="all").read_all().to_pylist()
    assert [catalog["catalog_name"] for catalog in objects] == ["gpu_flight"]
    schemas = objects[0]["catalog_db_schemas"]
    assert [schema["db_schema_name"] for schema in schemas] == ["main"]
    tables = {t["table_name"]: t for t in schemas[0]["db_schema_tables"]}
    assert tables[name]["table_type"] == "TABLE"
    assert [c["column_name"] for c in tables[name]["table_columns"]] == table.column_names
    assert "TABLE" in conn.adbc_get_table_types()
    info = conn.adbc_get_info()
    assert info["vendor_name"] == "gpu-flight"


@pytest.mark.parametrize("mode", ["create", "append", "replace", "create_append"])
def test_ingest_in_every_mode(client, conn, mode):
    table = numbers(100)
    name = unique("ingest")
    if mode in ("append", "replace"):
        put(client, name, table.slice(0, 10))
    with conn.cursor() as cursor:
        assert cursor.adbc_ingest(name, table, mode=mode) in (100, -1)
    expected = {
        "create": table,
        "append": pa.concat_tables([table.slice(0, 10), table]),
        "replace": table,
        "create_append": table,
    }[mode]
    assert get(client, name).equals(expected.combine_chunks()) or get(client, name).equals(expected)


def test_ingest_refusals_leave_datasets_as_they_were(client, conn):
    table = numbers(20)
    name = unique("refuse")
    put(client, name, table)
    with conn.cursor() as cursor:
        with pytest.raises(adbc_driver_manager.dbapi.ProgrammingError, match="ALREADY_EXISTS"):
            cursor.adbc_ingest(name, table, mode="create")
        with pytest.raises(adbc_driver_manager.dbapi.ProgrammingError, match=r"NOT_FOUND.*does not exist"):
            cursor.adbc_ingest(unique("absent"), table, mode="append")
        with pytest.raises(adbc_driver_manager.dbapi.Error, match=r"(?i)temporary"):
            cursor.adbc_ingest(unique("temp"), table, mode="create", temporary=True)
    assert get(client, name).equals(table)


def test_errors_are_adbcs_exceptions_with_the_servers_message(client, conn):
    name = unique("errors")
    put(client, name, numbers(10))
    with pytest.raises(adbc_driver_manager.dbapi.NotSupportedError, match="SELECT"):
        query(conn, f'SELECT i, COUNT(*) FROM "{name}" GROUP BY i')
    with pytest.raises(adbc_driver_manager.dbapi.ProgrammingError, match="nope"):
        query(conn, f'SELECT nope FROM "{name}"')
    with pytest.raises(adbc_driver_manager.dbapi.ProgrammingError, match=r"NOT_FOUND.*does not exist"):
        query(conn, 'SELECT * FROM "no-such-dataset"')
    with pytest.raises(adbc_driver_manager.dbapi.NotSupportedError), conn.cursor() as cursor:
        cursor.execute(f'DELETE FROM "{name}"')


def test_polars_reads_and_writes_over_adbc(server, client, conn):
    polars = pytest.importorskip("polars")
    table = numbers(100)
    name = unique("polars")
    put(client, name, table)
    frame = polars.read_database(f'SELECT i, s FROM "{name}" WHERE i < 7', connection=conn)
    assert frame["i"].to_list() == list(range(7))
    written = unique("polars-out")
    polars.DataFrame({"x": [1, 2, 3]}).write_database(written, connection=conn, engine="adbc")
    polars.DataFrame({"x": [4]}).write_database(
        written, connection=conn, engine="adbc", if_table_exists="append"
    )
    assert get(client, written).column("x").to_pylist() == [1, 2, 3, 4]


def test_tokens_basic_logins_and_roles_apply_to_flight_sql(make_server, tmp_path):
    from conftest import new_token
    from test_security import user_entry

    entry, reader = new_token("analyst", "read")
    path = tmp_path / "tokens.toml"
    path.write_text(entry + "\n" + user_entry("carol", "write", "correct horse"))
    path.chmod(0o600)
    server = make_server("--auth-tokens", str(path))
    table = numbers(10)
    with flight_sql.connect(
        server.location, db_kwargs={"username": "carol", "password": "correct horse"}, autocommit=True
    ) as carol:
        with carol.cursor() as cursor:
            cursor.adbc_ingest("secured", table, mode="create")
        assert query(carol, 'SELECT i FROM "secured" WHERE i < 3').column("i").to_pylist() == [0, 1, 2]
    header = {"adbc.flight.sql.authorization_header": f"Bearer {reader}"}
    with flight_sql.connect(server.location, db_kwargs=header, autocommit=True) as analyst:
        assert query(analyst, 'SELECT * FROM "secured"').equals(table)
        with (
            pytest.raises(adbc_driver_manager.dbapi.Error, match="needs the write role"),
            analyst.cursor() as cursor,
        ):
            cursor.adbc_ingest("secured", table, mode="append")
    with (
        pytest.raises(adbc_driver_manager.dbapi.Error, match="UNAUTHENTICATED"),
        flight_sql.connect(server.location, autocommit=True) as stranger,
    ):
        query(stranger, 'SELECT * FROM "secured"')


def test_long_in_lists_and_parameters_fit_their_tickets(client, conn):
    """A statement's tickets carry its SQL, not its parsed filter: an IN list of thousands of
    items reads (its ticket once exceeded DoGet's 64 KiB request limit), and a statement too
    long for any ticket is refused when planned, saying so."""
    table = numbers(5000)
    name = unique("long")
    put(client, name, table, chunk=500)
    items = ", ".join(str(i) for i in range(0, 5000, 2))
    got = query(conn, f'SELECT i FROM "{name}" WHERE i IN ({items})')
    assert got.column("i").to_pylist() == list(range(0, 5000, 2))
    many = " OR ".join(f"i = {i}" for i in range(4500))  # 53 KB: SQL under 64 KiB, tickets over 48
    with pytest.raises(adbc_driver_manager.dbapi.Error, match="shorten it"):
        query(conn, f'SELECT i FROM "{name}" WHERE {many}')


def test_names_qualified_as_the_catalog_lists_them(client, conn):
    name = unique("qualified")
    put(client, name, numbers(5))
    assert query(conn, f'SELECT i FROM gpu_flight.main."{name}"').num_rows == 5
    assert query(conn, f'SELECT i FROM main."{name}" WHERE i < 2').num_rows == 2


def test_readers_bind_parameters_and_writers_put(make_server, tmp_path):
    from conftest import new_token

    reader_entry, reader = new_token("analyst", "read")
    writer_entry, writer = new_token("loader", "write")
    path = tmp_path / "tokens.toml"
    path.write_text(reader_entry + "\n" + writer_entry)
    path.chmod(0o600)
    server = make_server("--auth-tokens", str(path))

    def connect(token):
        kwargs = {"adbc.flight.sql.authorization_header": f"Bearer {token}"}
        return flight_sql.connect(server.location, db_kwargs=kwargs, autocommit=True)

    with connect(writer) as loader, loader.cursor() as cursor:
        cursor.adbc_ingest("params", numbers(100), mode="create")
    with connect(reader) as analyst:
        got = query(analyst, 'SELECT i FROM "params" WHERE i > ? AND i < ?', (95, 98))
        assert got.column("i").to_pylist() == [96, 97]
        with (
            pytest.raises(adbc_driver_manager.dbapi.Error, match="DoPut needs the write role"),
            analyst.cursor() as cursor,
        ):
            cursor.adbc_ingest("params", numbers(1), mode="append")


def test_a_principal_that_never_closes_its_statements_only_crowds_itself(conn, client):
    name = unique("many")
    put(client, name, numbers(10))
    for i in range(1100):  # beyond the 256 a principal holds, and the 1024 of all: its oldest make room
        with conn.cursor() as cursor:
            cursor.adbc_prepare(f'SELECT i FROM "{name}" WHERE i > {i % 5}')
    assert query(conn, f'SELECT i FROM "{name}" WHERE i > ?', (7,)).column("i").to_pylist() == [8, 9]


def test_plain_reads_filter_on_the_server_with_where(server, client):
    import gpu_flight

    table = numbers(1000)
    name = unique("where")
    put(client, name, table, chunk=100)
    with gpu_flight.connect(server.location) as gf:
        got = gf.get(name, columns=["i", "s"], where="i >= 990 OR s = 's3'")
        want = table.filter(pc.or_(pc.greater_equal(table["i"], 990), pc.equal(table["s"], "s3")))
        assert got.equals(want.select(["i", "s"]))
        assert gf.info(name, where="i < 5").total_records == -1
        with pytest.raises(pa.ArrowInvalid, match="predicate of a WHERE clause"):
            gf.get(name, where="i < 5 LIMIT 2")
        with pytest.raises(pa.ArrowNotImplementedError, match="SELECT"):
            gf.get(name, where="i IN (SELECT 1)")
