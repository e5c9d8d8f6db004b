//! Mutations of what a client sends: bytes, Arrow IPC messages and their sequence, and the
//! protobuf encoding of FlightData.

use arrow_flight::FlightData;
use bytes::Bytes;
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};

use crate::corpus::{NAME, Stream};

/// Values that sit on the edges of the signed and unsigned ranges IPC lengths and offsets use.
const INTERESTING: [u64; 12] = [
    0,
    1,
    u64::MAX, // -1
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 62,
    i64::MAX as u64,
    i64::MIN as u64,
    0x7fff_ffff_ffff_fff8,
];

/// The mutations applied to a case, for the failure report.
#[derive(Debug, Default)]
pub(crate) struct Log(pub(crate) Vec<String>);

impl Log {
    pub(crate) fn push(&mut self, entry: impl Into<String>) {
        self.0.push(entry.into());
    }
}

impl std::fmt::Display for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&self.0.join("; "))
        }
    }
}

/// One byte-level change to `bytes` (used on IPC headers and bodies, protobuf encodings,
/// tickets and action bodies).
pub(crate) fn mutate_bytes(rng: &mut StdRng, bytes: &mut Vec<u8>, log: &mut Log, what: &str) {
    let len = bytes.len();
    match rng.random_range(0..9) {
        0 if len > 0 => {
            let flips = rng.random_range(1..=4);
            let mut at = Vec::new();
            for _ in 0..flips {
                let offset = rng.random_range(0..len);
                let bit = rng.random_range(0..8);
                bytes[offset] ^= 1 << bit;
                at.push(format!("{offset}.{bit}"));
            }
            log.push(format!("{what}: flip bits {}", at.join(",")));
        }
        1 if len > 0 => {
            let offset = rng.random_range(0..len);
            let count = rng.random_range(1..=8).min(len - offset);
            rng.fill(&mut bytes[offset..offset + count]);
            log.push(format!("{what}: {count} random bytes at {offset}"));
        }
        2 if len >= 4 => {
            let width = if len >= 8 && rng.random_bool(0.5) {
                8
            } else {
                4
            };
            let offset = rng.random_range(0..=(len - width) / width) * width;
            let value = *INTERESTING.choose(rng).expect("values");
            let word = &value.to_le_bytes()[..width];
            bytes[offset..offset + width].copy_from_slice(word);
            log.push(format!(
                "{what}: {width}-byte word at {offset} = {word:02x?}"
            ));
        }
        3 if len > 0 => {
            let keep = match rng.random_range(0..3) {
                0 => len.saturating_sub(8),
                1 => len - 1,
                _ => rng.random_range(0..len),
            };
            bytes.truncate(keep);
            log.push(format!("{what}: truncated {len} -> {keep}"));
        }
        4 => {
            let extra = *[1_usize, 7, 8, 64, 4096].choose(rng).expect("sizes");
            let zeros = rng.random_bool(0.5);
            for _ in 0..extra {
                bytes.push(if zeros { 0 } else { rng.random() });
            }
            log.push(format!(
                "{what}: extended by {extra} {} bytes",
                if zeros { "zero" } else { "random" }
            ));
        }
        5 => {
            let offset = rng.random_range(0..=len);
            let count = rng.random_range(1..=8);
            let inserted: Vec<u8> = (0..count).map(|_| rng.random()).collect();
            bytes.splice(offset..offset, inserted);
            log.push(format!("{what}: inserted {count} random bytes at {offset}"));
        }
        6 if len > 0 => {
            let start = rng.random_range(0..len);
            let end = rng.random_range(start..=len.min(start + 16));
            bytes.drain(start..end);
            log.push(format!("{what}: deleted bytes {start}..{end}"));
        }
        7 if len > 0 => {
            let start = rng.random_range(0..len);
            let end = rng.random_range(start..=len.min(start + 16));
            let copy = bytes[start..end].to_vec();
            bytes.splice(end..end, copy);
            log.push(format!("{what}: duplicated bytes {start}..{end}"));
        }
        8 if len > 0 => {
            let offset = rng.random_range(0..len);
            bytes[offset] = *[0xff_u8, 0x80, 0xc3, 0x00].choose(rng).expect("bytes");
            log.push(format!("{what}: byte {offset} = {:#04x}", bytes[offset]));
        }
        _ => {
            bytes.clear();
            log.push(format!("{what}: emptied ({len} bytes)"));
        }
    }
}

