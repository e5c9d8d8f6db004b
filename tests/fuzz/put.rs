//! The DoPut test: mutated streams over an empty catalog or an existing dataset, each followed
//! by a read back of what was committed or a check that nothing was.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use arrow_flight::{FlightClient, FlightData, PutResult};
use bytes::Bytes;
use prost::Message;
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use tonic::Code;
use tonic::transport::Channel;

use crate::campaign::{Campaign, Checked, Config, Failure, panic_count};
use crate::checks::{
    ReadBack, blocks_returned, drop_dataset, list_datasets, read_back, same_data, server_status,
    settle, status_class, status_summary, timed, used_bytes,
};
use crate::common::path;
use crate::common::raw::raw_do_put;
use crate::corpus::{NAME, Stream, put_corpus};
use crate::descriptors::put_descriptor;
use crate::mutate::{Log, edit, mutate_ipc, mutate_protobuf};
use crate::server::open_channel;

#[derive(Debug)]
struct PutCase {
    id: String,
    /// The corpus stream (index) put unmutated under [`NAME`] first, if any.
    existing: Option<usize>,
    /// The mode the descriptor asks for, when it is a plain one.
    mode: Option<&'static str>,
    messages: Vec<Bytes>,
    log: Log,
}

impl PutCase {
    fn generate(id: String, rng: &mut StdRng, corpus: &[Stream]) -> Self {
        let mut log = Log::default();
        let chosen = rng.random_range(0..corpus.len());
        log.push(format!("stream {}", corpus[chosen].label));
        let existing = rng.random_bool(0.35).then(|| {
            let existing = if rng.random_bool(0.5) {
                chosen
            } else {
                rng.random_range(0..corpus.len())
            };
            log.push(format!("over existing {}", corpus[existing].label));
            existing
        });
        let mut messages = corpus[chosen].messages.clone();
        let ipc_mutations = *[0, 1, 1, 1, 2, 2, 3].choose(rng).expect("counts");
        for _ in 0..ipc_mutations {
            mutate_ipc(rng, &mut messages, corpus, &mut log);
        }
        let (descriptor, mode) = put_descriptor(rng, &mut log);
        if let Some(first) = messages.first_mut() {
            first.flight_descriptor = descriptor;
        } else if let Some(descriptor) = descriptor {
            messages.push(FlightData::new().with_descriptor(descriptor));
            log.push("descriptor alone");
        }
        let mut encoded: Vec<Vec<u8>> = messages.iter().map(Message::encode_to_vec).collect();
        if rng.random_bool(0.2) {
            mutate_protobuf(rng, &mut encoded, &mut log);
        }
        Self {
            id,
            existing,
            mode,
            messages: encoded.into_iter().map(Bytes::from).collect(),
            log,
        }
    }

    /// A corpus stream with one header byte changed, as `known` says.
    fn known(id: String, known: &KnownEdit, corpus: &[Stream]) -> Self {
        let stream = corpus
            .iter()
            .find(|s| s.label == known.stream)
            .unwrap_or_else(|| panic!("no corpus stream {}", known.stream));
        let mut case = Self::unmutated(id, stream);
        let mut message =
            FlightData::decode(case.messages[known.message].clone()).expect("corpus message");
        message.data_header = edit(&message.data_header, |b| {
            b[known.byte] = (known.change)(b[known.byte]);
        });
        case.messages[known.message] = message.encode_to_vec().into();
        case.log = Log(vec![format!("stream {}; {}", stream.label, known.what)]);
        case
    }

    /// A stream sent as is: the corpus entries must themselves pass.
    fn unmutated(id: String, stream: &Stream) -> Self {
        Self {
            id,
            existing: None,
            mode: Some("create"),
            messages: stream.encoded_with(crate::common::cmd(NAME, "create")),
            log: Log(vec![format!("stream {} unmutated", stream.label)]),
        }
    }
}

/// A header edit that once broke the server, replayed by every run whatever its seed: the
/// random search may not come back to it for a long time.
struct KnownEdit {
    stream: &'static str,
    message: usize,
    byte: usize,
    change: fn(u8) -> u8,
    /// How the search logged it.
    what: &'static str,
}

