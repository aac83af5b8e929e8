//! Storage-side fencing of the local backend: real nbdkit behind the gate, this repo's NBD
//! client dialing `<image>@<token>`, grants made and revoked through the backend as
//! ControllerPublish/Unpublish make them. No kernel needed: the tests speak the
//! transmission phase themselves.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use controller_shim::backend::local::LocalBackend;
use controller_shim::backend::{Backend, GrantToken, VolumeMeta};
use controller_shim::exports::ExportServer;
use controller_shim::metrics::ControllerMetrics;
use nbd::handshake::{negotiate, ExportInfo, HandshakeError};
use nbd::protocol::{opt, rep, IHAVEOPT, OPT_REPLY_MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const IMAGE: &str = "test-vol";
const SIZE: u64 = 4 << 20;

struct Fixture {
    backend: LocalBackend,
    listen: SocketAddr,
    metrics: ControllerMetrics,
    root: std::path::PathBuf,
    _dir: tempfile::TempDir,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let listen: SocketAddr = ([127, 0, 0, 1], testkit::free_port().unwrap()).into();
    let backend = LocalBackend::open(&root, &listen.to_string()).unwrap();
    let meta = VolumeMeta {
        name: "pvc".into(),
        size: SIZE,
        parameters: BTreeMap::new(),
        source: None,
        published: BTreeMap::new(),
        mutable: BTreeMap::new(),
        grants: BTreeMap::new(),
        adopted_by: None,
    };
    backend.create_volume(IMAGE, &meta).await.unwrap();
    let metrics = ControllerMetrics::default();
    let server = tokio::spawn(
        ExportServer {
            backend: backend.clone(),
            listen,
            metrics: Arc::clone(&metrics.gate),
        }
        .supervise(),
    );
    Fixture {
        backend,
        listen,
        metrics,
        root,
        _dir: dir,
        server,
    }
}

fn name(token: &GrantToken) -> String {
    format!("{IMAGE}@{}", token.expose())
}

/// A handshake for export `name`; retried while the server is still starting (the gate
/// hangs up while nbdkit's socket is not there yet).
async fn dial(f: &Fixture, name: &str) -> Result<(ExportInfo, TcpStream), HandshakeError> {
    let started = Instant::now();
    loop {
        let mut stream = match TcpStream::connect(f.listen).await {
            Ok(s) => s,
            Err(e) => {
                assert!(started.elapsed() < Duration::from_secs(10), "connect: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match negotiate(&mut stream, name, None).await {
            Ok(info) => return Ok((info, stream)),
            Err(HandshakeError::Closed { .. } | HandshakeError::Io { .. })
                if started.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

const REQUEST_MAGIC: u32 = 0x2560_9513;
const REPLY_MAGIC: u32 = 0x6744_6698;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;

/// One NBD command with simple replies: its error (0 for success) and the data read (empty
/// for a write or an error).
async fn raw_command(
    s: &mut TcpStream,
    cmd: u16,
    offset: u64,
    len: u32,
    data: &[u8],
) -> std::io::Result<(u32, Vec<u8>)> {
    let mut req = Vec::new();
    req.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    req.extend_from_slice(&0u16.to_be_bytes());
    req.extend_from_slice(&cmd.to_be_bytes());
    req.extend_from_slice(&7u64.to_be_bytes());
    req.extend_from_slice(&offset.to_be_bytes());
    req.extend_from_slice(&len.to_be_bytes());
    req.extend_from_slice(data);
    s.write_all(&req).await?;
    assert_eq!(s.read_u32().await?, REPLY_MAGIC);
    let error = s.read_u32().await?;
    assert_eq!(s.read_u64().await?, 7, "handle");
    let mut out = vec![
        0;
        if cmd == CMD_READ && error == 0 {
            len as usize
        } else {
            0
        }
    ];
    s.read_exact(&mut out).await?;
    Ok((error, out))
}

/// A command that must succeed: the data read.
async fn command(
    s: &mut TcpStream,
    cmd: u16,
    offset: u64,
    len: u32,
    data: &[u8],
) -> std::io::Result<Vec<u8>> {
    let (error, out) = raw_command(s, cmd, offset, len, data).await?;
    assert_eq!(error, 0, "NBD error reply");
    Ok(out)
}

/// Writes `data` at `offset` through the connection and reads it back.
async fn write_and_read(s: &mut TcpStream, offset: u64, data: &[u8]) -> std::io::Result<Vec<u8>> {
    let len = u32::try_from(data.len()).unwrap();
    command(s, CMD_WRITE, offset, len, data).await?;
    command(s, CMD_READ, offset, len, &[]).await
}

/// The peer has closed: a read gives EOF or a reset, well within a second.
async fn assert_cut(s: &mut TcpStream) {
    let mut byte = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(1), s.read(&mut byte)).await {
        Ok(Ok(0) | Err(_)) => {}
        Ok(Ok(n)) => panic!("read {n} bytes from a cut connection"),
        Err(_) => panic!("the connection is still open"),
    }
}

fn assert_refused(result: Result<(ExportInfo, TcpStream), HandshakeError>, what: &str) {
    match result {
        Err(HandshakeError::PolicyRefused { message, .. }) => assert!(
            message.contains("no live grant for this node"),
            "{what}: {message}"
        ),
        Err(e) => panic!("{what}: refused otherwise: {e}"),
        Ok(_) => panic!("{what}: admitted"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_grant_opens_the_export_and_writes_reach_the_image() {
    let f = fixture().await;
    let token = f.backend.grant(IMAGE, "node-a", false).await.unwrap();
    let (info, mut s) = dial(&f, &name(&token)).await.unwrap();
    assert_eq!(info.size, SIZE, "the image's size, as nbdkit sees the file");
    assert!(!info.read_only());
    let back = write_and_read(&mut s, 1 << 20, b"fenced but granted")
        .await
        .unwrap();
    assert_eq!(back, b"fenced but granted");
    drop(s);
    let file = f.root.join("images").join(IMAGE);
    assert_eq!(testkit::read_at(&file, 1 << 20, 18), b"fenced but granted");
    assert_eq!(
        f.backend.grant(IMAGE, "node-a", false).await.unwrap(),
        token,
        "a repeated grant answers the live grant's token"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_without_a_live_grant_are_refused_by_policy() {
    let f = fixture().await;
    let live = f.backend.grant(IMAGE, "node-a", false).await.unwrap();
    let revoked = f.backend.grant(IMAGE, "node-b", false).await.unwrap();
    f.backend.revoke(IMAGE, "node-b").await.unwrap();
    // The server is up once a live grant gets through.
    dial(&f, &name(&live)).await.unwrap();

    assert_refused(
        dial(&f, &name(&revoked)).await,
        "another node's revoked token",
    );
    let wrong = GrantToken::generate().unwrap();
    assert_refused(dial(&f, &name(&wrong)).await, "a wrong token");
    assert_refused(dial(&f, IMAGE).await, "no token");
    assert_refused(
        dial(&f, &format!("../meta/{IMAGE}@{}", live.expose())).await,
        "a live token on a name that is no image",
    );

    // EXPORT_NAME has no error reply: the gate hangs up.
    let mut s = TcpStream::connect(f.listen).await.unwrap();
    let greeting = nbd::handshake::greet(&mut s).await.unwrap();
    let _ = greeting;
    send_option(&mut s, opt::EXPORT_NAME, name(&wrong).as_bytes()).await;
    assert_cut(&mut s).await;

    // LIST would name every image, STARTTLS would hide the name: answered, not forwarded.
    let mut s = TcpStream::connect(f.listen).await.unwrap();
    nbd::handshake::greet(&mut s).await.unwrap();
    send_option(&mut s, 3, &[]).await;
    assert_eq!(reply_kind(&mut s, 3).await, rep::ERR_POLICY, "NBD_OPT_LIST");
    send_option(&mut s, opt::STARTTLS, &[]).await;
    assert_eq!(
        reply_kind(&mut s, opt::STARTTLS).await,
        rep::ERR_POLICY,
        "NBD_OPT_STARTTLS"
    );
    let text = f.metrics.render();
    for (reason, n) in [("no_grant", 3), ("no_token", 1), ("bad_name", 1)] {
        let line = format!("ustor_csi_controller_grant_refusals_total{{reason=\"{reason}\"}} {n}");
        assert!(text.contains(&line), "{line} in\n{text}");
    }
    assert!(
        !text.contains(live.expose()) && !text.contains(wrong.expose()),
        "no token in the metrics"
    );
}

async fn send_option(s: &mut TcpStream, option: u32, data: &[u8]) {
    s.write_u64(IHAVEOPT).await.unwrap();
    s.write_u32(option).await.unwrap();
    s.write_u32(u32::try_from(data.len()).unwrap())
        .await
        .unwrap();
    s.write_all(data).await.unwrap();
}

/// The type of the server's reply to `option`, its data skipped.
async fn reply_kind(s: &mut TcpStream, option: u32) -> u32 {
    assert_eq!(s.read_u64().await.unwrap(), OPT_REPLY_MAGIC);
    assert_eq!(s.read_u32().await.unwrap(), option);
    let kind = s.read_u32().await.unwrap();
    let len = s.read_u32().await.unwrap();
    let mut data = vec![0; len as usize];
    s.read_exact(&mut data).await.unwrap();
    kind
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_cuts_open_connections_before_it_returns() {
    let f = fixture().await;
    let token = f.backend.grant(IMAGE, "node-a", false).await.unwrap();
    let (_, mut first) = dial(&f, &name(&token)).await.unwrap();
    let (_, mut second) = dial(&f, &name(&token)).await.unwrap();
    write_and_read(&mut first, 0, b"before").await.unwrap();
    assert_eq!(f.backend.sessions().count(IMAGE, "node-a"), 2);

    f.backend.revoke(IMAGE, "node-a").await.unwrap();
    assert_eq!(f.backend.sessions().count(IMAGE, "node-a"), 0);
    assert_cut(&mut first).await;
    assert_cut(&mut second).await;
    assert!(
        write_and_read(&mut first, 0, b"after!").await.is_err(),
        "a write after the revoke goes nowhere"
    );
    assert_eq!(
        testkit::read_at(&f.root.join("images").join(IMAGE), 0, 6),
        b"before"
    );
    assert_refused(dial(&f, &name(&token)).await, "the revoked token");
    // Idempotent.
    f.backend.revoke(IMAGE, "node-a").await.unwrap();
    let again = f.backend.grant(IMAGE, "node-a", false).await.unwrap();
    assert_ne!(again, token, "a new grant has a new token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_of_two_nodes_live_together_and_one_revoke_leaves_the_other() {
    let f = fixture().await;
    let a = f.backend.grant(IMAGE, "node-a", false).await.unwrap();
    let b = f.backend.grant(IMAGE, "node-b", false).await.unwrap();
    assert_ne!(a, b);
    let (_, mut on_a) = dial(&f, &name(&a)).await.unwrap();
    let (_, mut on_b) = dial(&f, &name(&b)).await.unwrap();
    write_and_read(&mut on_a, 0, b"from a").await.unwrap();
    write_and_read(&mut on_b, 4096, b"from b").await.unwrap();
    let mut nodes = f.backend.granted_nodes(IMAGE).await.unwrap();
    nodes.sort();
    assert_eq!(nodes, ["node-a", "node-b"]);

    f.backend.revoke(IMAGE, "node-a").await.unwrap();
    assert_cut(&mut on_a).await;
    assert_eq!(
        write_and_read(&mut on_b, 8192, b"still b").await.unwrap(),
        b"still b",
        "node-b's connection is untouched"
    );
    assert_refused(dial(&f, &name(&a)).await, "node-a after its revoke");
    dial(&f, &name(&b)).await.unwrap();
    assert_eq!(f.backend.granted_nodes(IMAGE).await.unwrap(), ["node-b"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_grant_opens_only_a_read_only_export() {
    let f = fixture().await;
    let writer = f.backend.grant(IMAGE, "node-a", false).await.unwrap();
    let (_, mut rw) = dial(&f, &name(&writer)).await.unwrap();
    write_and_read(&mut rw, 0, b"written").await.unwrap();

    let reader = f.backend.grant(IMAGE, "node-b", true).await.unwrap();
    let (info, mut ro) = dial(&f, &name(&reader)).await.unwrap();
    assert!(info.read_only(), "the export is offered read-only");
    let (error, _) = raw_command(&mut ro, CMD_WRITE, 0, 7, b"ignored")
        .await
        .unwrap();
    assert_ne!(error, 0, "a write through a read-only grant fails");
    assert_eq!(
        command(&mut ro, CMD_READ, 0, 7, &[]).await.unwrap(),
        b"written"
    );
    assert_eq!(
        testkit::read_at(&f.root.join("images").join(IMAGE), 0, 7),
        b"written"
    );

    // Negotiated before the name was known, structured replies hold on the read-only
    // instance too.
    let mut s = TcpStream::connect(f.listen).await.unwrap();
    let greeting = nbd::handshake::greet(&mut s).await.unwrap();
    send_option(&mut s, 8, &[]).await;
    assert_eq!(
        reply_kind(&mut s, 8).await,
        rep::ACK,
        "NBD_OPT_STRUCTURED_REPLY"
    );
    let info = nbd::handshake::select_export(&mut s, &greeting, &name(&reader), None)
        .await
        .unwrap();
    assert!(info.read_only());
    let mut read = Vec::new();
    read.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    read.extend_from_slice(&[0, 0, 0, 0]); // flags, NBD_CMD_READ
    read.extend_from_slice(&[0; 8]); // handle
    read.extend_from_slice(&0u64.to_be_bytes());
    read.extend_from_slice(&7u32.to_be_bytes());
    s.write_all(&read).await.unwrap();
    assert_eq!(
        s.read_u32().await.unwrap(),
        0x668e_33ef,
        "a structured reply: the read-only instance was asked for them too"
    );
}