/// Replaces the first occurrence of `needle` with bytes that are not UTF-8, as a client that
/// ignores protobuf's string rules would send.
pub(crate) fn corrupt_utf8(bytes: &mut [u8], needle: &[u8], rng: &mut StdRng, log: &mut Log) {
    let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) else {
        log.push(format!(
            "protobuf: invalid UTF-8 (no {:?} to corrupt)",
            String::from_utf8_lossy(needle)
        ));
        return;
    };
    // A lone continuation byte, an invalid byte, or a truncated two-byte sequence.
    let bad = *[0x80_u8, 0xff, 0xc3].choose(rng).expect("bytes");
    let offset = at + needle.len() - 1;
    bytes[offset] = bad;
    log.push(format!(
        "protobuf: invalid UTF-8 {bad:#04x} in {:?}",
        String::from_utf8_lossy(needle)
    ));
}

/// The rows an IPC header declares (record batch or dictionary batch), if it parses.
fn declared_rows(header: &[u8]) -> Option<i64> {
    let message = arrow::ipc::root_as_message(header).ok()?;
    if let Some(batch) = message.header_as_record_batch() {
        return Some(batch.length());
    }
    message
        .header_as_dictionary_batch()?
        .data()
        .map(|b| b.length())
}

/// Rewrites aligned 8-byte words equal to `from` (the batch length and the field node lengths
/// and null counts hold the row count), all of them or one; returns how many.
fn rewrite_words(bytes: &mut [u8], from: u64, to: u64, all: bool, rng: &mut StdRng) -> usize {
    let hits: Vec<usize> = (0..bytes.len() / 8)
        .map(|i| i * 8)
        .filter(|&o| bytes[o..o + 8] == from.to_le_bytes())
        .collect();
    let chosen: Vec<usize> = if all {
        hits
    } else {
        hits.choose(rng).copied().into_iter().collect()
    };
    for &offset in &chosen {
        bytes[offset..offset + 8].copy_from_slice(&to.to_le_bytes());
    }
    chosen.len()
}

/// Indexes of messages with a non-empty header (or body).
fn with_header(messages: &[FlightData]) -> Vec<usize> {
    (0..messages.len())
        .filter(|&i| !messages[i].data_header.is_empty())
        .collect()
}

fn with_body(messages: &[FlightData]) -> Vec<usize> {
    (0..messages.len())
        .filter(|&i| !messages[i].data_body.is_empty())
        .collect()
}

pub(crate) fn edit(bytes: &Bytes, change: impl FnOnce(&mut Vec<u8>)) -> Bytes {
    let mut owned = bytes.to_vec();
    change(&mut owned);
    owned.into()
}

/// One Arrow IPC-level mutation of a message sequence.
pub(crate) fn mutate_ipc(
    rng: &mut StdRng,
    messages: &mut Vec<FlightData>,
    corpus: &[Stream],
    log: &mut Log,
) {
    let n = messages.len();
    match rng.random_range(0..14) {
        0..=2 => {
            let Some(&i) = with_header(messages).choose(rng) else {
                return log.push("header: none to mutate");
            };
            let header = &mut messages[i].data_header;
            *header = edit(header, |b| {
                mutate_bytes(rng, b, log, &format!("header {i}"))
            });
        }
        3..=5 => {
            let Some(&i) = with_body(messages).choose(rng) else {
                return log.push("body: none to mutate");
            };
            let body = &mut messages[i].data_body;
            *body = edit(body, |b| mutate_bytes(rng, b, log, &format!("body {i}")));
        }
        6 => {
            // Row counts the buffers may not back: consistent (every word that held the count)
            // or not (one of them), in one batch or in every batch (sums of counts can overflow
            // where one count alone cannot).
            let batches: Vec<(usize, i64)> = (0..n)
                .filter_map(|i| declared_rows(&messages[i].data_header).map(|r| (i, r)))
                .collect();
            let Some(&(chosen, rows)) = batches.choose(rng) else {
                return log.push("rows: no batch to rewrite");
            };
            let to = match rng.random_range(0..3) {
                0 => *INTERESTING.choose(rng).expect("values"),
                1 => (rows as u64).wrapping_add(rng.random_range(1..=64)),
                _ => (rows as u64).saturating_mul(1 << rng.random_range(1..40)),
            };
            let all = rng.random_bool(0.6);
            let every_batch = rng.random_bool(0.3);
            let mut count = 0;
            for (i, declared) in batches {
                if i != chosen && !every_batch {
                    continue;
                }
                let header = &mut messages[i].data_header;
                *header = edit(header, |b| {
                    count += rewrite_words(b, declared as u64, to, all, rng)
                });
            }
            log.push(format!(
                "message {chosen}: declared rows {rows} -> {to:#x} ({count} word(s), {}{})",
                if all { "all" } else { "one" },
                if every_batch { ", every batch" } else { "" }
            ));
        }
        7 if n >= 2 => {
            let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
            messages.swap(a, b);
            log.push(format!("swapped messages {a} and {b}"));
        }
        8 if n >= 1 => {
            let from = rng.random_range(0..n);
            let to = rng.random_range(0..=n);
            let copy = messages[from].clone();
            messages.insert(to, copy);
            log.push(format!("duplicated message {from} at {to}"));
        }
        9 if n >= 1 => {
            let i = rng.random_range(0..n);
            messages.remove(i);
            log.push(format!("dropped message {i} of {n}"));
        }
        10 if n >= 2 => {
            messages.shuffle(rng);
            log.push("shuffled all messages");
        }
        11 if n >= 1 => {
            if rng.random_bool(0.5) {
                messages.truncate(1);
                log.push("schema only");
            } else {
                let schema = messages.remove(0);
                messages.push(schema);
                log.push("batches before the schema");
            }
        }
        12 => {
            let other = corpus.choose(rng).expect("corpus");
            if let Some(message) = other.messages.choose(rng) {
                let at = rng.random_range(0..=n);
                messages.insert(at, message.clone());
                log.push(format!("spliced a message of {} at {at}", other.label));
            }
        }
        13 if n >= 1 => {
            // The header of one message over the body of another: a plausible header that
            // describes buffers the body does not have.
            let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
            messages[a].data_body = messages[b].data_body.clone();
            log.push(format!("body of message {b} under the header of {a}"));
        }
        _ => {
            let i = rng.random_range(0..n.max(1));
            if let Some(message) = messages.get_mut(i) {
                message.data_body = Bytes::new();
                message.data_header = Bytes::new();
            }
            log.push(format!("emptied message {i}"));
        }
    }
}

