//! An HTTP/2 front for a CSI unix socket, so that kubelet's gRPC clients are understood.
//!
//! Older grpc-go (kubelet's CSI client before Kubernetes 1.26, its plugin-registration client
//! still in later releases) sends a unix socket's *path* as the `:authority` pseudo-header.
//! h2, under tonic, refuses a request whose authority is not a URI authority and resets the
//! stream with PROTOCOL_ERROR (hyperium/h2#487, no option to relax it), so kubelet could never
//! register the driver nor call it.
//!
//! The front sits between each accepted connection and tonic. It passes every byte through,
//! except the client's header blocks: those it decodes (HPACK, following the client's dynamic
//! table), replaces an authority that is not one with `localhost`, and re-encodes as literals
//! that are never indexed, so the server's table stays empty and cannot disagree with the
//! client's. The server's answers are copied untouched.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::Stream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::net::{UnixListener, UnixStream};

/// What every HTTP/2 client sends first (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The frame size every peer accepts before any SETTINGS (RFC 9113 §4.2): the largest frame the
/// front writes.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is refused: CSI requests carry a few hundred bytes of
/// headers, and the front must not buffer without bound.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What a refused authority becomes: what current grpc-go sends for a unix socket.
const LOCAL_AUTHORITY: &[u8] = b"localhost";
/// Room between the front and tonic, per connection.
const PIPE_BYTES: usize = 64 * 1024;

/// Why a connection through the front was closed: one variant per step.
#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error("reading the client's connection preface: {0}")]
    ReadPreface(#[source] io::Error),
    #[error("the client did not open with the HTTP/2 connection preface")]
    NotHttp2,
    #[error("reading a frame from the client: {0}")]
    ReadFrame(#[source] io::Error),
    #[error("a frame of type {kind:#x} on stream {stream} is shorter than its padding and priority fields")]
    ShortFrame { kind: u8, stream: u32 },
    #[error("a frame of type {kind:#x} came between the HEADERS and CONTINUATION frames of stream {stream}")]
    InterruptedHeaderBlock { kind: u8, stream: u32 },
    #[error("the header block of stream {stream} exceeds {MAX_HEADER_BLOCK} bytes")]
    HeaderBlockTooLarge { stream: u32 },
    #[error("decoding the header block of stream {stream}: {reason}")]
    Hpack { stream: u32, reason: String },
    #[error("passing the client's frames to the gRPC server: {0}")]
    WriteServer(#[source] io::Error),
    #[error("passing the server's frames to the client: {0}")]
    WriteClient(#[source] io::Error),
}

impl FrontError {
    /// Whether the client ended the connection (reset, closed, gone) rather than the front
    /// refusing what it sent or the server going away.
    fn is_the_clients_leaving(&self) -> bool {
        match self {
            FrontError::ReadPreface(_) | FrontError::ReadFrame(_) | FrontError::WriteClient(_) => {
                true
            }
            FrontError::NotHttp2
            | FrontError::ShortFrame { .. }
            | FrontError::InterruptedHeaderBlock { .. }
            | FrontError::HeaderBlockTooLarge { .. }
            | FrontError::Hpack { .. }
            | FrontError::WriteServer(_) => false,
        }
    }
}

/// The connections accepted on `listener`, each already behind the front: what tonic's
/// `serve_with_incoming` takes in place of the listener itself.
pub fn incoming(listener: UnixListener) -> Incoming {
    Incoming { listener }
}

/// See [`incoming`].
#[derive(Debug)]
pub struct Incoming {
    listener: UnixListener,
}

impl Stream for Incoming {
    type Item = io::Result<DuplexStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.listener.poll_accept(cx) {
            Poll::Ready(Ok((client, _))) => Poll::Ready(Some(Ok(front(client)))),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Starts relaying `client` and returns the end tonic serves.
fn front(client: UnixStream) -> DuplexStream {
    let (server_side, relay_side) = tokio::io::duplex(PIPE_BYTES);
    tokio::spawn(async move {
        // A connection the front or the server closes costs a client (a sidecar exits when
        // it loses its connection), so it says which step failed; one the client dropped
        // (a probe, an abandoned call, a killed process) is the client's business.
        match relay(client, relay_side).await {
            Ok(Ended::ByClient) => {}
            // tonic closes a connection only at shutdown or on an error it keeps at debug: a
            // sidecar that then exits with "Lost connection" is explained here.
            Ok(Ended::ByServer) => {
                tracing::info!("the gRPC server closed a connection its client still held");
            }
            Err(e) if e.is_the_clients_leaving() => {
                tracing::debug!(error = %e, "the client left its gRPC connection");
            }
            Err(e) => tracing::warn!(error = %e, "gRPC connection closed by the HTTP/2 front"),
        }
    });
    server_side
}

/// Which side ended a connection that closed without an error.
#[derive(Debug, PartialEq)]
enum Ended {
    /// The client's end of stream came first; the server's close followed it.
    ByClient,
    /// The server closed while the client still held its side open.
    ByServer,
}

/// Client → server through [`HeaderRewriter`], server → client verbatim. Each direction
/// closes its writer at its reader's end, so either side's half-close reaches the other; a
/// client that breaks the protocol loses the connection at once.
async fn relay<C, S>(client: C, server: S) -> Result<Ended, FrontError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, mut server_write) = tokio::io::split(server);
    let clients_end_seen = AtomicBool::new(false);
    let upstream = async {
        rewrite_stream(BufReader::new(client_read), &mut server_write).await?;
        clients_end_seen.store(true, Ordering::SeqCst);
        server_write
            .shutdown()
            .await
            .map_err(FrontError::WriteServer)
    };
    let downstream = async {
        tokio::io::copy(&mut server_read, &mut client_write)
            .await
            .map_err(FrontError::WriteClient)?;
        let ended = if clients_end_seen.load(Ordering::SeqCst) {
            Ended::ByClient
        } else {
            Ended::ByServer
        };
        client_write
            .shutdown()
            .await
            .map_err(FrontError::WriteClient)?;
        Ok(ended)
    };
    tokio::try_join!(upstream, downstream).map(|((), ended)| ended)
}

/// Copies the client's byte stream to `server`, header blocks rewritten, until the client's
/// end of stream.
async fn rewrite_stream<R, W>(mut client: R, server: &mut W) -> Result<(), FrontError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE.len()];
    client
        .read_exact(&mut preface)
        .await
        .map_err(FrontError::ReadPreface)?;
    if &preface != PREFACE {
        return Err(FrontError::NotHttp2);
    }
    server
        .write_all(PREFACE)
        .await
        .map_err(FrontError::WriteServer)?;
    let mut rewriter = HeaderRewriter::default();
    while let Some(frame) = read_frame(&mut client).await? {
        let out = rewriter.frame(frame)?;
        server
            .write_all(&out)
            .await
            .map_err(FrontError::WriteServer)?;
    }
    Ok(())
}

/// One HTTP/2 frame as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    kind: u8,
    flags: u8,
    /// With the reserved bit as received: frames passed through are passed through exactly.
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    fn stream_id(&self) -> u32 {
        self.stream & 0x7fff_ffff
    }

    fn write_to(&self, out: &mut Vec<u8>) {
        write_frame(out, self.kind, self.flags, self.stream, &self.payload);
    }
}

