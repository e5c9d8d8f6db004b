"""gpu_flight.spark: Spark's Python data source against the real binary, in a local Spark session
(pyspark from PyPI and a Java runtime; skipped, saying which is missing, where either is)."""

import datetime
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from test_flight import unique

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (tests/python/requirements.txt)")
if shutil.which("java") is None:
    pytest.skip("Spark needs a Java runtime (openjdk-17-jre-headless)", allow_module_level=True)

import gpu_flight  # noqa: E402
import gpu_flight.spark  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    import os
    import sys

    from pyspark.sql import SparkSession

    # Spark's Python workers are this interpreter, which has the package.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("gpu-flight-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    gpu_flight.spark.register(session)
    yield session
    session.stop()


def source(n=2000):
    return pa.table(
        {
            "i": pa.array(range(n), pa.int64()),
            "f": pa.array([i / 4 if i % 7 else None for i in range(n)], pa.float64()),
            "s": pa.array([f"s{i % 10}" for i in range(n)]),
            "d": pa.array([datetime.date(2024, 1, 1) + datetime.timedelta(days=i) for i in range(n)]),
        }
    )


def test_read_equals_the_source_and_filters_run_on_the_server(server, spark):
    table = source()
    name = unique("spark")
    with gpu_flight.connect(server.location) as gf:
        gf.put(name, pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=300)))
    df = spark.read.format("gpu_flight").option("uri", server.location).load(name)
    assert df.columns == table.column_names
    got = pa.Table.from_pandas(df.toPandas(), preserve_index=False).cast(table.schema)
    assert got.sort_by("i").equals(table)

    # Comparisons Spark pushes run on the server; LIKE stays Spark's.
    filtered = df.filter("i >= 1000").filter("f IS NOT NULL").filter("s LIKE 's3%'").select("i", "s")
    plan = filtered._jdf.queryExecution().executedPlan().toString()
    assert "BatchScan gpu_flight" in plan and "StartsWith" in plan, plan
    assert "1000" not in plan and "isnotnull(f" not in plan, f"pushed, not filtered by Spark: {plan}"
    want = table.filter(
        pc.and_(
            pc.and_(pc.greater_equal(table["i"], 1000), pc.is_valid(table["f"])),
            pc.starts_with(table["s"], "s3"),
        )
    )
    assert sorted(row.i for row in filtered.collect()) == sorted(want.column("i").to_pylist())


def test_write_appends_and_overwrites_atomically(server, spark):
    table = source(500)
    name = unique("spark-out")
    frame = spark.createDataFrame(table.to_pandas()).repartition(3)
    frame.write.format("gpu_flight").option("uri", server.location).mode("append").save(name)
    frame.limit(10).write.format("gpu_flight").option("uri", server.location).mode("append").save(name)
    with gpu_flight.connect(server.location) as gf:
        assert gf.get(name).num_rows == 510
        frame.write.format("gpu_flight").option("uri", server.location).mode("overwrite").save(name)
        written = gf.get(name)
        assert sorted(written.column("i").to_pylist()) == list(range(500))
        assert gf.list(f"{name}.tmp-") == [], "the temporaries are gone"


def test_a_failed_job_leaves_the_dataset_as_it_was(server, spark):
    from pyspark.sql.functions import udf

    name = unique("spark-fail")
    with gpu_flight.connect(server.location) as gf:
        gf.put(name, source(10))

    @udf("long")
    def explode(i):
        if i == 77:
            raise ValueError("a task failed")
        return i

    frame = spark.range(0, 200, numPartitions=4).withColumnRenamed("id", "i").withColumn("i", explode("i"))
    with pytest.raises(Exception, match="a task failed"):
        frame.write.format("gpu_flight").option("uri", server.location).mode("overwrite").save(name)
    with gpu_flight.connect(server.location) as gf:
        assert gf.get(name).equals(source(10))
        assert gf.list(f"{name}.tmp-") == []
