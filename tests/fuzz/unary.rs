//! The unary test: mutated GetFlightInfo, GetSchema, PollFlightInfo, DoGet, DoAction,
//! ListFlights, ListActions, Handshake and DoExchange requests against fixture datasets.

mod requests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use arrow::datatypes::*;
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::{
    ActionType, Criteria, FlightClient, FlightData, FlightInfo, HandshakeRequest,
    HandshakeResponse, PollInfo, SchemaResult, Ticket,
};
use bytes::Bytes;
use futures::TryStreamExt;
use prost::Message;
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use tonic::Code;
use tonic::transport::Channel;

use crate::campaign::{Campaign, Checked, Config, Failure, panic_count};
use crate::checks::{
    list_datasets, read_back, same_data, settle, status_class, status_summary, timed, used_bytes,
};
use crate::common::raw::{self, raw_call};
use crate::common::{all_types_batch, int64_batch, path, string_batch};
use crate::corpus::{
    Stream, dictionary_batch, lists_batch, null_column_batch, put_corpus, zero_column_batch,
};
use crate::mutate::{Log, corrupt_utf8, mutate_bytes};
use crate::server::open_channel;

/// Datasets the unary test reads, drops and recreates.
fn fixtures() -> Vec<(&'static str, Vec<RecordBatch>)> {
    vec![
        ("t", vec![int64_batch(250, 3, 0)]),
        ("s", vec![string_batch(120, 3)]),
        ("types", vec![all_types_batch(40)]),
        ("d", vec![dictionary_batch(70, 1)]),
        ("é/ü 2024", vec![int64_batch(10, 1, 5)]),
        // Nested, Null-type and zero-column data over several endpoints (64 rows each).
        ("l", vec![lists_batch(100, 2)]),
        ("n", vec![null_column_batch(150)]),
        ("z", vec![zero_column_batch(130)]),
    ]
}

/// Methods and their weights: the ones with request contents of their own get most cases.
const METHODS: [(&str, u32); 9] = [
    (raw::GET_FLIGHT_INFO, 3),
    (raw::GET_SCHEMA, 2),
    (raw::POLL_FLIGHT_INFO, 1),
    (raw::DO_GET, 5),
    (raw::DO_ACTION, 5),
    (raw::LIST_FLIGHTS, 2),
    (raw::LIST_ACTIONS, 1),
    (raw::HANDSHAKE, 1),
    (raw::DO_EXCHANGE, 1),
];

#[derive(Debug)]
struct UnaryCase {
    id: String,
    method: &'static str,
    requests: Vec<Bytes>,
    /// The rows an unmutated DoGet must return: a short stream is data lost without an error.
    expected_rows: Option<usize>,
    log: Log,
}

struct UnaryRig {
    channel: Channel,
    client: FlightClient,
    fixtures: Vec<(&'static str, Vec<RecordBatch>)>,
    corpus: Vec<Stream>,
    baseline: u64,
}

impl UnaryRig {
    async fn generate(&mut self, id: String, rng: &mut StdRng) -> Checked<UnaryCase> {
        let mut log = Log::default();
        let method = METHODS
            .choose_weighted(rng, |(_, weight)| *weight)
            .expect("methods")
            .0;
        log.push(method.rsplit('/').next().unwrap_or(method));
        let mut expected_rows = None;
        let mut request = match method {
            raw::GET_FLIGHT_INFO | raw::GET_SCHEMA | raw::POLL_FLIGHT_INFO => {
                self.descriptor(rng, &mut log).encode_to_vec()
            }
            raw::DO_GET => {
                let (ticket, rows) = self.ticket(rng, &mut log).await?;
                expected_rows = rows;
                Ticket::new(ticket).encode_to_vec()
            }
            raw::DO_ACTION => self.action(rng, &mut log).encode_to_vec(),
            raw::LIST_FLIGHTS => {
                let expression: Vec<u8> = match rng.random_range(0..5) {
                    0 => Vec::new(),
                    1 => self.fixture_name(rng).as_bytes().to_vec(),
                    2 => b"\xff\xfe".to_vec(),
                    3 => "é".as_bytes()[..1].to_vec(),
                    _ => (0..rng.random_range(1..32)).map(|_| rng.random()).collect(),
                };
                log.push(format!(
                    "criteria {:?}",
                    String::from_utf8_lossy(&expression)
                ));
                Criteria {
                    expression: expression.into(),
                }
                .encode_to_vec()
            }
            raw::HANDSHAKE => HandshakeRequest {
                protocol_version: rng.random(),
                payload: Bytes::from_static(b"user:password"),
            }
            .encode_to_vec(),
            raw::DO_EXCHANGE => {
                let stream = self.corpus.choose(rng).expect("corpus");
                let mut message = stream.messages.first().cloned().unwrap_or_default();
                message.flight_descriptor = Some(path(self.fixture_name(rng)));
                message.encode_to_vec()
            }
            _ => Vec::new(), // ListActions takes Empty
        };
        // Mostly none: undecodable requests stop in tonic, before the server's own parsing.
        let protobuf_mutations = *[0, 0, 0, 0, 1, 2].choose(rng).expect("counts");
        if protobuf_mutations > 0 {
            expected_rows = None;
        }
        for _ in 0..protobuf_mutations {
            if rng.random_bool(0.25) {
                let needle = ["t", "s", "types", "drop", "status", "é"]
                    .choose(rng)
                    .expect("needles");
                corrupt_utf8(&mut request, needle.as_bytes(), rng, &mut log);
            } else {
                mutate_bytes(rng, &mut request, &mut log, "protobuf");
            }
        }
        let mut requests = vec![Bytes::from(request)];
        if rng.random_bool(0.03) {
            // A unary method given two messages, or none.
            if rng.random_bool(0.5) {
                requests.push(requests[0].clone());
                log.push("request sent twice");
            } else {
                requests.clear();
                log.push("no request message");
            }
        }
        Ok(UnaryCase {
            id,
            method,
            requests,
            expected_rows,
            log,
        })
    }