fn write_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    // 24 bits: payloads come from a 24-bit length or are at most MAX_FRAME.
    let len = payload.len().to_be_bytes();
    out.extend_from_slice(&len[len.len() - 3..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// The next frame, or `None` when the client ends its stream between frames.
async fn read_frame<R: AsyncRead + Unpin>(client: &mut R) -> Result<Option<Frame>, FrontError> {
    let mut head = [0u8; FRAME_HEADER];
    if client
        .read(&mut head[..1])
        .await
        .map_err(FrontError::ReadFrame)?
        == 0
    {
        return Ok(None);
    }
    client
        .read_exact(&mut head[1..])
        .await
        .map_err(FrontError::ReadFrame)?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    client
        .read_exact(&mut payload)
        .await
        .map_err(FrontError::ReadFrame)?;
    Ok(Some(Frame {
        kind: head[3],
        flags: head[4],
        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]),
        payload,
    }))
}

/// A header block whose CONTINUATION frames have not all arrived.
struct PendingBlock {
    stream: u32,
    end_stream: bool,
    /// The stream dependency and weight of a HEADERS frame with PRIORITY, kept as sent.
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

/// The client → server half of the front, frame by frame. Holds the client's HPACK state: every
/// header block of the connection must pass through the same rewriter, in order.
#[derive(Default)]
struct HeaderRewriter {
    decoder: loona_hpack::Decoder<'static>,
    pending: Option<PendingBlock>,
}

impl HeaderRewriter {
    /// The bytes to send the server in place of `frame`: none while a header block waits for
    /// its CONTINUATION frames.
    fn frame(&mut self, frame: Frame) -> Result<Vec<u8>, FrontError> {
        let mut out = Vec::new();
        if let Some(pending) = &mut self.pending {
            // RFC 9113 §6.10: nothing may come between a header block's frames.
            if frame.kind != CONTINUATION || frame.stream_id() != pending.stream {
                return Err(FrontError::InterruptedHeaderBlock {
                    kind: frame.kind,
                    stream: pending.stream,
                });
            }
            append(&mut pending.block, &frame.payload, pending.stream)?;
            if frame.flags & END_HEADERS != 0 {
                if let Some(done) = self.pending.take() {
                    self.emit(done, &mut out)?;
                }
            }
            return Ok(out);
        }
        if frame.kind != HEADERS {
            frame.write_to(&mut out);
            return Ok(out);
        }
        let stream = frame.stream_id();
        let fragment = headers_fragment(&frame)?;
        let mut pending = PendingBlock {
            stream,
            end_stream: frame.flags & END_STREAM != 0,
            priority: fragment.priority,
            block: Vec::new(),
        };
        append(&mut pending.block, fragment.block, stream)?;
        if frame.flags & END_HEADERS != 0 {
            self.emit(pending, &mut out)?;
        } else {
            self.pending = Some(pending);
        }
        Ok(out)
    }

