//! The handshake against real servers (nbdkit, qemu-nbd) and against peers that misbehave on
//! a real socket. No kernel needed: these run on the host.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::io::Write;
use std::time::Duration;

use nbd::dial::{dial, DialOptions};
use nbd::handshake::HandshakeError;
use nbd::protocol::TransmissionFlags;
use nbd::{Error, NbdUri};
use testkit::{Listen, NbdServer};

const MIB: u64 = 1 << 20;

fn opts(connections: u8) -> DialOptions {
    DialOptions {
        deadline: Duration::from_secs(10),
        connections,
        ..DialOptions::default()
    }
}

fn handshake_error(e: Error) -> HandshakeError {
    match e {
        Error::Handshake { source, .. } => source,
        other => panic!("expected a handshake error, got {other:?}"),
    }
}

fn image(size: u64) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(size).unwrap();
    f
}

#[tokio::test]
async fn nbdkit_over_tcp_and_unix() {
    for listen in [Listen::Tcp, Listen::Unix] {
        let server = NbdServer::nbdkit(listen, &["memory", "64M"]).unwrap();
        let dialed = dial(&server.uri(), &opts(1)).await.unwrap();
        assert_eq!(dialed.info.size, 64 * MIB, "{listen:?}");
        assert!(dialed
            .info
            .flags
            .contains(TransmissionFlags::HAS_FLAGS | TransmissionFlags::SEND_FLUSH));
        assert!(!dialed.info.read_only());
        assert_eq!(dialed.sockets.len(), 1);
    }
}

#[tokio::test]
async fn qemu_nbd_named_export_and_unknown_export() {
    let img = image(16 * MIB);
    let server = NbdServer::qemu_nbd(Listen::Unix, img.path(), "disk-a", &[]).unwrap();
    let dialed = dial(&server.uri(), &opts(1)).await.unwrap();
    assert_eq!(dialed.info.size, 16 * MIB);
    let sizes = dialed
        .info
        .block_sizes
        .expect("qemu-nbd answers NBD_INFO_BLOCK_SIZE");
    assert!(sizes.minimum <= 512 && sizes.preferred >= 512, "{sizes:?}");

    let err = handshake_error(dial(&server.uri_for("disk-b"), &opts(1)).await.unwrap_err());
    assert!(
        matches!(err, HandshakeError::UnknownExport { ref export, .. } if export == "disk-b"),
        "{err}"
    );
}

#[tokio::test]
async fn read_only_export_is_flagged() {
    let server = NbdServer::nbdkit(Listen::Tcp, &["-r", "memory", "1M"]).unwrap();
    let dialed = dial(&server.uri(), &opts(1)).await.unwrap();
    assert!(dialed.info.read_only());
}

#[tokio::test]
async fn multi_conn_when_advertised_and_fallback_when_not() {
    let img = image(8 * MIB);
    let file = format!("file={}", img.path().display());
    let server = NbdServer::nbdkit(Listen::Tcp, &["file", &file]).unwrap();
    let dialed = dial(&server.uri(), &opts(4)).await.unwrap();
    assert!(
        dialed.info.multi_conn(),
        "nbdkit's file plugin advertises CAN_MULTI_CONN"
    );
    assert_eq!(dialed.sockets.len(), 4);

    let single = NbdServer::nbdkit(
        Listen::Tcp,
        &[
            "--filter=multi-conn",
            "file",
            &file,
            "multi-conn-mode=disable",
        ],
    )
    .unwrap();
    let dialed = dial(&single.uri(), &opts(4)).await.unwrap();
    assert!(!dialed.info.multi_conn());
    assert_eq!(dialed.sockets.len(), 1, "no multi-conn: one connection");

    assert!(matches!(
        dial(&server.uri(), &opts(0)).await,
        Err(Error::InvalidConnections(0))
    ));
    assert!(matches!(
        dial(&server.uri(), &opts(17)).await,
        Err(Error::InvalidConnections(17))
    ));
}

#[tokio::test]
async fn server_without_fixed_newstyle_gets_export_name() {
    // Masking the handshake flags makes nbdkit a plain newstyle server: only EXPORT_NAME.
    let server = NbdServer::nbdkit(Listen::Unix, &["--mask-handshake=0", "memory", "2M"]).unwrap();
    let dialed = dial(&server.uri(), &opts(1)).await.unwrap();
    assert_eq!(dialed.info.size, 2 * MIB);
    assert_eq!(
        dialed.info.block_sizes, None,
        "EXPORT_NAME carries no block sizes"
    );
}