    async fn run(&mut self, case: &UnaryCase, outcomes: &mut BTreeMap<String, u64>) -> Checked<()> {
        let outcome = timed(
            case.method,
            raw_call(self.channel.clone(), case.method, case.requests.clone()),
        )
        .await?;
        let method = case.method.rsplit('/').next().unwrap_or(case.method);
        let code = outcome.as_ref().err().map_or(Code::Ok, tonic::Status::code);
        *outcomes.entry(format!("{method} {code:?}")).or_default() += 1;
        match outcome {
            Ok(replies) => {
                let action = (case.method == raw::DO_ACTION)
                    .then(|| case.requests.first())
                    .flatten()
                    .and_then(|request| arrow_flight::Action::decode(request.clone()).ok())
                    .map(|action| action.r#type);
                let rows = check_replies(case.method, action.as_deref(), &replies).await?;
                if let Some(expected) = case.expected_rows
                    && rows != expected
                {
                    return Err(Failure::new(
                        "DoGet returned the wrong number of rows",
                        format!("{rows} rows, the ticket asks for {expected}"),
                    ));
                }
            }
            Err(status) => {
                let allowed = matches!(
                    status.code(),
                    Code::InvalidArgument
                        | Code::NotFound
                        | Code::Unimplemented
                        | Code::FailedPrecondition
                        | Code::AlreadyExists
                );
                if !allowed {
                    return Err(Failure::new(
                        status_class(method, &status),
                        status_summary(&status),
                    ));
                }
            }
        }
        self.restore_fixtures().await?;
        settle(&self.channel, self.baseline, self.fixtures.len() as u64).await
    }

    /// Puts back fixtures a `drop` removed; fails if anything else changed in the catalog.
    async fn restore_fixtures(&mut self) -> Checked<()> {
        let datasets = list_datasets(&mut self.client).await?;
        let expected: BTreeSet<&str> = self.fixtures.iter().map(|(n, _)| *n).collect();
        let unexpected: Vec<&String> = datasets
            .keys()
            .filter(|n| !expected.contains(n.as_str()))
            .collect();
        if !unexpected.is_empty() {
            return Err(Failure::new(
                "a read-only call created a dataset",
                format!("{unexpected:?}"),
            ));
        }
        for (name, batches) in &self.fixtures {
            if !datasets.contains_key(*name) {
                timed(
                    "DoPut",
                    crate::common::put(
                        &mut self.client,
                        crate::common::cmd(name, "replace"),
                        batches.clone(),
                    ),
                )
                .await?
                .map_err(|e| Failure::new("fixture cannot be restored", e.to_string()))?;
            }
        }
        Ok(())
    }

    /// Reads every fixture back and compares it with what was put.
    async fn check_fixtures(&mut self) -> Checked<()> {
        for (name, batches) in self.fixtures.clone() {
            let read = read_back(&mut self.client, name).await?;
            let sent = Stream {
                label: name,
                schema: batches[0].schema(),
                batches,
                messages: Vec::new(),
                supported: true,
            };
            same_data(&sent, &read).map_err(|e| {
                Failure::new("fixture changed by read-only calls", format!("{name}: {e}"))
            })?;
        }
        Ok(())
    }
}

/// What an OK reply holds must decode as the method's reply type; returns the rows of a DoGet.
async fn check_replies(method: &str, action: Option<&str>, replies: &[Bytes]) -> Checked<usize> {
    let mut rows = 0;
    let fail = |e: String| Failure::new(format!("undecodable {method} reply"), e);
    match method {
        raw::GET_FLIGHT_INFO | raw::LIST_FLIGHTS => {
            for reply in replies {
                let info = FlightInfo::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                info.try_decode_schema().map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::POLL_FLIGHT_INFO => {
            for reply in replies {
                PollInfo::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::GET_SCHEMA => {
            for reply in replies {
                let result =
                    SchemaResult::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                Schema::try_from(&result).map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::DO_GET => {
            let data = replies
                .iter()
                .map(|r| FlightData::decode(r.clone()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| fail(e.to_string()))?;
            let stream = FlightRecordBatchStream::new_from_flight_data(futures::stream::iter(
                data.into_iter().map(Ok),
            ));
            let batches: Vec<RecordBatch> = stream
                .try_collect()
                .await
                .map_err(|e| fail(e.to_string()))?;
            rows = batches.iter().map(RecordBatch::num_rows).sum();
        }
        raw::DO_ACTION => {
            for reply in replies {
                let result =
                    arrow_flight::Result::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                // The Flight and Flight SQL actions answer protobuf; ours JSON.
                match action {
                    Some("CancelFlightInfo") => {
                        arrow_flight::CancelFlightInfoResult::decode(result.body)
                            .map_err(|e| fail(e.to_string()))?;
                    }
                    Some("RenewFlightEndpoint") => {
                        arrow_flight::FlightEndpoint::decode(result.body)
                            .map_err(|e| fail(e.to_string()))?;
                    }
                    Some("CreatePreparedStatement") => {
                        arrow_flight::sql::Any::decode(result.body)
                            .map_err(|e| fail(e.to_string()))?;
                    }
                    _ => {
                        serde_json::from_slice::<serde_json::Value>(&result.body)
                            .map_err(|e| fail(format!("result is not JSON: {e}")))?;
                    }
                }
            }
        }
        raw::LIST_ACTIONS => {
            for reply in replies {
                ActionType::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
            }
        }
        raw::HANDSHAKE => {
            for reply in replies {
                let response =
                    HandshakeResponse::decode(reply.clone()).map_err(|e| fail(e.to_string()))?;
                if response.payload.is_empty() {
                    return Err(fail("a Handshake reply without a token".into()));
                }
            }
        }
        _ => {
            if !replies.is_empty() {
                return Err(fail(format!(
                    "{} replies to an unsupported method",
                    replies.len()
                )));
            }
        }
    }
    Ok(rows)
}

pub(crate) async fn campaign(config: Config, addr: SocketAddr) -> Campaign {
    let channel = open_channel(addr).await;
    let mut client = FlightClient::new(channel.clone());
    let fixtures = fixtures();
    for (name, batches) in &fixtures {
        crate::common::put(&mut client, path(name), batches.clone())
            .await
            .unwrap_or_else(|e| panic!("fixture {name}: {e}"));
    }
    let baseline = used_bytes(&channel)
        .await
        .expect("status after the fixtures");
    let mut rig = UnaryRig {
        channel,
        client,
        fixtures,
        corpus: put_corpus().await,
        baseline,
    };
    let mut campaign = Campaign::new(config);
    for index in campaign.config.indices() {
        let id = format!("unary case {index}");
        let mut rng = campaign.config.rng(index);
        let panics = panic_count();
        let case = match rig.generate(id.clone(), &mut rng).await {
            Ok(case) => case,
            Err(failure) => {
                if !campaign.end(id, "(generating)".into(), Err(failure), panics) {
                    break;
                }
                continue;
            }
        };
        let mutations = case.log.to_string();
        campaign.begin(&case.id, &mutations);
        let outcome = rig.run(&case, &mut campaign.outcomes).await;
        let failed = outcome.is_err() || panic_count() > panics;
        if !campaign.end(case.id.clone(), mutations, outcome, panics) {
            break;
        }
        if failed {
            let _ = rig.restore_fixtures().await;
            if let Ok(used) = used_bytes(&rig.channel).await {
                rig.baseline = used;
            }
        }
    }
    // After a failure without KEEP_GOING the fixtures were not restored; after a hang the
    // server cannot be trusted.
    let fatal = campaign.failures.iter().any(|f| f.failure.fatal);
    if campaign.failures.is_empty() || (campaign.config.keep_going && !fatal) {
        campaign.begin("final fixture check", "none");
        let panics = panic_count();
        let outcome = rig.check_fixtures().await;
        campaign.end("final fixture check".into(), "none".into(), outcome, panics);
    }
    campaign
}