/// One protobuf-level mutation of an encoded message.
pub(crate) fn mutate_protobuf(rng: &mut StdRng, encoded: &mut [Vec<u8>], log: &mut Log) {
    if encoded.is_empty() {
        return log.push("protobuf: no message");
    }
    // The first message carries the descriptor: aim at it more often than chance would.
    let i = if rng.random_bool(0.4) {
        0
    } else {
        rng.random_range(0..encoded.len())
    };
    if i == 0 && rng.random_bool(0.3) {
        corrupt_utf8(&mut encoded[0], NAME.as_bytes(), rng, log);
    } else if rng.random_bool(0.3) {
        rearrange_fields(rng, &mut encoded[i], log, i);
    } else {
        mutate_bytes(rng, &mut encoded[i], log, &format!("protobuf {i}"));
    }
}

/// Valid protobuf with the message's meaning, in a layout Flight writers do not use: the server
/// reads FlightData's fields itself (the body apart, aligned), and must read these as prost
/// does.
fn rearrange_fields(rng: &mut StdRng, encoded: &mut Vec<u8>, log: &mut Log, i: usize) {
    let Some(fields) = fields(encoded) else {
        return log.push(format!("protobuf {i}: not fields (left as it was)"));
    };
    let mut fields: Vec<Vec<u8>> = fields.into_iter().map(<[u8]>::to_vec).collect();
    match rng.random_range(0..3) {
        0 => {
            fields.reverse();
            log.push(format!("protobuf {i}: fields reversed"));
        }
        1 => {
            // Field 1000 (data_body), three bytes, first: the later body replaces it.
            fields.insert(0, vec![0xc2, 0x3e, 3, 1, 2, 3]);
            log.push(format!("protobuf {i}: a short body before the real one"));
        }
        _ => {
            // Field 15 (unknown), a varint and a length-delimited one, at a random place.
            let at = rng.random_range(0..=fields.len());
            fields.insert(at, vec![0x78, 0x96, 0x01, 0x7a, 2, 9, 9]);
            log.push(format!("protobuf {i}: unknown fields at {at}"));
        }
    }
    *encoded = fields.concat();
}

/// The top-level fields of an encoded message, each with its tag; `None` where it is not
/// well formed (only what FlightData uses: varints and length-delimited fields).
fn fields(mut bytes: &[u8]) -> Option<Vec<&[u8]>> {
    fn varint(bytes: &[u8]) -> Option<(u64, usize)> {
        let mut value = 0u64;
        for (i, &byte) in bytes.iter().enumerate().take(10) {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Some((value, i + 1));
            }
        }
        None
    }
    let mut fields = Vec::new();
    while !bytes.is_empty() {
        let (tag, tag_len) = varint(bytes)?;
        let (value, value_len) = varint(&bytes[tag_len..])?;
        let len = match tag & 7 {
            0 => tag_len + value_len,
            2 => tag_len + value_len + usize::try_from(value).ok()?,
            _ => return None,
        };
        if len > bytes.len() {
            return None;
        }
        fields.push(&bytes[..len]);
        bytes = &bytes[len..];
    }
    Some(fields)
}
