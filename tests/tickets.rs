//! A ticket names one version of one store's dataset: it reads what it was issued for, or is
//! refused as NOT_FOUND, across changes, restarts (with and without `--data-dir`) and servers.

mod common;

use std::sync::Arc;

use arrow::array::{ArrayRef, StringArray};
use arrow::record_batch::RecordBatch;
use arrow_flight::Ticket;
use futures::TryStreamExt;
use tonic::Code;

use common::datadir::TempDataDir;
use common::{TestServer, cmd, code_of, path, put};
use gpu_flight::backend::HostBackend;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::{Store, StoreOptions};

fn words(words: &[&str]) -> RecordBatch {
    let column: ArrayRef = Arc::new(StringArray::from(words.to_vec()));
    RecordBatch::try_from_iter([("word", column)]).expect("batch")
}

async fn serve(data_dir: Option<&TempDataDir>) -> TestServer {
    let options = StoreOptions {
        data_dir: data_dir.map(|d| d.path().to_owned()),
        ..StoreOptions::default()
    };
    let store = Store::open(Arc::new(HostBackend::new()), options)
        .await
        .expect("open");
    TestServer::serve(store, ServeOptions::default()).await
}

async fn stop(server: TestServer) {
    let store = server.store.clone();
    server.shutdown_and_wait().await;
    store.close().await;
}

/// The one ticket of `name`'s current version.
async fn ticket(server: &TestServer, name: &str) -> Ticket {
    let info = server
        .client()
        .await
        .get_flight_info(path(name))
        .await
        .expect("info");
    assert_eq!(info.endpoint.len(), 1, "small datasets have one endpoint");
    info.endpoint[0].ticket.clone().expect("ticket")
}

async fn read(server: &TestServer, ticket: Ticket) -> Result<Vec<RecordBatch>, tonic::Code> {
    let mut client = server.client().await;
    match client.do_get(ticket).await {
        Ok(stream) => stream.try_collect().await.map_err(|e| code_of(&e)),
        Err(e) => Err(code_of(&e)),
    }
}

#[tokio::test]
async fn an_old_ticket_never_reads_a_later_version_after_a_restart() {
    let dir = TempDataDir::new("old-ticket");
    let server = serve(Some(&dir)).await;
    let mut client = server.client().await;
    let old = words(&["OLD-A", "OLD-B", "OLD-C"]);
    put(&mut client, cmd("x", "create"), vec![old.clone()])
        .await
        .expect("create");
    let old_ticket = ticket(&server, "x").await;
    let new = words(&["NEW-A", "NEW-B", "NEW-C", "NEW-D"]);
    put(&mut client, cmd("x", "replace"), vec![new.clone()])
        .await
        .expect("replace");
    let new_ticket = ticket(&server, "x").await;
    assert_eq!(read(&server, old_ticket.clone()).await, Err(Code::NotFound));
    stop(server).await;

    let server = serve(Some(&dir)).await;
    assert_eq!(
        read(&server, old_ticket.clone()).await,
        Err(Code::NotFound),
        "the ticket of the replaced version"
    );
    // The current version is the one on disk: its ticket still reads exactly it.
    assert_eq!(read(&server, new_ticket.clone()).await, Ok(vec![new]));
    // A later version has a number of its own, above every one on disk.
    put(&mut server.client().await, cmd("x", "replace"), vec![old])
        .await
        .expect("replace again");
    assert_eq!(read(&server, new_ticket).await, Err(Code::NotFound));
    assert_eq!(read(&server, old_ticket).await, Err(Code::NotFound));
    stop(server).await;
}

#[tokio::test]
async fn a_ticket_of_another_server_or_an_earlier_run_is_refused() {
    // Without --data-dir each run counts versions from the start again.
    let first = serve(None).await;
    put(
        &mut first.client().await,
        cmd("x", "create"),
        vec![words(&["FIRST"])],
    )
    .await
    .expect("put");
    let first_ticket = ticket(&first, "x").await;
    stop(first).await;

    let second = serve(None).await;
    put(
        &mut second.client().await,
        cmd("x", "create"),
        vec![words(&["SECOND"])],
    )
    .await
    .expect("put");
    assert_eq!(read(&second, first_ticket).await, Err(Code::NotFound));
    let second_ticket = ticket(&second, "x").await;
    assert_eq!(
        read(&second, second_ticket.clone()).await,
        Ok(vec![words(&["SECOND"])])
    );

    // Another server holding a dataset of the same name at the same version number.
    let third = serve(None).await;
    put(
        &mut third.client().await,
        cmd("x", "create"),
        vec![words(&["THIRD"])],
    )
    .await
    .expect("put");
    assert_eq!(read(&third, second_ticket).await, Err(Code::NotFound));
    stop(second).await;
    stop(third).await;
}
