//! The client side of the NBD fixed-newstyle handshake, up to the start of transmission.
//!
//! After a successful handshake the socket is handed to the kernel, which speaks the
//! transmission phase itself. Structured replies are therefore never negotiated: the kernel
//! only understands simple replies.
//!
//! Written by hand: the crates that speak NBD are servers or user-space clients that keep the
//! socket for themselves; none stops after the handshake and yields the negotiated socket.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::grant::Grant;

use crate::protocol::{
    info, opt, rep, ClientFlags, HandshakeFlags, TransmissionFlags, CLISERV_MAGIC, IHAVEOPT,
    NBDMAGIC, OPT_REPLY_MAGIC,
};

/// No legitimate option reply to the options we send is anywhere near this long (strings in
/// the protocol are capped at 4096 bytes); a longer length is a broken or hostile peer.
pub const MAX_REPLY_LEN: u32 = 16 * 1024;

/// Block-size constraints advertised with `NBD_INFO_BLOCK_SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    pub minimum: u32,
    pub preferred: u32,
    pub maximum: u32,
}

/// What the server told us about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: TransmissionFlags,
    pub block_sizes: Option<BlockSizes>,
    /// The TLS session the connection carries (`nbds://`), handed to the kernel.
    pub tls: Option<TlsSession>,
}

/// What a TLS handshake negotiated, in rustls' names (e.g. `TLSv1_3`,
/// `TLS13_AES_256_GCM_SHA384`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TlsSession {
    pub version: &'static str,
    pub cipher: &'static str,
}

impl std::fmt::Display for TlsSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.version, self.cipher)
    }
}

impl ExportInfo {
    pub fn read_only(&self) -> bool {
        self.flags.contains(TransmissionFlags::READ_ONLY)
    }

    pub fn multi_conn(&self) -> bool {
        self.flags.contains(TransmissionFlags::CAN_MULTI_CONN)
    }
}

/// Why the handshake failed. Each variant says what the peer did, so an operator can tell a
/// wrong export name from a server that is not an NBD server at all.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connection failed during the handshake ({during})")]
    Io {
        during: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("server closed the connection during the handshake ({during})")]
    Closed { during: &'static str },
    #[error("peer is not an NBD server: bad magic {got:#018x} ({during})")]
    BadMagic { during: &'static str, got: u64 },
    #[error(
        "server speaks the oldstyle NBD protocol, which has no export names; use a newstyle server"
    )]
    OldStyle,
    #[error("server replied about option {got} while option {expected} was pending")]
    WrongOption { expected: u32, got: u32 },
    #[error("server sent an option reply of {len} bytes, more than the {max} allowed")]
    Oversized { len: u32, max: u32 },
    #[error("server has no export named {export:?}{}", detail(.message))]
    UnknownExport { export: String, message: String },
    #[error("server refused export {export:?} by policy{}", detail(.message))]
    PolicyRefused { export: String, message: String },
    #[error("server requires TLS: use an nbds:// URI{}", detail(.message))]
    TlsRequired { message: String },
    #[error("server refused STARTTLS, and the URI requires TLS (no plaintext fallback){}", detail(.message))]
    TlsRefused { message: String },
    #[error("server closed the connection after NBD_OPT_EXPORT_NAME: export {export:?} is unknown or refused")]
    ExportNameRejected { export: String },
    #[error("server answered with {name} ({code:#x}){}", detail(.message))]
    ServerError {
        code: u32,
        name: &'static str,
        message: String,
    },
    #[error("malformed reply from server: {0}")]
    Malformed(String),
    #[error("option {option} would carry {len} bytes, more than its 32-bit length can say")]
    OptionTooLong { option: u32, len: usize },
}

fn detail(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

/// Runs the handshake for `export` (asked for with `grant`, see [`crate::grant`]) on a
/// connected stream and returns what the server said about the export. The caller bounds it
/// with a deadline.
pub async fn negotiate<S>(
    stream: &mut S,
    export: &str,
    grant: Option<&Grant>,
) -> Result<ExportInfo, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let greeting = greet(stream).await?;
    select_export(stream, &greeting, export, grant).await
}

/// What the server's greeting allows for the rest of the handshake.
#[derive(Debug, Clone, Copy)]
pub struct Greeting {
    fixed_newstyle: bool,
    no_zeroes: bool,
}