const KNOWN_HEADER_EDITS: [KnownEdit; 2] = [
    // A list's offsets buffer declared 195 bytes long instead of 80: not a whole number of
    // offsets, which Arrow asserted (a panic) validating the list (seed 424242, case 189076).
    KnownEdit {
        stream: "lists",
        message: 2,
        byte: 304,
        change: |_| 0xc3,
        what: "header 2: byte 304 = 0xc3",
    },
    // A views buffer declared 306 bytes long, 19 views and 2 bytes: the same assertion (seed
    // 424242, case 249492).
    KnownEdit {
        stream: "views",
        message: 1,
        byte: 176,
        change: |b| b ^ 1 << 1,
        what: "header 1: flip bits 176.1",
    },
];

/// Everything the DoPut test shares across cases.
struct PutRig {
    channel: Channel,
    client: FlightClient,
    corpus: Vec<Stream>,
    baseline: u64,
}

impl PutRig {
    /// Puts `stream` unmutated under [`NAME`]; returns whether the dataset now exists (a type
    /// the server does not support may be refused, nothing else).
    async fn put_stream(&self, stream: &Stream) -> Checked<bool> {
        let encoded = stream.encoded_with(path(NAME));
        match timed("DoPut", raw_do_put(self.channel.clone(), encoded)).await? {
            Ok(_) => Ok(true),
            Err(status) if !stream.supported && status.code() == Code::InvalidArgument => Ok(false),
            Err(status) => Err(Failure::new(
                "valid put refused",
                format!("{} put first: {}", stream.label, status_summary(&status)),
            )),
        }
    }

    async fn run(
        &mut self,
        case: &PutCase,
        expect_ok: bool,
        outcomes: &mut BTreeMap<String, u64>,
    ) -> Checked<()> {
        let existing = match case.existing {
            Some(existing) if self.put_stream(&self.corpus[existing]).await? => Some(existing),
            _ => None,
        };
        let outcome = timed(
            "DoPut",
            raw_do_put(self.channel.clone(), case.messages.clone()),
        )
        .await?;
        let code = outcome.as_ref().err().map_or(Code::Ok, tonic::Status::code);
        *outcomes.entry(format!("{code:?}")).or_default() += 1;
        let summary = match &outcome {
            Ok(replies) => Some(put_summary(replies)?),
            Err(status) => {
                let allowed = matches!(
                    status.code(),
                    Code::InvalidArgument | Code::ResourceExhausted
                ) || (status.code() == Code::AlreadyExists && existing.is_some());
                if !allowed || expect_ok {
                    return Err(Failure::new(
                        status_class("DoPut", status),
                        status_summary(status),
                    ));
                }
                None
            }
        };
        let datasets = list_datasets(&mut self.client).await?;
        let names: BTreeSet<&str> = datasets.keys().map(String::as_str).collect();
        let mut reads = BTreeMap::new();
        for name in &names {
            reads.insert(*name, read_back(&mut self.client, name).await?);
        }
        match &summary {
            None => self.check_untouched(existing, &names, &reads)?,
            Some(summary) => self.check_committed(case, existing, summary, &names, &reads)?,
        }
        server_status(&self.channel).await?;
        for name in &names {
            drop_dataset(&self.channel, name).await?;
        }
        settle(&self.channel, self.baseline, 0).await?;
        blocks_returned().await
    }

    /// A failed put leaves the catalog as it was.
    fn check_untouched(
        &self,
        existing: Option<usize>,
        names: &BTreeSet<&str>,
        reads: &BTreeMap<&str, ReadBack>,
    ) -> Checked<()> {
        let expected: BTreeSet<&str> = existing.iter().map(|_| NAME).collect();
        if *names != expected {
            return Err(Failure::new(
                "failed put left a trace",
                format!("datasets {names:?}, expected {expected:?}"),
            ));
        }
        if let (Some(existing), Some(read)) = (existing, reads.get(NAME)) {
            same_data(&self.corpus[existing], read)
                .map_err(|e| Failure::new("failed put changed the dataset", e))?;
        }
        Ok(())
    }