#[tokio::test]
async fn oldstyle_server_is_named() {
    let server = NbdServer::nbdkit(Listen::Tcp, &["--oldstyle", "memory", "1M"]).unwrap();
    let err = handshake_error(dial(&server.uri(), &opts(1)).await.unwrap_err());
    assert!(matches!(err, HandshakeError::OldStyle), "{err}");
}

#[tokio::test]
async fn tls_required_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let psk = dir.path().join("keys.psk");
    let mut f = std::fs::File::create(&psk).unwrap();
    writeln!(f, "csi:0123456789abcdef0123456789abcdef").unwrap();
    let psk_arg = format!("--tls-psk={}", psk.display());
    let server =
        NbdServer::nbdkit(Listen::Tcp, &["--tls=require", &psk_arg, "memory", "1M"]).unwrap();
    let err = handshake_error(dial(&server.uri(), &opts(1)).await.unwrap_err());
    assert!(matches!(err, HandshakeError::TlsRequired { .. }), "{err}");
}

#[tokio::test]
async fn nothing_listening_is_a_connect_error() {
    let server = NbdServer::nbdkit(Listen::Tcp, &["memory", "1M"]).unwrap();
    let uri = server.uri();
    drop(server);
    let err = dial(&uri, &opts(1)).await.unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
    assert!(
        err.to_string().contains(&uri.to_string()),
        "the message names the URI: {err}"
    );
}

#[tokio::test]
async fn silent_peer_hits_the_deadline() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let uri = NbdUri::tcp("127.0.0.1", port, "x");
    let started = std::time::Instant::now();
    let err = dial(
        &uri,
        &DialOptions {
            deadline: Duration::from_millis(300),
            ..DialOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::DialTimeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(listener);
}

#[tokio::test]
async fn non_nbd_peer_is_refused_by_magic() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let peer = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await.unwrap();
    });
    let err = handshake_error(
        dial(&NbdUri::tcp("127.0.0.1", port, ""), &opts(1))
            .await
            .unwrap_err(),
    );
    assert!(matches!(err, HandshakeError::BadMagic { .. }), "{err}");
    peer.await.unwrap();
}

fn tls_opts(pki: &testkit::tls::TestPki) -> DialOptions {
    DialOptions {
        tls: Some(std::sync::Arc::new(nbd::tls::TlsFiles {
            ca: pki.file("ca-cert.pem"),
            client_cert: Some(pki.file("client-cert.pem")),
            client_key: Some(pki.file("client-key.pem")),
            server_name: None,
        })),
        ..opts(1)
    }
}

#[tokio::test]
async fn nbds_without_tls_settings_is_refused_before_dialing() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let uri = NbdUri::tcp("127.0.0.1", listener.local_addr().unwrap().port(), "x").with_tls();
    let err = dial(&uri, &opts(1)).await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::Tls {
                source: nbd::tls::TlsError::NotConfigured,
                ..
            }
        ),
        "{err}"
    );
    assert!(listener.accept().is_err(), "nothing may be dialed");
}

#[tokio::test]
async fn a_server_without_tls_is_never_used_in_plaintext_for_nbds() {
    let pki = testkit::tls::TestPki::new("test CA").unwrap();
    let server = NbdServer::nbdkit(Listen::Tcp, &["memory", "1M"]).unwrap();
    let err = handshake_error(
        dial(&server.uri().with_tls(), &tls_opts(&pki))
            .await
            .unwrap_err(),
    );
    assert!(matches!(err, HandshakeError::TlsRefused { .. }), "{err}");
}

#[tokio::test]
async fn a_server_certificate_of_another_ca_is_refused() {
    let ours = testkit::tls::TestPki::new("our CA").unwrap();
    let theirs = testkit::tls::TestPki::new("their CA").unwrap();
    let args = theirs.nbdkit_args();
    let mut argv: Vec<&str> = args.iter().map(String::as_str).collect();
    argv.extend(["memory", "1M"]);
    let server = NbdServer::nbdkit(Listen::Tcp, &argv).unwrap();
    let err = dial(&server.uri().with_tls(), &tls_opts(&ours))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Tls {
                source: nbd::tls::TlsError::Handshake(_),
                ..
            }
        ) && err.to_string().contains("UnknownIssuer"),
        "{err}"
    );
}