/// Reads the server's greeting and answers with the client flags.
pub async fn greet<S>(stream: &mut S) -> Result<Greeting, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let magic = step(stream.read_u64(), "server greeting").await?;
    if magic != NBDMAGIC {
        return Err(HandshakeError::BadMagic {
            during: "server greeting",
            got: magic,
        });
    }
    match step(stream.read_u64(), "server greeting").await? {
        IHAVEOPT => {}
        CLISERV_MAGIC => return Err(HandshakeError::OldStyle),
        got => {
            return Err(HandshakeError::BadMagic {
                during: "server greeting",
                got,
            })
        }
    }
    let server =
        HandshakeFlags::from_bits_retain(step(stream.read_u16(), "handshake flags").await?);
    let mut client = ClientFlags::empty();
    let fixed_newstyle = server.contains(HandshakeFlags::FIXED_NEWSTYLE);
    if fixed_newstyle {
        client |= ClientFlags::FIXED_NEWSTYLE;
    }
    let no_zeroes = server.contains(HandshakeFlags::NO_ZEROES);
    if no_zeroes {
        client |= ClientFlags::NO_ZEROES;
    }
    step(
        stream.write_all(&client.bits().to_be_bytes()),
        "client flags",
    )
    .await?;
    Ok(Greeting {
        fixed_newstyle,
        no_zeroes,
    })
}

/// `NBD_OPT_STARTTLS`: after an acknowledgement the caller runs the TLS handshake on the same
/// stream and continues the NBD handshake inside it. A server that refuses is an error: there
/// is no fallback to plaintext.
pub async fn start_tls<S>(stream: &mut S, greeting: &Greeting) -> Result<(), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    if !greeting.fixed_newstyle {
        return Err(HandshakeError::TlsRefused {
            message: "the server does not speak fixed newstyle, which STARTTLS needs".into(),
        });
    }
    send_option(stream, opt::STARTTLS, &[]).await?;
    let reply = read_reply(stream, opt::STARTTLS).await?;
    match reply.kind {
        rep::ACK => Ok(()),
        code if code & rep::FLAG_ERROR != 0 => Err(HandshakeError::TlsRefused {
            message: format!(
                "{}{}",
                rep::error_name(code),
                detail(String::from_utf8_lossy(&reply.data).trim())
            ),
        }),
        other => Err(HandshakeError::Malformed(format!(
            "unexpected reply type {other} to NBD_OPT_STARTTLS"
        ))),
    }
}

/// Asks for `export` (NBD_OPT_GO, or EXPORT_NAME from servers without fixed newstyle) and
/// ends the handshake. With a grant, the name on the wire carries its token; errors name the
/// export without it.
pub async fn select_export<S>(
    stream: &mut S,
    greeting: &Greeting,
    export: &str,
    grant: Option<&Grant>,
) -> Result<ExportInfo, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let wire = crate::grant::wire_name(export, grant);
    let names = Names {
        wire: &wire,
        shown: export,
    };
    // Without fixed newstyle the server may drop the connection on any option it does not
    // know, so only the one every newstyle server understands is safe.
    if greeting.fixed_newstyle {
        match opt_go(stream, names).await? {
            GoOutcome::Ready(info) => return Ok(info),
            GoOutcome::Unsupported => {
                tracing::debug!("server does not know NBD_OPT_GO; falling back to EXPORT_NAME")
            }
        }
    }
    export_name(stream, names, greeting.no_zeroes).await
}

/// An export's name as sent (with a grant's token) and as errors show it (without).
#[derive(Clone, Copy)]
struct Names<'a> {
    wire: &'a str,
    shown: &'a str,
}

enum GoOutcome {
    Ready(ExportInfo),
    Unsupported,
}

