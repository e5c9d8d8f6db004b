//! Unix-socket connections: the `:authority` that stock gRPC clients send there, made one h2
//! accepts.
//!
//! gRPC C-core 1.57 and newer (pyarrow's `grpc+unix://`, grpcio's `unix:`) send the socket's
//! %-encoded path (`run%2Fgpu-flight.sock`) as the HTTP/2 `:authority`. The `http` crate refuses
//! a `%` in an authority, so h2 resets every such request as malformed before hyper or tonic
//! see it, and offers no setting to accept it
//! ([hyperium/h2#487](https://github.com/hyperium/h2/pull/487)). [`AuthorityRewriter`] sits
//! between a Unix socket and the HTTP/2 server and replaces an authority the `http` crate would
//! refuse with `localhost` in the header blocks the client sends; valid ones are kept.
//!
//! HPACK makes each header block depend on the blocks before it on the connection (the dynamic
//! table), so every block is decoded, with the table the client's encoder keeps, and encoded
//! again as literals without indexing: the server's table then stays empty, and nothing we send
//! refers to it. HEADERS and CONTINUATION frames are gathered (up to a bound; more closes the
//! connection) and sent again as frames of at most 16 KiB, a size every HTTP/2 server accepts.
//! Every other frame passes byte for byte, DATA payloads without a copy (they stay in the
//! server's read buffer; only the rest of a read that held header frames is copied once), and
//! the server's bytes are not touched. A connection that does not
//! start with the HTTP/2 preface is passed through untouched, for the server to refuse.

use std::borrow::Cow;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use loona_hpack::Decoder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::peer::Peer;

/// What every HTTP/2 client with prior knowledge sends first.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_BYTES: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
const PRIORITY_BYTES: usize = 5;
/// The largest frame we send: SETTINGS_MAX_FRAME_SIZE's initial value, which a server cannot
/// go below.
const FRAME_BYTES: usize = 16_384;
/// The dynamic table the client's encoder may use: SETTINGS_HEADER_TABLE_SIZE, which hyper's
/// server leaves at its default.
const TABLE_BYTES: usize = 4_096;
/// Bytes one header block may take as the client sends it, padding included.
const MAX_BLOCK_BYTES: usize = 64 << 10;
/// Huffman-coded strings one block may hold, and their bytes. The decoder takes some 20 µs a
/// string and 0.2 µs a byte, so these bound what one block costs (about 25 ms) where h2 would
/// spend little: two strings a field, for the 512 fields hyper's 16 KiB list can hold, and
/// twice those 16 KiB.
const MAX_HUFFMAN_STRINGS: usize = 1_024;
const MAX_HUFFMAN_BYTES: usize = 32 << 10;
/// Bytes one decoded header list may take, counted as HPACK counts them (32 a field on top of
/// its name and value). Four times the 16 KiB hyper accepts, and twice the size beyond which h2
/// closes the connection itself: lists that large never worked. Encoded again they fit in
/// four frames, fewer than the CONTINUATION frames h2 takes for a flood.
const MAX_LIST_BYTES: usize = 64 << 10;
/// What an authority the `http` crate refuses becomes.
const REPLACEMENT: &[u8] = b"localhost";
/// Bytes of a refused authority that the log shows.
const LOGGED_AUTHORITY_BYTES: usize = 200;
/// Rewritten output is kept in a buffer; one grown past this is given back once drained.
const KEPT_BUFFER_BYTES: usize = 64 << 10;

/// Why a connection's header frames cannot be passed on: it is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct Refused(String);

impl Refused {
    fn new(why: impl Into<String>) -> Self {
        Self(why.into())
    }
}

/// Where [`Frames`] is in the client's byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The connection preface, this many bytes of it seen.
    Preface(usize),
    /// Not HTTP/2 with prior knowledge: passed through for the server to refuse.
    Transparent,
    /// Between frames; `Frames::head` holds the next frame header's first bytes.
    Head,
    /// Inside a frame that passes unchanged: its payload bytes still to come.
    Payload(usize),
    /// Inside a HEADERS or CONTINUATION frame: its payload bytes still to come, gathered into
    /// the open block.
    Fragment(usize),
    /// Refused: nothing more is read.
    Failed,
}

/// A header block being gathered.
#[derive(Debug)]
struct Block {
    /// The HEADERS frame's stream identifier field, as sent.
    stream: [u8; 4],
    /// The HEADERS frame's flags.
    flags: u8,
    /// The flags of the frame being gathered.
    frame_flags: u8,
    /// Its PRIORITY fields, if it had them.
    priority: Option<[u8; PRIORITY_BYTES]>,
    /// The HEADERS frame is complete, its padding and PRIORITY fields taken out of `bytes`.
    headers_done: bool,
    /// The fragments gathered; the HEADERS frame's whole payload until it is complete.
    bytes: Vec<u8>,
}

/// The client-to-server byte stream of one connection, with its header blocks rewritten.
///
/// [`Frames::pass`] tells how many bytes may go to the server as they are (the fast path:
/// DATA and every other frame); [`Frames::feed`] takes the bytes from there on and writes what
/// the server must see instead.
pub(crate) struct Frames {
    state: State,
    head: [u8; FRAME_HEADER_BYTES],
    head_len: usize,
    block: Option<Block>,
    decoder: Decoder<'static>,
    /// The first authority replaced and not yet reported by [`Frames::take_replaced`].
    replaced: Option<Vec<u8>>,
    reported: bool,
}

impl std::fmt::Debug for Frames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frames")
            .field("state", &self.state)
            .field("block", &self.block)
            .finish_non_exhaustive()
    }
}

impl Default for Frames {
    fn default() -> Self {
        let mut decoder = Decoder::new();
        // A table size update beyond what the server allowed is a decoding error.
        decoder.set_max_allowed_table_size(TABLE_BYTES);
        Self {
            state: State::Preface(0),
            head: [0; FRAME_HEADER_BYTES],
            head_len: 0,
            block: None,
            decoder,
            replaced: None,
            reported: false,
        }
    }
}

/// A frame header's fields.
#[derive(Debug, Clone, Copy)]
struct Header {
    length: usize,
    kind: u8,
    flags: u8,
}

impl Header {
    fn parse(bytes: &[u8; FRAME_HEADER_BYTES]) -> Self {
        Self {
            length: usize::from(bytes[0]) << 16
                | usize::from(bytes[1]) << 8
                | usize::from(bytes[2]),
            kind: bytes[3],
            flags: bytes[4],
        }
    }

