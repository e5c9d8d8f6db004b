//! What both tests check after a case: calls answer in time, `status` and the memory budget
//! settle back to their baseline, and what a dataset reads back is what was put.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::datatypes::*;
use arrow::record_batch::RecordBatch;
use arrow_flight::{Action, FlightClient, FlightInfo};
use bytes::Bytes;
use futures::TryStreamExt;
use prost::Message;
use tonic::transport::Channel;

use crate::campaign::{Checked, Failure};
use crate::common::path;
use crate::common::raw::{self, raw_unary};
use crate::corpus::Stream;

/// Longest any single call may take; beyond it the server is considered hung.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long memory may take to return after datasets are dropped.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Awaits `future`, failing (fatally) if it takes longer than [`CALL_TIMEOUT`].
pub(crate) async fn timed<T>(
    what: &str,
    future: impl std::future::Future<Output = T>,
) -> Checked<T> {
    tokio::time::timeout(CALL_TIMEOUT, future)
        .await
        .map_err(|_| Failure {
            class: format!("hang: {what}"),
            detail: format!("{what} did not answer in {} s", CALL_TIMEOUT.as_secs()),
            fatal: true,
        })
}

/// The class of a refused call: its code and the start of its message, so that one frequent
/// cause (say, protobuf the server cannot decode) does not hide the others.
pub(crate) fn status_class(what: &str, status: &tonic::Status) -> String {
    const PROTOBUF: &str = "failed to decode Protobuf message";
    let message: String = status
        .message()
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect();
    let message = match message.find(PROTOBUF) {
        Some(at) => &message[..at + PROTOBUF.len()],
        None => &message,
    };
    let cause: String = message.splitn(3, ':').take(2).collect::<Vec<_>>().join(":");
    let cause: String = cause.chars().take(80).collect();
    format!("{what} answered {:?} ({})", status.code(), cause.trim())
}

pub(crate) fn status_summary(status: &tonic::Status) -> String {
    let message: String = status.message().chars().take(300).collect();
    format!("{:?}: {message}", status.code())
}

/// The `status` action, through raw gRPC so its failure is a finding rather than a panic.
pub(crate) async fn server_status(channel: &Channel) -> Checked<serde_json::Value> {
    let request = Action::new("status", "").encode_to_vec();
    let replies = timed(
        "status",
        raw_unary(channel.clone(), raw::DO_ACTION, request.into()),
    )
    .await?
    .map_err(|s| Failure::new("status fails", status_summary(&s)))?;
    let [reply] = replies.as_slice() else {
        return Err(Failure::new(
            "status fails",
            format!("{} replies", replies.len()),
        ));
    };
    let result = arrow_flight::Result::decode(reply.clone())
        .map_err(|e| Failure::new("status fails", format!("undecodable Result: {e}")))?;
    serde_json::from_slice(&result.body)
        .map_err(|e| Failure::new("status fails", format!("status is not JSON: {e}")))
}

pub(crate) async fn used_bytes(channel: &Channel) -> Checked<u64> {
    let status = server_status(channel).await?;
    status["devices"][0]["used_bytes"]
        .as_u64()
        .ok_or_else(|| Failure::new("status fails", format!("no used_bytes in {status}")))
}