async fn opt_go<S>(stream: &mut S, names: Names<'_>) -> Result<GoOutcome, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let name = names.wire.as_bytes();
    let mut data = Vec::with_capacity(name.len() + 8);
    let name_len = u32::try_from(name.len()).map_err(|_| HandshakeError::OptionTooLong {
        option: opt::GO,
        len: name.len(),
    })?;
    data.extend_from_slice(&name_len.to_be_bytes());
    data.extend_from_slice(name);
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
    send_option(stream, opt::GO, &data).await?;

    let mut size_flags = None;
    let mut block_sizes = None;
    loop {
        let reply = read_reply(stream, opt::GO).await?;
        match reply.kind {
            rep::INFO => match parse_info(&reply.data)? {
                Info::Export { size, flags } => size_flags = Some((size, flags)),
                Info::BlockSizes(b) => block_sizes = Some(b),
                Info::Other => {}
            },
            rep::ACK => {
                let (size, flags) = size_flags.ok_or_else(|| {
                    HandshakeError::Malformed(
                        "NBD_OPT_GO acknowledged without NBD_INFO_EXPORT".into(),
                    )
                })?;
                return Ok(GoOutcome::Ready(ExportInfo {
                    size,
                    flags,
                    block_sizes,
                    tls: None,
                }));
            }
            rep::ERR_UNSUP => return Ok(GoOutcome::Unsupported),
            code if code & rep::FLAG_ERROR != 0 => {
                return Err(error_reply(code, &reply.data, names.shown))
            }
            other => {
                return Err(HandshakeError::Malformed(format!(
                    "unexpected reply type {other} to NBD_OPT_GO"
                )))
            }
        }
    }
}

async fn export_name<S>(
    stream: &mut S,
    names: Names<'_>,
    no_zeroes: bool,
) -> Result<ExportInfo, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    send_option(stream, opt::EXPORT_NAME, names.wire.as_bytes()).await?;
    // The server's only way to refuse EXPORT_NAME is to hang up.
    let rejected = |e: HandshakeError| match e {
        HandshakeError::Closed { .. } => HandshakeError::ExportNameRejected {
            export: names.shown.to_owned(),
        },
        other => other,
    };
    let size = step(stream.read_u64(), "export size")
        .await
        .map_err(rejected)?;
    let flags = flags(step(stream.read_u16(), "transmission flags").await?)?;
    if !no_zeroes {
        let mut zeroes = [0u8; 124];
        step(stream.read_exact(&mut zeroes), "export padding").await?;
    }
    Ok(ExportInfo {
        size,
        flags,
        block_sizes: None,
        tls: None,
    })
}

enum Info {
    Export { size: u64, flags: TransmissionFlags },
    BlockSizes(BlockSizes),
    Other,
}

/// What follows the 2-byte type of an info reply that is `N` bytes long exactly.
fn info_body<const N: usize>(data: &[u8], name: &str) -> Result<[u8; N], HandshakeError> {
    data[2..].try_into().map_err(|_| {
        HandshakeError::Malformed(format!(
            "{name} is {} bytes, expected {}",
            data.len(),
            N + 2
        ))
    })
}