    fn starts_block(&self) -> bool {
        self.kind == HEADERS || self.kind == CONTINUATION
    }
}

impl Frames {
    /// How many of `input`'s first bytes go to the server unchanged. Stops at the first byte
    /// that must be gathered: a frame header not wholly in `input`, or a header block's frame.
    pub(crate) fn pass(&mut self, input: &[u8]) -> usize {
        let mut at = 0;
        while at < input.len() {
            let rest = &input[at..];
            match self.state {
                State::Transparent => return input.len(),
                State::Preface(matched) => {
                    let n = rest.len().min(PREFACE.len() - matched);
                    if rest[..n] != PREFACE[matched..matched + n] {
                        self.state = State::Transparent;
                        return input.len();
                    }
                    at += n;
                    self.state = if matched + n == PREFACE.len() {
                        State::Head
                    } else {
                        State::Preface(matched + n)
                    };
                }
                State::Payload(left) => {
                    let n = left.min(rest.len());
                    at += n;
                    self.state = if n == left {
                        State::Head
                    } else {
                        State::Payload(left - n)
                    };
                }
                State::Head if self.head_len == 0 && self.block.is_none() => {
                    let Some(bytes) = rest.first_chunk::<FRAME_HEADER_BYTES>() else {
                        return at;
                    };
                    let header = Header::parse(bytes);
                    if header.starts_block() {
                        return at;
                    }
                    at += FRAME_HEADER_BYTES;
                    self.state = Self::after_header(header);
                }
                State::Head | State::Fragment(_) | State::Failed => return at,
            }
        }
        at
    }

    /// Takes all of `input`, the bytes that follow what [`Frames::pass`] let through, and
    /// appends to `out` what the server must see in their place. An error closes the
    /// connection; everything after it is refused too.
    pub(crate) fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(), Refused> {
        let mut at = 0;
        while at < input.len() {
            let passed = self.pass(&input[at..]);
            if passed > 0 {
                out.extend_from_slice(&input[at..at + passed]);
                at += passed;
                continue;
            }
            match self.gather(&input[at..], out) {
                Ok(taken) => at += taken,
                Err(refused) => {
                    self.state = State::Failed;
                    self.block = None;
                    return Err(refused);
                }
            }
        }
        Ok(())
    }

    /// The first authority replaced on this connection, once.
    pub(crate) fn take_replaced(&mut self) -> Option<Vec<u8>> {
        self.replaced.take()
    }

    /// Client bytes held back: a partial frame header and a header block being gathered.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.head_len + self.block.as_ref().map_or(0, |b| b.bytes.capacity())
    }

    fn after_header(header: Header) -> State {
        if header.length == 0 {
            State::Head
        } else {
            State::Payload(header.length)
        }
    }

    /// Takes the first bytes of `input` where [`Frames::pass`] stopped: a frame header's bytes
    /// or a header block's. Returns how many it took (at least one).
    fn gather(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<usize, Refused> {
        match self.state {
            State::Head => {
                let n = (FRAME_HEADER_BYTES - self.head_len).min(input.len());
                self.head[self.head_len..self.head_len + n].copy_from_slice(&input[..n]);
                self.head_len += n;
                if self.head_len == FRAME_HEADER_BYTES {
                    self.head_len = 0;
                    self.frame_header(out)?;
                }
                Ok(n)
            }
            State::Fragment(left) => {
                let n = left.min(input.len());
                let block = self
                    .block
                    .as_mut()
                    .ok_or_else(|| Refused::new("a header fragment outside a block"))?;
                block.bytes.extend_from_slice(&input[..n]);
                if n == left {
                    self.state = State::Head;
                    self.fragment_done(out)?;
                } else {
                    self.state = State::Fragment(left - n);
                }
                Ok(n)
            }
            State::Failed => Err(Refused::new("the connection was refused before")),
            // `pass` takes at least one byte in these.
            State::Preface(_) | State::Transparent | State::Payload(_) => {
                Err(Refused::new("a frame boundary was lost"))
            }
        }
    }

    /// A frame header is complete in `self.head`.
    fn frame_header(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        let header = Header::parse(&self.head);
        let stream = [self.head[5], self.head[6], self.head[7], self.head[8]];
        // The stream identifier's reserved bit is ignored, as receivers must.
        let same_stream = |other: [u8; 4]| {
            u32::from_be_bytes(other) & 0x7fff_ffff == u32::from_be_bytes(stream) & 0x7fff_ffff
        };
        match (header.kind, self.block.as_mut()) {
            (HEADERS, None) => {
                if header.length > MAX_BLOCK_BYTES {
                    return Err(too_large(header.length));
                }
                self.block = Some(Block {
                    stream,
                    flags: header.flags,
                    frame_flags: header.flags,
                    priority: None,
                    headers_done: false,
                    bytes: Vec::new(),
                });
            }
            (CONTINUATION, Some(block)) => {
                if !same_stream(block.stream) {
                    return Err(Refused::new("a CONTINUATION frame of another stream"));
                }
                let total = block.bytes.len().saturating_add(header.length);
                if total > MAX_BLOCK_BYTES {
                    return Err(too_large(total));
                }
                block.frame_flags = header.flags;
            }
            (CONTINUATION, None) => {
                return Err(Refused::new(
                    "a CONTINUATION frame with no HEADERS before it",
                ));
            }
            (_, Some(_)) => {
                return Err(Refused::new(format!(
                    "a frame of type {:#x} inside a header block",
                    header.kind
                )));
            }
            (_, None) => {
                out.extend_from_slice(&self.head);
                self.state = Self::after_header(header);
                return Ok(());
            }
        }
        self.state = State::Fragment(header.length);
        if header.length == 0 {
            self.state = State::Head;
            self.fragment_done(out)?;
        }
        Ok(())
    }

    /// A HEADERS or CONTINUATION frame's payload is complete in the open block.
    fn fragment_done(&mut self, out: &mut Vec<u8>) -> Result<(), Refused> {
        let Some(block) = self.block.as_mut() else {
            return Err(Refused::new("a header fragment outside a block"));
        };
        if !block.headers_done {
            strip_headers_fields(block)?;
            block.headers_done = true;
        }
        if block.frame_flags & END_HEADERS != 0
            && let Some(block) = self.block.take()
        {
            self.rewrite(&block, out)?;
        }
        Ok(())
    }

    /// Decodes a complete header block, replaces an authority the `http` crate refuses, and
    /// appends the block, encoded again, as HEADERS and CONTINUATION frames.
    fn rewrite(&mut self, block: &Block, out: &mut Vec<u8>) -> Result<(), Refused> {
        let (strings, bytes) = huffman_coded(&block.bytes);
        if strings > MAX_HUFFMAN_STRINGS || bytes > MAX_HUFFMAN_BYTES {
            return Err(Refused::new(format!(
                "a header block with {strings} Huffman-coded strings of {bytes} bytes (at most \
                 {MAX_HUFFMAN_STRINGS} of {MAX_HUFFMAN_BYTES})"
            )));
        }
        let mut encoded = Vec::with_capacity(block.bytes.len() + 64);
        let mut listed = 0usize;
        let mut replaced = None;
        self.decoder
            .decode_with_cb(&block.bytes, |name, value| {
                listed = listed.saturating_add(name.len() + value.len() + 32);
                // Past the limit the block is refused; decoding goes on only to end.
                if listed > MAX_LIST_BYTES {
                    return;
                }
                let value = if &*name == b":authority"
                    && http::uri::Authority::try_from(&*value).is_err()
                {
                    replaced.get_or_insert_with(|| value.to_vec());
                    Cow::Borrowed(REPLACEMENT)
                } else {
                    value
                };
                encode_literal(&name, &value, &mut encoded);
            })
            .map_err(|error| {
                Refused::new(format!("a header block HPACK cannot decode: {error}"))
            })?;
        if listed > MAX_LIST_BYTES {
            return Err(Refused::new(format!(
                "a header list of over {listed} bytes (at most {MAX_LIST_BYTES})"
            )));
        }
        if let Some(original) = replaced
            && !self.reported
        {
            self.reported = true;
            self.replaced = Some(original);
        }
        write_block(block, &encoded, out);
        Ok(())
    }
}