    /// A committed put is visible, whole, and what its summary says.
    fn check_committed(
        &self,
        case: &PutCase,
        existing: Option<usize>,
        summary: &serde_json::Value,
        names: &BTreeSet<&str>,
        reads: &BTreeMap<&str, ReadBack>,
    ) -> Checked<()> {
        let fail =
            |what: &str| Failure::new(what, format!("summary {summary}, datasets {names:?}"));
        let name = summary["name"]
            .as_str()
            .ok_or_else(|| fail("put summary lacks a name"))?;
        let read = reads
            .get(name)
            .ok_or_else(|| fail("committed dataset not listed"))?;
        let total_rows = summary["total_rows"].as_u64();
        if total_rows != Some(read.rows() as u64) {
            return Err(Failure::new(
                "put summary disagrees with the data",
                format!("summary {summary}, {} rows read back", read.rows()),
            ));
        }
        let extra: Vec<&&str> = names
            .iter()
            .filter(|n| **n != name && !(existing.is_some() && **n == NAME))
            .collect();
        if !extra.is_empty() {
            return Err(fail("put created more than one dataset"));
        }
        let mode = summary["mode"].as_str();
        if name == NAME
            && let Some(existing) = existing
        {
            let before = self.corpus[existing].rows() as u64;
            let rows = summary["rows"].as_u64().unwrap_or(u64::MAX);
            match mode {
                Some("create") => return Err(fail("create replaced an existing dataset")),
                Some("append") if total_rows != before.checked_add(rows) => {
                    return Err(Failure::new(
                        "append lost or invented rows",
                        format!("{before} rows before, summary {summary}"),
                    ));
                }
                _ => {}
            }
        }
        if let (Some(asked), Some(got)) = (case.mode, mode)
            && asked != got
        {
            return Err(fail("put summary reports another mode"));
        }
        Ok(())
    }
}

/// The one PutResult a committed put returns, parsed.
fn put_summary(replies: &[Bytes]) -> Checked<serde_json::Value> {
    let [reply] = replies else {
        return Err(Failure::new(
            "DoPut reply malformed",
            format!("{} PutResults", replies.len()),
        ));
    };
    let result = PutResult::decode(reply.clone())
        .map_err(|e| Failure::new("DoPut reply malformed", e.to_string()))?;
    serde_json::from_slice(&result.app_metadata)
        .map_err(|e| Failure::new("DoPut reply malformed", format!("summary not JSON: {e}")))
}

/// Empties the catalog after a failed case so the next one starts clean, and takes what memory
/// stays held as the new baseline (the leak has been reported).
async fn recover(channel: &Channel, client: &mut FlightClient) -> Option<u64> {
    // By name first: listing is what may have failed.
    let _ = drop_dataset(channel, NAME).await;
    if let Ok(datasets) = list_datasets(client).await {
        for name in datasets.keys() {
            let _ = drop_dataset(channel, name).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    used_bytes(channel).await.ok()
}

pub(crate) async fn campaign(config: Config, addr: SocketAddr) -> Campaign {
    let channel = open_channel(addr).await;
    let client = FlightClient::new(channel.clone());
    let corpus = put_corpus().await;
    let baseline = used_bytes(&channel).await.expect("status before any case");
    let mut rig = PutRig {
        channel,
        client,
        corpus,
        baseline,
    };
    let mut campaign = Campaign::new(config);
    let mut cases = Vec::new();
    if campaign.config.only.is_none() {
        for (i, stream) in rig.corpus.iter().enumerate() {
            cases.push((
                PutCase::unmutated(format!("corpus {i}"), stream),
                stream.supported,
            ));
        }
        for (i, known) in KNOWN_HEADER_EDITS.iter().enumerate() {
            cases.push((
                PutCase::known(format!("known {i}"), known, &rig.corpus),
                false,
            ));
        }
    }
    for index in campaign.config.indices() {
        let mut rng = campaign.config.rng(index);
        cases.push((
            PutCase::generate(format!("put case {index}"), &mut rng, &rig.corpus),
            false,
        ));
    }
    for (case, expect_ok) in cases {
        let mutations = case.log.to_string();
        campaign.begin(&case.id, &mutations);
        let panics = panic_count();
        let outcome = rig.run(&case, expect_ok, &mut campaign.outcomes).await;
        let failed = outcome.is_err() || panic_count() > panics;
        if !campaign.end(case.id.clone(), mutations, outcome, panics) {
            break;
        }
        if failed && let Some(baseline) = recover(&rig.channel, &mut rig.client).await {
            rig.baseline = baseline;
        }
    }
    campaign
}