fn parse_info(data: &[u8]) -> Result<Info, HandshakeError> {
    let kind = data
        .get(..2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .ok_or_else(|| HandshakeError::Malformed("NBD_REP_INFO shorter than its type".into()))?;
    match kind {
        info::EXPORT => {
            let body: [u8; 10] = info_body(data, "NBD_INFO_EXPORT")?;
            let size = u64::from_be_bytes(body[..8].try_into().unwrap_or_default());
            let flags = flags(u16::from_be_bytes([body[8], body[9]]))?;
            Ok(Info::Export { size, flags })
        }
        info::BLOCK_SIZE => {
            let body: [u8; 12] = info_body(data, "NBD_INFO_BLOCK_SIZE")?;
            let word =
                |i: usize| u32::from_be_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
            let sizes = BlockSizes {
                minimum: word(0),
                preferred: word(4),
                maximum: word(8),
            };
            if !sizes.minimum.is_power_of_two() || !sizes.preferred.is_power_of_two() {
                return Err(HandshakeError::Malformed(format!(
                    "block sizes must be powers of two: {sizes:?}"
                )));
            }
            Ok(Info::BlockSizes(sizes))
        }
        _ => Ok(Info::Other),
    }
}

fn flags(raw: u16) -> Result<TransmissionFlags, HandshakeError> {
    let flags = TransmissionFlags::from_bits_retain(raw);
    if !flags.contains(TransmissionFlags::HAS_FLAGS) {
        return Err(HandshakeError::Malformed(format!(
            "transmission flags {raw:#06x} lack NBD_FLAG_HAS_FLAGS"
        )));
    }
    Ok(flags)
}

fn error_reply(code: u32, data: &[u8], export: &str) -> HandshakeError {
    let message = String::from_utf8_lossy(data).trim().to_owned();
    let export = export.to_owned();
    match code {
        rep::ERR_UNKNOWN => HandshakeError::UnknownExport { export, message },
        rep::ERR_POLICY => HandshakeError::PolicyRefused { export, message },
        rep::ERR_TLS_REQD => HandshakeError::TlsRequired { message },
        _ => HandshakeError::ServerError {
            code,
            name: rep::error_name(code),
            message,
        },
    }
}

struct Reply {
    kind: u32,
    data: Vec<u8>,
}

async fn send_option<S>(stream: &mut S, option: u32, data: &[u8]) -> Result<(), HandshakeError>
where
    S: AsyncWrite + Unpin,
{
    let mut buf = Vec::with_capacity(16 + data.len());
    buf.extend_from_slice(&IHAVEOPT.to_be_bytes());
    buf.extend_from_slice(&option.to_be_bytes());
    let len = u32::try_from(data.len()).map_err(|_| HandshakeError::OptionTooLong {
        option,
        len: data.len(),
    })?;
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(data);
    step(stream.write_all(&buf), "option request").await?;
    stream.flush().await.map_err(|source| HandshakeError::Io {
        during: "option request",
        source,
    })
}

async fn read_reply<S>(stream: &mut S, option: u32) -> Result<Reply, HandshakeError>
where
    S: AsyncRead + Unpin,
{
    const DURING: &str = "option reply";
    let magic = step(stream.read_u64(), DURING).await?;
    if magic != OPT_REPLY_MAGIC {
        return Err(HandshakeError::BadMagic {
            during: DURING,
            got: magic,
        });
    }
    let got = step(stream.read_u32(), DURING).await?;
    if got != option {
        return Err(HandshakeError::WrongOption {
            expected: option,
            got,
        });
    }
    let kind = step(stream.read_u32(), DURING).await?;
    let len = step(stream.read_u32(), DURING).await?;
    if len > MAX_REPLY_LEN {
        return Err(HandshakeError::Oversized {
            len,
            max: MAX_REPLY_LEN,
        });
    }
    let mut data = vec![0; len as usize];
    step(stream.read_exact(&mut data), DURING).await?;
    Ok(Reply { kind, data })
}

fn io_error(during: &'static str, source: io::Error) -> HandshakeError {
    if source.kind() == io::ErrorKind::UnexpectedEof {
        HandshakeError::Closed { during }
    } else {
        HandshakeError::Io { during, source }
    }
}

/// One read or write of the handshake, its failure named by what it was `during`.
async fn step<T>(
    op: impl std::future::Future<Output = io::Result<T>>,
    during: &'static str,
) -> Result<T, HandshakeError> {
    op.await.map_err(|e| io_error(during, e))
}

#[cfg(test)]
mod tests {
    //! The client against a scripted in-memory server. Real servers (nbdkit, qemu-nbd) are
    //! exercised in `tests/handshake.rs`.
    use super::*;
    use tokio::io::{duplex, DuplexStream};

    /// Server side of a scripted exchange: greets, then lets the test drive it.
    struct Peer(DuplexStream);

    impl Peer {
        async fn greet(&mut self, flags: u16) {
            self.0.write_u64(NBDMAGIC).await.unwrap();
            self.0.write_u64(IHAVEOPT).await.unwrap();
            self.0.write_u16(flags).await.unwrap();
            let client = self.0.read_u32().await.unwrap();
            assert_eq!(
                client & 1,
                u32::from(flags & 1),
                "client echoes FIXED_NEWSTYLE"
            );
        }

        async fn read_option(&mut self) -> (u32, Vec<u8>) {
            assert_eq!(self.0.read_u64().await.unwrap(), IHAVEOPT);
            let option = self.0.read_u32().await.unwrap();
            let len = self.0.read_u32().await.unwrap();
            let mut data = vec![0; len as usize];
            self.0.read_exact(&mut data).await.unwrap();
            (option, data)
        }

        async fn reply(&mut self, option: u32, kind: u32, data: &[u8]) {
            self.0.write_u64(OPT_REPLY_MAGIC).await.unwrap();
            self.0.write_u32(option).await.unwrap();
            self.0.write_u32(kind).await.unwrap();
            self.0
                .write_u32(u32::try_from(data.len()).unwrap())
                .await
                .unwrap();
            self.0.write_all(data).await.unwrap();
        }
    }

    fn export_info(size: u64, flags: u16) -> Vec<u8> {
        let mut d = info::EXPORT.to_be_bytes().to_vec();
        d.extend_from_slice(&size.to_be_bytes());
        d.extend_from_slice(&flags.to_be_bytes());
        d
    }

    async fn run<F, Fut>(export: &str, script: F) -> Result<ExportInfo, HandshakeError>
    where
        F: FnOnce(Peer) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (mut client, server) = duplex(64 * 1024);
        let peer = tokio::spawn(script(Peer(server)));
        let result = negotiate(&mut client, export, None).await;
        drop(client);
        peer.await.unwrap();
        result
    }

    /// The error of a handshake whose server greets, reads the one option and answers it with
    /// one reply of `kind` to `option`, carrying `data`.
    async fn refused_by_reply(option: u32, kind: u32, data: Vec<u8>) -> HandshakeError {
        run("e", move |mut p| async move {
            p.greet(3).await;
            p.read_option().await;
            p.reply(option, kind, &data).await;
        })
        .await
        .unwrap_err()
    }

    /// The error of a handshake whose server greets, reads the one option and starts a reply
    /// to it that says it is `len` bytes long, then sends `partial` of them and hangs up.
    async fn refused_by_reply_header(len: u32, partial: &'static [u8]) -> HandshakeError {
        run("e", move |mut p| async move {
            p.greet(3).await;
            p.read_option().await;
            p.0.write_u64(OPT_REPLY_MAGIC).await.unwrap();
            p.0.write_u32(opt::GO).await.unwrap();
            p.0.write_u32(rep::INFO).await.unwrap();
            p.0.write_u32(len).await.unwrap();
            p.0.write_all(partial).await.unwrap();
        })
        .await
        .unwrap_err()
    }

    #[tokio::test]
    async fn opt_go_returns_size_flags_and_block_sizes() {
        let info = run("disk", |mut p| async move {
            p.greet(3).await;
            let (option, data) = p.read_option().await;
            assert_eq!(option, opt::GO);
            assert_eq!(&data[..4], &4u32.to_be_bytes());
            assert_eq!(&data[4..8], b"disk");
            assert_eq!(
                &data[8..],
                &[0, 1, 0, 3],
                "asks for NBD_INFO_BLOCK_SIZE only"
            );
            p.reply(opt::GO, rep::INFO, &export_info(1 << 26, 0x0103))
                .await;
            let mut bs = info::BLOCK_SIZE.to_be_bytes().to_vec();
            for v in [512u32, 4096, 1 << 25] {
                bs.extend_from_slice(&v.to_be_bytes());
            }
            p.reply(opt::GO, rep::INFO, &bs).await;
            p.reply(opt::GO, rep::ACK, &[]).await;
        })
        .await
        .unwrap();
        assert_eq!(info.size, 1 << 26);
        assert!(info.read_only() && info.multi_conn());
        assert_eq!(
            info.block_sizes,
            Some(BlockSizes {
                minimum: 512,
                preferred: 4096,
                maximum: 1 << 25
            })
        );
    }

    #[tokio::test]
    async fn falls_back_to_export_name_on_unsup() {
        let info = run("old", |mut p| async move {
            p.greet(1).await; // fixed newstyle, no NO_ZEROES: 124 zero bytes follow
            let (option, _) = p.read_option().await;
            assert_eq!(option, opt::GO);
            p.reply(opt::GO, rep::ERR_UNSUP, b"").await;
            let (option, data) = p.read_option().await;
            assert_eq!(option, opt::EXPORT_NAME);
            assert_eq!(data, b"old");
            p.0.write_u64(4096).await.unwrap();
            p.0.write_u16(0x0005).await.unwrap();
            p.0.write_all(&[0; 124]).await.unwrap();
        })
        .await
        .unwrap();
        assert_eq!(info.size, 4096);
        assert!(info.flags.contains(TransmissionFlags::SEND_FLUSH));
        assert_eq!(info.block_sizes, None);
    }

    #[tokio::test]
    async fn non_fixed_server_gets_export_name_only() {
        let info = run("x", |mut p| async move {
            p.greet(2).await;
            let (option, _) = p.read_option().await;
            assert_eq!(option, opt::EXPORT_NAME, "no OPT_GO without FIXED_NEWSTYLE");
            p.0.write_u64(8192).await.unwrap();
            p.0.write_u16(0x0001).await.unwrap();
        })
        .await
        .unwrap();
        assert_eq!(info.size, 8192);
    }

    /// The grant's token is sent in the name, and a refusal names the export without it.
    #[tokio::test]
    async fn a_grant_goes_on_the_wire_and_nowhere_else() {
        let (mut client, server) = duplex(64 * 1024);
        let peer = tokio::spawn(async move {
            let mut p = Peer(server);
            p.greet(3).await;
            let (option, data) = p.read_option().await;
            assert_eq!(option, opt::GO);
            let len = u32::from_be_bytes(data[..4].try_into().unwrap()) as usize;
            assert_eq!(&data[4..4 + len], b"pvc-1@5ecret");
            p.reply(opt::GO, rep::ERR_POLICY, b"no live grant").await;
        });
        let grant = Grant::new("5ecret").unwrap();
        let err = negotiate(&mut client, "pvc-1", Some(&grant))
            .await
            .unwrap_err();
        peer.await.unwrap();
        assert!(
            matches!(&err, HandshakeError::PolicyRefused { export, .. } if export == "pvc-1"),
            "{err:?}"
        );
        assert!(!format!("{err} {err:?}").contains("5ecret"), "{err:?}");
    }

    #[tokio::test]
    async fn export_name_hang_up_means_rejected() {
        let err = run("nope", |mut p| async move {
            p.greet(2).await;
            p.read_option().await;
        })
        .await
        .unwrap_err();
        assert!(
            matches!(err, HandshakeError::ExportNameRejected { ref export } if export == "nope"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn error_replies_are_named() {
        for (code, check) in [
            (rep::ERR_UNKNOWN, "no export named \"e\": no such thing"),
            (
                rep::ERR_POLICY,
                "refused export \"e\" by policy: no such thing",
            ),
            (rep::ERR_TLS_REQD, "requires TLS"),
            (rep::ERR_SHUTDOWN, "NBD_REP_ERR_SHUTDOWN"),
        ] {
            let err = refused_by_reply(opt::GO, code, b"no such thing".to_vec()).await;
            assert!(err.to_string().contains(check), "{code:#x}: {err}");
        }
    }

    #[tokio::test]
    async fn malformed_peers_are_refused() {
        let err = run("e", |mut p| async move {
            p.0.write_all(b"HTTP/1.1 400 Bad\r\n").await.unwrap();
        })
        .await
        .unwrap_err();
        assert!(matches!(err, HandshakeError::BadMagic { .. }), "{err}");

        let err = run("e", |mut p| async move {
            p.0.write_u64(NBDMAGIC).await.unwrap();
            p.0.write_u64(CLISERV_MAGIC).await.unwrap();
        })
        .await
        .unwrap_err();
        assert!(matches!(err, HandshakeError::OldStyle), "{err}");

        let err = refused_by_reply_header(1 << 30, &[]).await;
        assert!(
            matches!(
                err,
                HandshakeError::Oversized {
                    len: 0x4000_0000,
                    ..
                }
            ),
            "{err}"
        );

        // 4 of 12 bytes, then hang up
        let err = refused_by_reply_header(12, &[0, 0, 1, 2]).await;
        assert!(
            matches!(
                err,
                HandshakeError::Closed {
                    during: "option reply"
                }
            ),
            "{err}"
        );

        let err = refused_by_reply(opt::GO, rep::INFO, export_info(10, 0)).await;
        assert!(err.to_string().contains("HAS_FLAGS"), "{err}");

        let err = refused_by_reply(opt::GO, rep::ACK, Vec::new()).await;
        assert!(err.to_string().contains("without NBD_INFO_EXPORT"), "{err}");

        let err = refused_by_reply(opt::ABORT, rep::ACK, Vec::new()).await;
        assert!(
            matches!(
                err,
                HandshakeError::WrongOption {
                    expected: 7,
                    got: 2
                }
            ),
            "{err}"
        );

        let err = refused_by_reply(opt::GO, rep::INFO, vec![0, 0, 1]).await;
        assert!(err.to_string().contains("expected 12"), "{err}");
    }
}