    /// Decodes a complete block, fixes its authority and writes it as HEADERS and as many
    /// CONTINUATION frames as its size needs.
    fn emit(&mut self, pending: PendingBlock, out: &mut Vec<u8>) -> Result<(), FrontError> {
        let fields = self
            .decoder
            .decode(&pending.block)
            .map_err(|e| FrontError::Hpack {
                stream: pending.stream,
                reason: e.to_string(),
            })?;
        let mut block = Vec::with_capacity(pending.block.len() + 64);
        for (name, value) in &fields {
            let value = if name == b":authority" && !is_authority(value) {
                LOCAL_AUTHORITY
            } else {
                value.as_slice()
            };
            encode_literal(name, value, &mut block);
        }
        let mut first = Vec::with_capacity(MAX_FRAME);
        let mut flags = 0;
        if pending.end_stream {
            flags |= END_STREAM;
        }
        if let Some(priority) = pending.priority {
            flags |= PRIORITY;
            first.extend_from_slice(&priority);
        }
        let room = MAX_FRAME - first.len();
        let (head, mut rest) = block.split_at(block.len().min(room));
        first.extend_from_slice(head);
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        write_frame(out, HEADERS, flags, pending.stream, &first);
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME));
            rest = tail;
            let flags = if rest.is_empty() { END_HEADERS } else { 0 };
            write_frame(out, CONTINUATION, flags, pending.stream, chunk);
        }
        Ok(())
    }
}

fn append(block: &mut Vec<u8>, fragment: &[u8], stream: u32) -> Result<(), FrontError> {
    if block.len() + fragment.len() > MAX_HEADER_BLOCK {
        return Err(FrontError::HeaderBlockTooLarge { stream });
    }
    block.extend_from_slice(fragment);
    Ok(())
}

/// A HEADERS frame's payload without its padding, split from its priority fields.
struct HeadersFragment<'a> {
    priority: Option<[u8; 5]>,
    block: &'a [u8],
}

fn headers_fragment(frame: &Frame) -> Result<HeadersFragment<'_>, FrontError> {
    let short = || FrontError::ShortFrame {
        kind: frame.kind,
        stream: frame.stream_id(),
    };
    let mut rest = frame.payload.as_slice();
    if frame.flags & PADDED != 0 {
        let (&pad, tail) = rest.split_first().ok_or_else(short)?;
        let keep = tail.len().checked_sub(pad as usize).ok_or_else(short)?;
        rest = &tail[..keep];
    }
    let priority = if frame.flags & PRIORITY != 0 {
        let (fields, tail) = rest.split_first_chunk::<5>().ok_or_else(short)?;
        rest = tail;
        Some(*fields)
    } else {
        None
    };
    Ok(HeadersFragment {
        priority,
        block: rest,
    })
}

/// Whether h2 takes `value` as an `:authority` (the same parse it makes).
fn is_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// RFC 7541 §6.2.2, literal name, no Huffman coding: nothing enters the server's dynamic table.
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    for string in [name, value] {
        // Writing to a Vec never fails.
        let _ = loona_hpack::encoder::encode_integer_into(string.len(), 7, 0, out);
        out.extend_from_slice(string);
    }
}

#[cfg(test)]
mod tests;