fn too_large(bytes: usize) -> Refused {
    Refused::new(format!(
        "a header block of over {bytes} bytes (at most {MAX_BLOCK_BYTES})"
    ))
}

/// Removes a complete HEADERS frame's padding and PRIORITY fields from the block's bytes,
/// keeping the latter.
fn strip_headers_fields(block: &mut Block) -> Result<(), Refused> {
    let mut start = 0;
    let mut end = block.bytes.len();
    if block.flags & PADDED != 0 {
        let Some(&padding) = block.bytes.first() else {
            return Err(Refused::new(
                "a PADDED HEADERS frame without its pad length",
            ));
        };
        start = 1;
        // Padding may take all that follows, never more.
        if usize::from(padding) > end - start {
            return Err(Refused::new(
                "a HEADERS frame's padding exceeds its payload",
            ));
        }
        end -= usize::from(padding);
    }
    if block.flags & PRIORITY != 0 {
        let Some(priority) = block
            .bytes
            .get(start..end)
            .and_then(|rest| rest.first_chunk::<PRIORITY_BYTES>())
        else {
            return Err(Refused::new(
                "a HEADERS frame too short for its PRIORITY fields",
            ));
        };
        block.priority = Some(*priority);
        start += PRIORITY_BYTES;
    }
    block.bytes.truncate(end);
    block.bytes.drain(..start);
    Ok(())
}

/// The Huffman-coded strings in a header block and their bytes, counted without decoding them
/// (RFC 7541, 6). Counting stops where the block is malformed; the decoder then says why.
fn huffman_coded(block: &[u8]) -> (usize, usize) {
    let (mut strings, mut bytes) = (0, 0);
    let mut at = 0;
    while let Some(&first) = block.get(at) {
        // The index's prefix, and the strings that follow it (a literal's name only when it is
        // not indexed).
        let (prefix_bits, literal) = match first {
            _ if first & 0x80 != 0 => (7, false),
            _ if first & 0x40 != 0 => (6, true),
            _ if first & 0x20 != 0 => (5, false),
            _ => (4, true),
        };
        let Some((index, used)) = decode_integer(&block[at..], prefix_bits) else {
            break;
        };
        at += used;
        if !literal {
            continue;
        }
        for _ in 0..if index == 0 { 2 } else { 1 } {
            let Some(&head) = block.get(at) else {
                return (strings, bytes);
            };
            let Some((length, used)) = decode_integer(&block[at..], 7) else {
                return (strings, bytes);
            };
            if head & 0x80 != 0 {
                strings += 1;
                bytes = bytes.saturating_add(length);
            }
            at = at.saturating_add(used).saturating_add(length);
        }
    }
    (strings, bytes)
}

