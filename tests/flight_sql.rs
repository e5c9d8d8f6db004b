//! Flight SQL prepared statements through arrow-flight's own Flight SQL client: the parameter
//! schema a statement is prepared with, binding a batch built from it, and the code a handle
//! that names no statement gets. (The ADBC side is tests/python/test_flight_sql.py.)

mod common;

use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int32Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use arrow_flight::FlightInfo;
use arrow_flight::sql::client::FlightSqlServiceClient;
use futures::TryStreamExt;
use tonic::Code;
use tonic::transport::Channel;

use common::{TestServer, code_of, path, put};
use gpu_flight::backend::HostBackend;

fn numbers(rows: i32) -> RecordBatch {
    let i: ArrayRef = Arc::new(Int64Array::from_iter_values(0..i64::from(rows)));
    let n: ArrayRef = Arc::new(Int32Array::from_iter(
        (0..rows).map(|v| (v % 7 != 0).then_some(v)),
    ));
    let f: ArrayRef = Arc::new(Float64Array::from_iter_values(
        (0..rows).map(|v| f64::from(v) / 4.0),
    ));
    let s: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|v| format!("s{}", v % 10)),
    ));
    RecordBatch::try_from_iter([("i", i), ("n", n), ("f", f), ("s", s)]).expect("batch")
}

async fn serve() -> (TestServer, FlightSqlServiceClient<Channel>) {
    let server = TestServer::start(Arc::new(HostBackend::new())).await;
    put(
        &mut server.client().await,
        path("numbers"),
        vec![numbers(100)],
    )
    .await
    .expect("put");
    let sql = FlightSqlServiceClient::new(server.channel().await);
    (server, sql)
}

async fn rows(sql: &mut FlightSqlServiceClient<Channel>, info: FlightInfo) -> Vec<i64> {
    let mut values = Vec::new();
    for endpoint in info.endpoint {
        let ticket = endpoint.ticket.expect("a ticket");
        let batches: Vec<RecordBatch> = sql
            .do_get(ticket)
            .await
            .expect("do_get")
            .try_collect()
            .await
            .expect("rows");
        for batch in batches {
            let column = batch
                .column_by_name("i")
                .expect("i")
                .as_any()
                .downcast_ref::<Int64Array>()
                .expect("int64")
                .clone();
            values.extend(column.values().iter().copied());
        }
    }
    values
}

#[tokio::test]
async fn prepared_statements_say_the_type_of_each_parameter_and_bind_batches_built_from_it() {
    let (_server, mut sql) = serve().await;
    let mut statement = sql
        .prepare(
            "SELECT i FROM numbers WHERE i >= ? AND s IN (?, 'zz') AND f BETWEEN ? AND ? \
             AND (n = ? OR n IS NULL)"
                .to_owned(),
            None,
        )
        .await
        .expect("prepared");
    let expected = Schema::new(
        [
            DataType::Int64,
            DataType::Utf8,
            DataType::Float64,
            DataType::Float64,
            DataType::Int32,
        ]
        .into_iter()
        .enumerate()
        .map(|(i, t)| Field::new(format!("parameter_{}", i + 1), t, true))
        .collect::<Vec<_>>(),
    );
    assert_eq!(statement.parameter_schema().expect("schema"), &expected);
    assert_eq!(
        statement.dataset_schema().expect("schema"),
        &Schema::new(vec![Field::new("i", DataType::Int64, false)])
    );

    // A client builds the batch it binds from the parameter schema, as JDBC does.
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(vec![50])),
        Arc::new(StringArray::from(vec!["s3"])),
        Arc::new(Float64Array::from(vec![0.0])),
        Arc::new(Float64Array::from(vec![20.0])),
        Arc::new(Int32Array::from(vec![None])),
    ];
    let parameters = RecordBatch::try_new(Arc::new(expected), columns).expect("parameters");
    statement.set_parameters(parameters).expect("set");
    let info = statement.execute().await.expect("executed");
    // n = NULL is never true: the rows left are those where n is NULL (multiples of 7).
    assert_eq!(rows(&mut sql, info).await, vec![63]);

    let plain = sql
        .prepare("SELECT * FROM numbers LIMIT 3".to_owned(), None)
        .await
        .expect("prepared");
    assert_eq!(
        plain.parameter_schema().expect("schema"),
        &Schema::empty(),
        "no parameters"
    );
}

#[tokio::test]
async fn a_parameter_compared_with_no_column_is_refused_when_prepared() {
    let (_server, mut sql) = serve().await;
    for (text, code, says) in [
        (
            "SELECT * FROM numbers WHERE $1 = $2",
            Code::InvalidArgument,
            "a parameter compared with a parameter has no type",
        ),
        (
            "SELECT * FROM numbers WHERE ? < 3",
            Code::InvalidArgument,
            "a parameter compared with a literal has no type",
        ),
        (
            "SELECT * FROM numbers WHERE i = 1 OR ? IS NULL",
            Code::InvalidArgument,
            "a parameter where a column was expected has no type",
        ),
        (
            "SELECT * FROM numbers LIMIT ?",
            Code::Unimplemented,
            "a parameter in LIMIT is not supported",
        ),
    ] {
        let error = sql
            .prepare(text.to_owned(), None)
            .await
            .expect_err("refused");
        assert_eq!(code_of(&error), code, "{text}: {error}");
        assert!(error.to_string().contains(says), "{text}: {error}");
    }
}

#[tokio::test]
async fn a_closed_or_unknown_handle_is_not_found_except_to_close() {
    let (_server, mut sql) = serve().await;
    let statement = sql
        .prepare("SELECT i FROM numbers WHERE i < ?".to_owned(), None)
        .await
        .expect("prepared");
    let mut closed = statement.clone();
    statement.close().await.expect("closed");

    let execute = closed
        .execute()
        .await
        .expect_err("executing a closed statement");
    let bind = {
        let parameters =
            RecordBatch::try_from_iter([("p", Arc::new(Int64Array::from(vec![3])) as ArrayRef)])
                .expect("batch");
        closed.set_parameters(parameters).expect("set");
        closed
            .execute()
            .await
            .expect_err("binding to a closed statement")
    };
    for (what, error) in [("execute", execute), ("bind", bind)] {
        assert_eq!(code_of(&error), Code::NotFound, "{what}: {error}");
        assert!(
            error.to_string().contains("no such prepared statement"),
            "{what}: {error}"
        );
    }
    // Closing what is gone succeeds: ADBC closes a cursor's statement before preparing the
    // cursor's next one, and a cursor must stay usable after the server closed its statement.
    closed.close().await.expect("closing twice");
}