/// Polls until `used_bytes` is back to `baseline` and `status` counts `datasets` datasets.
/// (Like `crate::common::wait_until`, but a miss is a recorded failure, not a panic, so that
/// KEEP_GOING can go on.)
pub(crate) async fn settle(channel: &Channel, baseline: u64, datasets: u64) -> Checked<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let status = server_status(channel).await?;
        let used = status["devices"][0]["used_bytes"].as_u64();
        let count = status["datasets"].as_u64();
        if used == Some(baseline) && count == Some(datasets) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Failure::new(
                "memory not returned",
                format!(
                    "after {} s used_bytes is {used:?} (baseline {baseline}) and datasets \
                     {count:?} (expected {datasets})",
                    SETTLE_TIMEOUT.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every body block and pinned copy is freed (`blocks`; none for other backends).
pub(crate) async fn blocks_returned() -> Checked<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let held = crate::blocks::held();
        if held == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Failure::new(
                "body blocks not returned",
                format!(
                    "after {} s {held} bytes of body blocks and pinned copies are still held",
                    SETTLE_TIMEOUT.as_secs(),
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every dataset ListFlights reports, by name.
pub(crate) async fn list_datasets(
    client: &mut FlightClient,
) -> Checked<BTreeMap<String, FlightInfo>> {
    let infos: Vec<FlightInfo> = timed("ListFlights", async {
        client.list_flights(Bytes::new()).await?.try_collect().await
    })
    .await?
    .map_err(|e| Failure::new("ListFlights fails", e.to_string()))?;
    let mut datasets = BTreeMap::new();
    for info in infos {
        let name = info
            .flight_descriptor
            .as_ref()
            .and_then(|d| d.path.first().cloned())
            .ok_or_else(|| Failure::new("ListFlights fails", "a FlightInfo without a name"))?;
        datasets.insert(name, info);
    }
    Ok(datasets)
}

/// What reading a dataset back produced.
#[derive(Debug)]
pub(crate) struct ReadBack {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
}

impl ReadBack {
    pub(crate) fn rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

/// Reads a dataset completely: GetFlightInfo, GetSchema, and DoGet of every endpoint, each
/// decoded (and so validated) by arrow-flight's client.
pub(crate) async fn read_back(client: &mut FlightClient, name: &str) -> Checked<ReadBack> {
    let fail = |what: &str, e: String| Failure::new(format!("read back: {what} fails"), e);
    let info = timed("GetFlightInfo", client.get_flight_info(path(name)))
        .await?
        .map_err(|e| fail("GetFlightInfo", e.to_string()))?;
    let total_records = info.total_records;
    let schema: SchemaRef = Arc::new(
        info.clone()
            .try_decode_schema()
            .map_err(|e| fail("GetFlightInfo schema", e.to_string()))?,
    );
    let schema_again = timed("GetSchema", client.get_schema(path(name)))
        .await?
        .map_err(|e| fail("GetSchema", e.to_string()))?;
    if &schema_again != schema.as_ref() {
        return Err(Failure::new(
            "read back: schemas disagree",
            format!("GetFlightInfo says {schema}, GetSchema says {schema_again}"),
        ));
    }
    let mut batches = Vec::new();
    for (index, endpoint) in info.endpoint.into_iter().enumerate() {
        let ticket = endpoint
            .ticket
            .ok_or_else(|| fail("GetFlightInfo", format!("endpoint {index} has no ticket")))?;
        let mut part: Vec<RecordBatch> = timed("DoGet", async {
            client.do_get(ticket).await?.try_collect().await
        })
        .await?
        .map_err(|e| fail("DoGet", format!("endpoint {index}: {e}")))?;
        batches.append(&mut part);
    }
    for batch in &batches {
        if batch.schema().fields() != schema.fields() {
            return Err(Failure::new(
                "read back: schemas disagree",
                format!("DoGet sent {} for a dataset of {schema}", batch.schema()),
            ));
        }
    }
    let read = ReadBack { schema, batches };
    if read.rows() as i64 != total_records {
        return Err(Failure::new(
            "read back: row counts disagree",
            format!(
                "GetFlightInfo says {total_records} rows, DoGet sent {}",
                read.rows()
            ),
        ));
    }
    Ok(read)
}

/// Whether `read` holds exactly `sent` (schema and values).
pub(crate) fn same_data(sent: &Stream, read: &ReadBack) -> Result<(), String> {
    if read.schema != sent.schema {
        return Err(format!(
            "schema changed from {} to {}",
            sent.schema, read.schema
        ));
    }
    let concat = |batches: &[RecordBatch]| arrow::compute::concat_batches(&sent.schema, batches);
    let expected = concat(&sent.batches).map_err(|e| format!("concat: {e}"))?;
    let got = concat(&read.batches).map_err(|e| format!("concat: {e}"))?;
    if expected != got {
        return Err(format!(
            "data changed: {} rows expected, {} read, contents differ",
            expected.num_rows(),
            got.num_rows()
        ));
    }
    Ok(())
}

pub(crate) async fn drop_dataset(channel: &Channel, name: &str) -> Checked<()> {
    let request = Action::new("drop", serde_json::json!({ "name": name }).to_string());
    timed(
        "drop",
        raw_unary(
            channel.clone(),
            raw::DO_ACTION,
            request.encode_to_vec().into(),
        ),
    )
    .await?
    .map(|_| ())
    .map_err(|s| Failure::new("drop fails", format!("{name:?}: {}", status_summary(&s))))
}