/// An HPACK integer with a `prefix_bits`-bit prefix at the start of `bytes`, and the bytes it
/// took; `None` when it is cut short or needs more than four continuation bytes (over 2^28,
/// more than any block holds).
fn decode_integer(bytes: &[u8], prefix_bits: u32) -> Option<(usize, usize)> {
    let max_prefix = (1usize << prefix_bits) - 1;
    let value = usize::from(*bytes.first()?) & max_prefix;
    if value < max_prefix {
        return Some((value, 1));
    }
    let mut value = value;
    for (i, &byte) in bytes.iter().enumerate().skip(1).take(4) {
        value += usize::from(byte & 0x7f) << (7 * (i - 1));
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// An HPACK integer with a `prefix_bits`-bit prefix, the first byte's other bits `pattern`
/// (RFC 7541, 5.1).
fn encode_integer(value: usize, prefix_bits: u32, pattern: u8, out: &mut Vec<u8>) {
    let max_prefix = (1usize << prefix_bits) - 1;
    if value < max_prefix {
        out.push(pattern | value as u8);
        return;
    }
    out.push(pattern | max_prefix as u8);
    let mut rest = value - max_prefix;
    while rest >= 0x80 {
        out.push((rest & 0x7f) as u8 | 0x80);
        rest >>= 7;
    }
    out.push(rest as u8);
}

/// A field as a literal without indexing with a literal name (RFC 7541, 6.2.2): it neither
/// refers to nor changes the server's dynamic table.
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    for string in [name, value] {
        encode_integer(string.len(), 7, 0x00, out);
        out.extend_from_slice(string);
    }
}

/// `encoded` as HEADERS and CONTINUATION frames of at most [`FRAME_BYTES`], with the original
/// HEADERS frame's stream, END_STREAM and PRIORITY fields; padding is dropped.
fn write_block(block: &Block, encoded: &[u8], out: &mut Vec<u8>) {
    let priority: &[u8] = block.priority.as_ref().map_or(&[], |p| &p[..]);
    let first_bytes = (FRAME_BYTES - priority.len()).min(encoded.len());
    let (first, rest) = encoded.split_at(first_bytes);
    let mut flags = block.flags & END_STREAM;
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    write_frame_header(
        priority.len() + first.len(),
        HEADERS,
        flags,
        block.stream,
        out,
    );
    out.extend_from_slice(priority);
    out.extend_from_slice(first);
    let mut chunks = rest.chunks(FRAME_BYTES).peekable();
    while let Some(chunk) = chunks.next() {
        let flags = if chunks.peek().is_none() {
            END_HEADERS
        } else {
            0
        };
        write_frame_header(chunk.len(), CONTINUATION, flags, block.stream, out);
        out.extend_from_slice(chunk);
    }
}

fn write_frame_header(length: usize, kind: u8, flags: u8, stream: [u8; 4], out: &mut Vec<u8>) {
    let length = (length as u32).to_be_bytes();
    out.extend_from_slice(&length[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream);
}

/// A Unix-socket connection whose client's header blocks pass through [`Frames`]; writes go
/// to the socket unchanged.
#[derive(Debug)]
pub(crate) struct AuthorityRewriter<S> {
    inner: S,
    frames: Frames,
    /// Bytes for the server that it has not read yet: rewritten header frames, and whatever
    /// followed them in the same read.
    pending: Vec<u8>,
    pending_at: usize,
    /// Why the connection is closed, for the read after the bytes that came before.
    refused: Option<Refused>,
    peer: Peer,
}

impl<S> AuthorityRewriter<S> {
    pub(crate) fn new(inner: S, peer: Peer) -> Self {
        Self {
            inner,
            frames: Frames::default(),
            pending: Vec::new(),
            pending_at: 0,
            refused: None,
            peer,
        }
    }

    fn report_replacement(&mut self) {
        if let Some(original) = self.frames.take_replaced() {
            let shown = &original[..original.len().min(LOGGED_AUTHORITY_BYTES)];
            tracing::debug!(
                peer = %self.peer,
                authority = ?String::from_utf8_lossy(shown),
                "the client's HTTP/2 :authority is one h2 refuses (gRPC sends the socket's path); \
                 its requests are served as localhost"
            );
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityRewriter<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pending_at < this.pending.len() {
                let n = buf.remaining().min(this.pending.len() - this.pending_at);
                buf.put_slice(&this.pending[this.pending_at..this.pending_at + n]);
                this.pending_at += n;
                if this.pending_at == this.pending.len() {
                    this.pending_at = 0;
                    if this.pending.capacity() > KEPT_BUFFER_BYTES {
                        this.pending = Vec::new();
                    } else {
                        this.pending.clear();
                    }
                }
                return Poll::Ready(Ok(()));
            }
            if let Some(refused) = this.refused.take() {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, refused)));
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            // Read straight into the server's buffer; what passes unchanged stays there.
            let start = buf.filled().len();
            ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
            let read = &buf.filled()[start..];
            if read.is_empty() {
                return Poll::Ready(Ok(()));
            }
            let passed = this.frames.pass(read);
            if passed < read.len() {
                let fed = this.frames.feed(&read[passed..], &mut this.pending);
                this.report_replacement();
                if let Err(refused) = fed {
                    tracing::debug!(peer = %this.peer, %refused, "closing a Unix-socket connection");
                    this.refused = Some(refused);
                }
                buf.set_filled(start + passed);
            }
            if passed > 0 {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityRewriter<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    const SOCKET_AUTHORITY: &[u8] = b"tmp%2Fdir%2Fgpu-flight.sock";
    const DATA: u8 = 0x0;

    fn fields(pairs: &[(&str, &[u8])]) -> Fields {
        pairs
            .iter()
            .map(|(name, value)| (name.as_bytes().to_vec(), value.to_vec()))
            .collect()
    }

    /// A gRPC request's fields, as C-core sends them.
    fn request(authority: &[u8], path: &str) -> Fields {
        fields(&[
            (":scheme", b"http"),
            (":method", b"POST"),
            (":authority", authority),
            (":path", path.as_bytes()),
            ("te", b"trailers"),
            ("content-type", b"application/grpc"),
            (
                "user-agent",
                b"grpc-c++/1.67.0 grpc-c/43.0.0 (linux; chttp2)",
            ),
            ("grpc-accept-encoding", b"identity, deflate, gzip"),
        ])
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame_header(payload.len(), kind, flags, stream.to_be_bytes(), &mut out);
        out.extend_from_slice(payload);
        out
    }

    /// How a client frames one header block.
    #[derive(Debug, Clone, Default)]
    struct Framing {
        end_stream: bool,
        padding: Option<u8>,
        priority: Option<[u8; PRIORITY_BYTES]>,
        /// Fragment bytes in the HEADERS frame and in each CONTINUATION frame; all in one
        /// frame when zero.
        split: usize,
    }

    fn client_block(stream: u32, block: &[u8], framing: &Framing) -> Vec<u8> {
        let split = if framing.split == 0 {
            block.len().max(1)
        } else {
            framing.split
        };
        let mut chunks: Vec<&[u8]> = block.chunks(split).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        let mut flags = 0;
        let mut payload = Vec::new();
        if let Some(padding) = framing.padding {
            flags |= PADDED;
            payload.push(padding);
        }
        if let Some(priority) = framing.priority {
            flags |= PRIORITY;
            payload.extend_from_slice(&priority);
        }
        if framing.end_stream {
            flags |= END_STREAM;
        }
        if chunks.len() == 1 {
            flags |= END_HEADERS;
        }
        payload.extend_from_slice(chunks[0]);
        payload.extend(std::iter::repeat_n(
            0u8,
            usize::from(framing.padding.unwrap_or(0)),
        ));
        let mut out = frame(HEADERS, flags, stream, &payload);
        for (i, chunk) in chunks.iter().enumerate().skip(1) {
            let flags = if i + 1 == chunks.len() {
                END_HEADERS
            } else {
                0
            };
            out.extend(frame(CONTINUATION, flags, stream, chunk));
        }
        out
    }

    /// HPACK the way gRPC C-core writes it: new fields go into the dynamic table, repeated ones
    /// are sent as its indexes.
    #[derive(Default)]
    struct ClientEncoder {
        /// The client's idea of the dynamic table, newest first.
        table: Vec<(Vec<u8>, Vec<u8>)>,
    }

    impl ClientEncoder {
        fn encode(&mut self, fields: &Fields) -> Vec<u8> {
            let mut out = Vec::new();
            for (name, value) in fields {
                match self.table.iter().position(|(n, v)| n == name && v == value) {
                    Some(i) => encode_integer(62 + i, 7, 0x80, &mut out),
                    None => {
                        // Literal with incremental indexing; names by index where the table
                        // has them.
                        match self.table.iter().position(|(n, _)| n == name) {
                            Some(i) => encode_integer(62 + i, 6, 0x40, &mut out),
                            None => {
                                out.push(0x40);
                                encode_integer(name.len(), 7, 0, &mut out);
                                out.extend_from_slice(name);
                            }
                        }
                        encode_integer(value.len(), 7, 0, &mut out);
                        out.extend_from_slice(value);
                        self.table.insert(0, (name.clone(), value.clone()));
                        let mut size: usize =
                            self.table.iter().map(|(n, v)| n.len() + v.len() + 32).sum();
                        while size > TABLE_BYTES {
                            let (n, v) = self.table.pop().expect("an entry");
                            size -= n.len() + v.len() + 32;
                        }
                    }
                }
            }
            out
        }
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Frame {
        kind: u8,
        flags: u8,
        stream: u32,
        payload: Vec<u8>,
    }

    fn parse(bytes: &[u8]) -> Vec<Frame> {
        let mut rest = bytes.strip_prefix(PREFACE).expect("the preface");
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let head = rest
                .first_chunk::<FRAME_HEADER_BYTES>()
                .expect("a frame header");
            let header = Header::parse(head);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
            let payload = rest[FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + header.length].to_vec();
            frames.push(Frame {
                kind: header.kind,
                flags: header.flags,
                stream,
                payload,
            });
            rest = &rest[FRAME_HEADER_BYTES + header.length..];
        }
        frames
    }

    /// What a server makes of frames: header blocks decoded by one decoder in order, the rest as
    /// they are.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Seen {
        Block {
            stream: u32,
            end_stream: bool,
            priority: Option<Vec<u8>>,
            fields: Fields,
        },
        Other(Frame),
    }

    fn server_view(frames: &[Frame]) -> Vec<Seen> {
        let mut decoder = Decoder::new();
        let mut seen = Vec::new();
        let mut frames = frames.iter();
        while let Some(frame) = frames.next() {
            if frame.kind != HEADERS {
                seen.push(Seen::Other(frame.clone()));
                continue;
            }
            let mut payload = &frame.payload[..];
            if frame.flags & PADDED != 0 {
                let padding = usize::from(payload[0]);
                payload = &payload[1..payload.len() - padding];
            }
            let mut priority = None;
            if frame.flags & PRIORITY != 0 {
                priority = Some(payload[..PRIORITY_BYTES].to_vec());
                payload = &payload[PRIORITY_BYTES..];
            }
            let mut block = payload.to_vec();
            let mut last = frame.clone();
            while last.flags & END_HEADERS == 0 {
                last = frames.next().expect("a CONTINUATION frame").clone();
                assert_eq!((last.kind, last.stream), (CONTINUATION, frame.stream));
                block.extend_from_slice(&last.payload);
            }
            seen.push(Seen::Block {
                stream: frame.stream,
                end_stream: frame.flags & END_STREAM != 0,
                priority,
                fields: decoder
                    .decode(&block)
                    .expect("a block the server can decode"),
            });
        }
        seen
    }

    /// The server's view of the client's frames, with the authorities the rewriter replaces
    /// replaced.
    fn expected(input: &[u8]) -> Vec<Seen> {
        let mut seen = server_view(&parse(input));
        for item in &mut seen {
            if let Seen::Block { fields, .. } = item {
                for (name, value) in fields {
                    if name == b":authority" && http::uri::Authority::try_from(&value[..]).is_err()
                    {
                        *value = REPLACEMENT.to_vec();
                    }
                }
            }
        }
        seen
    }

    /// Feeds `input` the way [`AuthorityRewriter`] does, in reads of the sizes `reads` gives.
    fn run(
        frames: &mut Frames,
        input: &[u8],
        mut reads: impl FnMut() -> usize,
    ) -> (Vec<u8>, Result<(), Refused>) {
        let mut out = Vec::new();
        let mut rest = input;
        while !rest.is_empty() {
            let (read, after) = rest.split_at(reads().clamp(1, rest.len()));
            rest = after;
            let passed = frames.pass(read);
            out.extend_from_slice(&read[..passed]);
            if let Err(refused) = frames.feed(&read[passed..], &mut out) {
                return (out, Err(refused));
            }
            // A block's buffer grows by doubling.
            assert!(frames.held() <= 2 * MAX_BLOCK_BYTES + FRAME_HEADER_BYTES);
        }
        (out, Ok(()))
    }

    fn rewrite(input: &[u8]) -> Result<Vec<u8>, Refused> {
        let (out, result) = run(&mut Frames::default(), input, || usize::MAX);
        result.map(|()| out)
    }

    fn stream_of(parts: &[Vec<u8>]) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 4, 0, 0x10, 0, 0]));
        for part in parts {
            input.extend_from_slice(part);
        }
        input
    }

    /// Checks the output's header frames are ones every server takes.
    fn assert_header_frames_are_plain(output: &[u8]) {
        for frame in parse(output) {
            if frame.kind == HEADERS || frame.kind == CONTINUATION {
                assert!(
                    frame.payload.len() <= FRAME_BYTES,
                    "{} bytes",
                    frame.payload.len()
                );
                assert_eq!(frame.flags & PADDED, 0);
            }
        }
    }

    #[test]
    fn an_authority_h2_refuses_becomes_localhost_and_every_other_field_stays() {
        let mut client = ClientEncoder::default();
        let trailers = fields(&[("grpc-status", b"0"), ("x-note", b"a%b")]);
        let blocks = [
            request(
                SOCKET_AUTHORITY,
                "/arrow.flight.protocol.FlightService/DoPut",
            ),
            // The same fields again, now sent as indexes into the dynamic table.
            request(
                SOCKET_AUTHORITY,
                "/arrow.flight.protocol.FlightService/DoPut",
            ),
            request(
                SOCKET_AUTHORITY,
                "/arrow.flight.protocol.FlightService/DoGet",
            ),
            // Valid authorities are kept.
            request(b"localhost:8815", "/grpc.health.v1.Health/Check"),
            request(b"", "/grpc.health.v1.Health/Check"),
            trailers.clone(),
        ];
        let parts: Vec<Vec<u8>> = blocks
            .iter()
            .zip(1u32..)
            .map(|(block, i)| {
                let framing = Framing {
                    end_stream: i % 2 == 0,
                    ..Framing::default()
                };
                client_block(2 * i - 1, &client.encode(block), &framing)
            })
            .collect();
        let input = stream_of(&parts);
        let mut rewriter = Frames::default();
        let (output, result) = run(&mut rewriter, &input, || usize::MAX);
        result.expect("rewritten");
        assert_header_frames_are_plain(&output);
        let seen = server_view(&parse(&output));
        assert_eq!(seen, expected(&input));
        let authorities: Vec<&[u8]> = seen
            .iter()
            .filter_map(|s| match s {
                Seen::Block { fields, .. } => fields
                    .iter()
                    .find(|(n, _)| n == b":authority")
                    .map(|(_, v)| &v[..]),
                Seen::Other(_) => None,
            })
            .collect();
        assert_eq!(
            authorities,
            [
                &b"localhost"[..],
                b"localhost",
                b"localhost",
                b"localhost:8815",
                b"localhost"
            ]
        );
        let Seen::Block { fields, .. } = &seen[6] else {
            panic!("the trailers")
        };
        assert_eq!(fields, &trailers, "only :authority is looked at");
        // Reported once, with what the client sent.
        assert_eq!(rewriter.take_replaced().as_deref(), Some(SOCKET_AUTHORITY));
        let more = client_block(15, &client.encode(&blocks[0]), &Framing::default());
        let mut out = Vec::new();
        rewriter.feed(&more, &mut out).expect("rewritten");
        assert_eq!(rewriter.take_replaced(), None);
    }

    #[test]
    fn blocks_split_any_way_come_out_in_frames_of_at_most_16_kib() {
        let mut big = request(SOCKET_AUTHORITY, "/x");
        big.push((b"x-big".to_vec(), vec![b'v'; 40_000]));
        for split in [0, 1, 7, 16_384, 30_000] {
            let mut client = ClientEncoder::default();
            let framing = Framing {
                end_stream: true,
                split,
                ..Framing::default()
            };
            let block = client.encode(&big);
            let input = stream_of(&[
                client_block(1, &block, &framing),
                frame(DATA, END_STREAM, 1, b""),
            ]);
            let output = rewrite(&input).expect("rewritten");
            assert_header_frames_are_plain(&output);
            assert_eq!(server_view(&parse(&output)), expected(&input));
            let kinds: Vec<(u8, u8)> = parse(&output).iter().map(|f| (f.kind, f.flags)).collect();
            assert_eq!(
                kinds,
                [
                    (0x4, 0),
                    (HEADERS, END_STREAM),
                    (CONTINUATION, 0),
                    (CONTINUATION, END_HEADERS),
                    (DATA, END_STREAM)
                ],
                "split {split}"
            );
        }
    }

    #[test]
    fn padding_is_dropped_and_priority_kept() {
        let priority = [0x80, 0, 0, 3, 200];
        for (padding, split) in [
            (Some(0), 0),
            (Some(10), 0),
            (Some(255), 5),
            (None, 3),
            (Some(3), 1),
        ] {
            let mut client = ClientEncoder::default();
            let block = client.encode(&request(SOCKET_AUTHORITY, "/y"));
            let framing = Framing {
                end_stream: true,
                padding,
                priority: Some(priority),
                split,
            };
            let input = stream_of(&[client_block(1, &block, &framing)]);
            let output = rewrite(&input).expect("rewritten");
            assert_header_frames_are_plain(&output);
            let seen = server_view(&parse(&output));
            assert_eq!(seen, expected(&input));
            assert!(matches!(
                &seen[1],
                Seen::Block { end_stream: true, priority: Some(p), .. } if p == &priority
            ));
            // Padding alone, and an empty HEADERS frame's padding taking all of it.
            let framing = Framing {
                priority: None,
                ..framing
            };
            let block = ClientEncoder::default().encode(&request(b"h", "/"));
            let input = stream_of(&[client_block(3, &block, &framing)]);
            assert_eq!(
                server_view(&parse(&rewrite(&input).expect("rewritten"))),
                expected(&input)
            );
        }
        let empty_then_continuation = stream_of(&[
            frame(HEADERS, PADDED, 1, &[2, 0, 0]),
            frame(
                CONTINUATION,
                END_HEADERS,
                1,
                &ClientEncoder::default().encode(&request(b"a%", "/")),
            ),
        ]);
        let output = rewrite(&empty_then_continuation).expect("rewritten");
        assert_eq!(
            server_view(&parse(&output)),
            expected(&empty_then_continuation)
        );
    }

    #[test]
    fn other_frames_pass_byte_for_byte_without_a_copy() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut parts = Vec::new();
        for kind in [DATA, 0x2, 0x3, 0x4, 0x6, 0x7, 0x8, 0xa, 0xff] {
            for length in [0, 1, 8, 17_000] {
                let payload: Vec<u8> = (0..length).map(|_| rng.random()).collect();
                parts.push(frame(kind, rng.random(), rng.random(), &payload));
            }
        }
        let input = stream_of(&parts);
        let mut rewriter = Frames::default();
        assert_eq!(rewriter.pass(&input), input.len(), "nothing is gathered");
        let (output, result) = run(&mut Frames::default(), &input, || {
            rng.random_range(1..40_000)
        });
        result.expect("passed");
        assert_eq!(output, input);
    }

    #[test]
    fn what_is_not_http2_is_left_to_the_server() {
        let input = b"GET / HTTP/1.1\r\nHost: a%b\r\n\r\n\x00\x00\x05\x01\x04\x00\x00\x00\x01hello";
        assert_eq!(rewrite(input).expect("passed"), input);
        assert_eq!(rewrite(&PREFACE[..10]).expect("passed"), &PREFACE[..10]);
    }

    #[test]
    fn protocol_errors_close_the_connection() {
        let block = ClientEncoder::default().encode(&request(SOCKET_AUTHORITY, "/"));
        let refused = |parts: &[Vec<u8>]| {
            let input = stream_of(parts);
            let mut rewriter = Frames::default();
            let (output, result) = run(&mut rewriter, &input, || 3);
            let error = result.expect_err("refused");
            // Refused for good, and nothing of the bad block went out.
            assert!(
                rewriter
                    .feed(&frame(0x6, 0, 0, &[0; 8]), &mut Vec::new())
                    .is_err()
            );
            assert!(output.len() < input.len());
            error.to_string()
        };
        let headers = |flags, payload: &[u8]| frame(HEADERS, flags, 1, payload);
        let cases = [
            (
                vec![frame(CONTINUATION, END_HEADERS, 1, &block)],
                "no HEADERS",
            ),
            (
                vec![headers(0, &block), frame(DATA, 0, 1, b"x")],
                "inside a header block",
            ),
            (
                vec![headers(0, &block), headers(END_HEADERS, &block)],
                "inside a header block",
            ),
            (
                vec![
                    headers(0, &block[..3]),
                    frame(CONTINUATION, END_HEADERS, 3, &block[3..]),
                ],
                "another stream",
            ),
            (vec![headers(END_HEADERS | PADDED, &[])], "pad length"),
            (
                vec![headers(END_HEADERS | PADDED, &[5, 1, 2, 3, 4])],
                "padding exceeds",
            ),
            (
                vec![headers(END_HEADERS | PRIORITY, &[0, 0, 0, 1])],
                "PRIORITY",
            ),
            (
                vec![headers(
                    END_HEADERS | PADDED | PRIORITY,
                    &[1, 0, 0, 0, 0, 1],
                )],
                "PRIORITY",
            ),
            // An index past both tables; a table size update past the server's; a string
            // longer than the block; Huffman padding that is not EOS.
            (vec![headers(END_HEADERS, &[0x80 | 70])], "HPACK"),
            (
                vec![headers(END_HEADERS, &[0x3f, 0xe2, 0x1f, 0x82])],
                "HPACK",
            ),
            (vec![headers(END_HEADERS, &[0x00, 0x05, b'a'])], "HPACK"),
            (
                vec![headers(END_HEADERS, &[0x00, 0x81, 0x00, 0x00])],
                "HPACK",
            ),
        ];
        for (parts, why) in cases {
            let error = refused(&parts);
            assert!(error.contains(why), "{error:?} for {why}");
        }
    }

    #[test]
    fn large_blocks_are_refused_before_they_are_held() {
        // A declared length alone is refused: nothing is gathered for it.
        let mut rewriter = Frames::default();
        let mut head = Vec::new();
        write_frame_header(MAX_BLOCK_BYTES + 1, HEADERS, 0, [0, 0, 0, 1], &mut head);
        let input = stream_of(&[head]);
        let (_, result) = run(&mut rewriter, &input, || usize::MAX);
        assert!(
            result
                .expect_err("refused")
                .to_string()
                .contains("header block")
        );
        assert_eq!(rewriter.held(), 0);
        // So are CONTINUATION frames that add up to too much.
        let mut parts = vec![frame(HEADERS, 0, 1, &[0x82])];
        let filler = vec![0x82; FRAME_BYTES];
        parts
            .extend((0..MAX_BLOCK_BYTES / FRAME_BYTES).map(|_| frame(CONTINUATION, 0, 1, &filler)));
        let (_, result) = run(&mut Frames::default(), &stream_of(&parts), || 10_000);
        assert!(
            result
                .expect_err("refused")
                .to_string()
                .contains("header block")
        );
        // A small block that decodes to a huge list: one 4 KB entry, referred to 200 times.
        let mut block = vec![0x40];
        encode_integer(3, 7, 0, &mut block);
        block.extend_from_slice(b"big");
        encode_integer(4_000, 7, 0, &mut block);
        block.extend(std::iter::repeat_n(b'v', 4_000));
        block.extend(std::iter::repeat_n(0x80 | 62, 200));
        let (_, result) = run(
            &mut Frames::default(),
            &stream_of(&[frame(HEADERS, END_HEADERS, 1, &block)]),
            || usize::MAX,
        );
        assert!(
            result
                .expect_err("refused")
                .to_string()
                .contains("header list")
        );
    }

    #[test]
    fn integers_read_back_as_written() {
        for prefix_bits in [4, 5, 6, 7] {
            for value in [
                0,
                1,
                14,
                15,
                16,
                30,
                31,
                62,
                63,
                126,
                127,
                128,
                4_096,
                1 << 20,
                1 << 27,
            ] {
                let mut bytes = Vec::new();
                encode_integer(value, prefix_bits, 0, &mut bytes);
                let length = bytes.len();
                bytes.push(0xff);
                assert_eq!(decode_integer(&bytes, prefix_bits), Some((value, length)));
                assert_eq!(decode_integer(&bytes[..length - 1], prefix_bits), None);
            }
        }
        assert_eq!(
            decode_integer(&[0x7f, 0xff, 0xff, 0xff, 0xff, 0x01], 7),
            None
        );
    }

    #[test]
    fn blocks_costly_to_decode_are_refused_before_decoding() {
        // A literal field with a Huffman-coded name and value, "0" each.
        let field = [0x00, 0x81, 0x07, 0x81, 0x07];
        let block = |fields: usize| field.repeat(fields);
        assert_eq!(huffman_coded(&block(3)), (6, 6));
        let plain = ClientEncoder::default().encode(&request(SOCKET_AUTHORITY, "/"));
        assert_eq!(huffman_coded(&plain), (0, 0));
        let run_block = |block: &[u8]| {
            let input = stream_of(&[frame(HEADERS, END_HEADERS, 1, block)]);
            run(&mut Frames::default(), &input, || usize::MAX).1
        };
        run_block(&block(MAX_HUFFMAN_STRINGS / 2)).expect("as many as a list h2 takes can hold");
        let error = run_block(&block(MAX_HUFFMAN_STRINGS / 2 + 1)).expect_err("refused");
        assert!(error.to_string().contains("Huffman"), "{error}");
        let mut long = vec![0x00, 0x81, 0x07];
        encode_integer(MAX_HUFFMAN_BYTES + 1, 7, 0x80, &mut long);
        long.extend(std::iter::repeat_n(0xff, MAX_HUFFMAN_BYTES + 1));
        let error = run_block(&long).expect_err("refused");
        assert!(error.to_string().contains("Huffman"), "{error}");
    }

    /// A client's stream of random frames and header blocks, as a valid client could send it.
    fn random_stream(rng: &mut StdRng) -> Vec<u8> {
        let mut client = ClientEncoder::default();
        let mut parts = Vec::new();
        for i in 0..rng.random_range(1..30u32) {
            if rng.random_bool(0.4) {
                let authority: &[u8] = match rng.random_range(0..4) {
                    0 => SOCKET_AUTHORITY,
                    1 => b"localhost:8815",
                    2 => b"a b",
                    _ => b"[::1]:1",
                };
                let mut fields = request(authority, &format!("/p{}", rng.random_range(0..3)));
                fields.truncate(rng.random_range(0..=fields.len()));
                if rng.random_bool(0.2) {
                    fields.push((b"x-long".to_vec(), vec![b'q'; rng.random_range(0..40_000)]));
                }
                let block = client.encode(&fields);
                let framing = Framing {
                    end_stream: rng.random(),
                    padding: rng.random_bool(0.3).then(|| rng.random()),
                    priority: rng.random_bool(0.3).then(|| rng.random()),
                    split: if rng.random() {
                        0
                    } else {
                        rng.random_range(1..100)
                    },
                };
                parts.push(client_block(2 * i + 1, &block, &framing));
            } else {
                let kind = [DATA, 0x2, 0x3, 0x4, 0x6, 0x7, 0x8, 0xa, 0xc0][rng.random_range(0..9)];
                let length = [0, 1, 9, 100, 20_000][rng.random_range(0..5)];
                let payload: Vec<u8> = (0..length).map(|_| rng.random()).collect();
                // Random flags, PADDED included, on frames that pass as they are.
                parts.push(frame(kind, rng.random(), rng.random(), &payload));
            }
        }
        stream_of(&parts)
    }

    #[test]
    fn random_streams_keep_every_frame_and_hostile_ones_never_panic() {
        let mut rng = StdRng::seed_from_u64(20261125);
        for _ in 0..200 {
            let input = random_stream(&mut rng);
            let small = rng.random_range(1..64);
            let reads = |rng: &mut StdRng| {
                if rng.random() {
                    rng.random_range(1..small)
                } else {
                    rng.random_range(1..50_000)
                }
            };
            let (output, result) = run(&mut Frames::default(), &input, || reads(&mut rng));
            result.expect("a valid stream is rewritten");
            assert_header_frames_are_plain(&output);
            assert_eq!(server_view(&parse(&output)), expected(&input));

            // The same bytes damaged: bits flipped, bytes dropped or added, random tails.
            let mut hostile = input.clone();
            for _ in 0..rng.random_range(1..20) {
                let at = rng.random_range(PREFACE.len()..hostile.len().max(PREFACE.len() + 1));
                match rng.random_range(0..4) {
                    0 if at < hostile.len() => hostile[at] ^= 1 << rng.random_range(0..8),
                    1 if at < hostile.len() => drop(hostile.remove(at)),
                    2 => hostile.insert(at.min(hostile.len()), rng.random()),
                    _ => hostile.extend((0..rng.random_range(0..300)).map(|_| rng.random::<u8>())),
                }
            }
            let _ = run(&mut Frames::default(), &hostile, || reads(&mut rng));
        }
        // Random bytes after the preface.
        for _ in 0..2_000 {
            let length = rng.random_range(0..2_000);
            let tail: Vec<u8> = (0..length).map(|_| rng.random()).collect();
            let input = stream_of(&[tail]);
            let _ = run(&mut Frames::default(), &input, || rng.random_range(1..500));
        }
    }

    /// A socket that delivers the client's bytes in the pieces given.
    struct Pieces(std::collections::VecDeque<Vec<u8>>);

    impl AsyncRead for Pieces {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if let Some(mut piece) = self.0.pop_front() {
                let n = piece.len().min(buf.remaining());
                buf.put_slice(&piece[..n]);
                if n < piece.len() {
                    self.0.push_front(piece.split_off(n));
                }
            }
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn the_server_reads_the_same_through_buffers_of_any_size() {
        use tokio::io::AsyncReadExt;
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..50 {
            let input = random_stream(&mut rng);
            let wanted = rewrite(&input).expect("rewritten");
            let mut pieces = std::collections::VecDeque::new();
            let mut rest = &input[..];
            while !rest.is_empty() {
                let (piece, after) = rest.split_at(rng.random_range(1..30_000).min(rest.len()));
                pieces.push_back(piece.to_vec());
                rest = after;
            }
            let peer = Peer::Unix {
                pid: None,
                uid: None,
            };
            let mut rewriter = AuthorityRewriter::new(Pieces(pieces), peer);
            let mut read = Vec::new();
            loop {
                // Buffers partly filled already, as the server's often are.
                let mut storage = vec![0u8; rng.random_range(2..20_000)];
                let before = rng.random_range(0..storage.len() / 2);
                let mut buf = ReadBuf::new(&mut storage);
                buf.advance(before);
                std::future::poll_fn(|cx| Pin::new(&mut rewriter).poll_read(cx, &mut buf))
                    .await
                    .expect("read");
                if buf.filled().len() == before {
                    break;
                }
                read.extend_from_slice(&buf.filled()[before..]);
            }
            assert_eq!(read, wanted);
            let mut rest = Vec::new();
            rewriter.read_to_end(&mut rest).await.expect("at the end");
            assert!(rest.is_empty());
        }
    }

    /// The paths and authorities of the requests h2's server takes from `io`, up to the one
    /// for `/valid`.
    async fn requests<T>(io: T) -> Vec<(String, String)>
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        let mut connection = h2::server::handshake(io).await.expect("a handshake");
        let mut taken = Vec::new();
        while taken.last().is_none_or(|(path, _)| path != "/valid") {
            let (request, _respond) = connection
                .accept()
                .await
                .expect("a request")
                .expect("a valid request");
            let uri = request.uri();
            let authority = uri.authority().map_or("", |a| a.as_str());
            taken.push((uri.path().to_owned(), authority.to_owned()));
        }
        taken
    }

    #[tokio::test]
    async fn h2_serves_the_requests_it_resets_without_the_rewriter() {
        use tokio::io::AsyncWriteExt;
        let mut client = ClientEncoder::default();
        let mut input = stream_of(&[]);
        for (stream, authority, path) in [
            (1, SOCKET_AUTHORITY, "/one"),
            (3, SOCKET_AUTHORITY, "/two"),
            (5, b"localhost:1".as_slice(), "/valid"),
        ] {
            let block = client.encode(&request(authority, path));
            let framing = Framing {
                end_stream: true,
                ..Framing::default()
            };
            input.extend(client_block(stream, &block, &framing));
        }
        let owned = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(p, a)| (p.to_string(), a.to_string()))
                .collect()
        };
        // The client stays connected: h2 gives no request from a connection that has ended.
        let (mut near, far) = tokio::io::duplex(1 << 20);
        near.write_all(&input).await.expect("written");
        let peer = Peer::Unix {
            pid: None,
            uid: None,
        };
        assert_eq!(
            requests(AuthorityRewriter::new(far, peer)).await,
            owned(&[
                ("/one", "localhost"),
                ("/two", "localhost"),
                ("/valid", "localhost:1")
            ])
        );
        let (mut near, far) = tokio::io::duplex(1 << 20);
        near.write_all(&input).await.expect("written");
        assert_eq!(
            requests(far).await,
            owned(&[("/valid", "localhost:1")]),
            "h2 resets the others"
        );
    }
}
