use super::*;

use csi_proto::registration::registration_server::{Registration, RegistrationServer};
use csi_proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use prost::Message;

/// What kubelet's plugin watcher sends as `:authority`.
const SOCKET_PATH: &[u8] = b"/var/lib/kubelet/plugins_registry/ustor-nbd.csi.mindsw.io-reg.sock";
const DATA: u8 = 0x0;
const SETTINGS: u8 = 0x4;
const RST_STREAM: u8 = 0x3;
const ACK: u8 = 0x1;

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

fn request(path: &str, authority: &[u8]) -> Fields {
    [
        (&b":method"[..], &b"POST"[..]),
        (b":scheme", b"http"),
        (b":path", path.as_bytes()),
        (b":authority", authority),
        (b"content-type", b"application/grpc"),
        (b"user-agent", b"grpc-go/1.27.1"),
        (b"te", b"trailers"),
    ]
    .iter()
    .map(|(n, v)| (n.to_vec(), v.to_vec()))
    .collect()
}

fn encode(encoder: &mut loona_hpack::Encoder<'_>, fields: &Fields) -> Vec<u8> {
    encoder.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())))
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Frame {
    Frame {
        kind,
        flags,
        stream,
        payload: payload.to_vec(),
    }
}

/// Splits bytes the rewriter wrote back into frames.
fn frames(mut bytes: &[u8]) -> Vec<Frame> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
        let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
        out.push(frame(
            bytes[3],
            bytes[4],
            stream,
            &bytes[FRAME_HEADER..FRAME_HEADER + len],
        ));
        bytes = &bytes[FRAME_HEADER + len..];
    }
    out
}

fn with_authority(mut fields: Fields, authority: &[u8]) -> Fields {
    for (name, value) in &mut fields {
        if name == b":authority" {
            *value = authority.to_vec();
        }
    }
    fields
}

#[test]
fn a_socket_path_authority_becomes_localhost_in_every_request_of_a_connection() {
    // As grpc-go does: the authority enters the client's dynamic table in the first request
    // (literal with incremental indexing, name from the static table's entry 1) and is a bare
    // index from then on. The encoder adds `te: trailers` to the table after it.
    let mut client = loona_hpack::Encoder::new();
    let mut first = vec![0x41, u8::try_from(SOCKET_PATH.len()).unwrap()];
    first.extend_from_slice(SOCKET_PATH);
    let rest: Fields = request("/pluginregistration.Registration/GetInfo", SOCKET_PATH)
        .into_iter()
        .filter(|(name, _)| name != b":authority")
        .collect();
    first.extend(encode(&mut client, &rest));
    let mut second = vec![0x80 | 63];
    second.extend(encode(&mut client, &rest));
    let mut sent = vec![(b":authority".to_vec(), SOCKET_PATH.to_vec())];
    sent.extend(rest);
    assert_eq!(
        loona_hpack::Decoder::new()
            .decode(&[first.clone(), second.clone()].concat())
            .map(|fields| fields.len()),
        Ok(2 * sent.len()),
        "the test's blocks are what the client means"
    );

    let mut rewriter = HeaderRewriter::default();
    let mut server = loona_hpack::Decoder::new();
    for (stream, block) in [(1, first), (3, second)] {
        let out = rewriter
            .frame(frame(HEADERS, END_HEADERS, stream, &block))
            .expect("a valid block");
        let out = frames(&out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].kind, out[0].flags), (HEADERS, END_HEADERS));
        assert_eq!(out[0].stream, stream);
        let seen = server
            .decode(&out[0].payload)
            .expect("the server decodes it");
        assert_eq!(seen, with_authority(sent.clone(), LOCAL_AUTHORITY));
    }
}

#[test]
fn authorities_h2_accepts_pass_unchanged() {
    for authority in [
        &b"localhost"[..],
        b"[::]",
        b"127.0.0.1:9808",
        b"csi.example",
    ] {
        let mut rewriter = HeaderRewriter::default();
        let sent = request("/csi.v1.Node/NodeGetInfo", authority);
        let block = encode(&mut loona_hpack::Encoder::new(), &sent);
        let out = rewriter
            .frame(frame(HEADERS, END_HEADERS, 1, &block))
            .expect("a valid block");
        let seen = loona_hpack::Decoder::new()
            .decode(&frames(&out)[0].payload)
            .expect("decodes");
        assert_eq!(seen, sent, "{}", String::from_utf8_lossy(authority));
    }
}

#[test]
fn padding_priority_and_continuation_frames_are_undone_into_one_block() {
    let sent = request("/csi.v1.Node/NodeStageVolume", SOCKET_PATH);
    let block = encode(&mut loona_hpack::Encoder::new(), &sent);
    let (a, rest) = block.split_at(10);
    let (b, c) = rest.split_at(20);
    let priority = [0x80, 0, 0, 0, 7];
    let mut payload = vec![3];
    payload.extend_from_slice(&priority);
    payload.extend_from_slice(a);
    payload.extend_from_slice(&[0, 0, 0]);
    let mut rewriter = HeaderRewriter::default();
    let flags = PADDED | PRIORITY | END_STREAM;
    assert!(rewriter
        .frame(frame(HEADERS, flags, 5, &payload))
        .expect("first fragment")
        .is_empty());
    assert!(rewriter
        .frame(frame(CONTINUATION, 0, 5, b))
        .expect("second fragment")
        .is_empty());
    let out = frames(
        &rewriter
            .frame(frame(CONTINUATION, END_HEADERS, 5, c))
            .expect("last fragment"),
    );
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].flags, PRIORITY | END_STREAM | END_HEADERS);
    assert_eq!(out[0].payload[..5], priority, "priority kept as sent");
    let seen = loona_hpack::Decoder::new()
        .decode(&out[0].payload[5..])
        .expect("decodes");
    assert_eq!(seen, with_authority(sent, LOCAL_AUTHORITY));
}

#[test]
fn a_block_larger_than_a_frame_is_split_into_continuations() {
    let mut sent = request("/csi.v1.Node/NodePublishVolume", SOCKET_PATH);
    sent.push((b"x-large".to_vec(), vec![b'a'; 40_000]));
    let block = encode(&mut loona_hpack::Encoder::new(), &sent);
    let out = frames(
        &HeaderRewriter::default()
            .frame(frame(HEADERS, END_HEADERS, 1, &block))
            .expect("a valid block"),
    );
    let kinds: Vec<_> = out.iter().map(|f| (f.kind, f.flags)).collect();
    assert_eq!(
        kinds,
        [(HEADERS, 0), (CONTINUATION, 0), (CONTINUATION, END_HEADERS)]
    );
    assert!(out.iter().all(|f| f.payload.len() <= MAX_FRAME));
    let joined: Vec<u8> = out.iter().flat_map(|f| f.payload.clone()).collect();
    let seen = loona_hpack::Decoder::new()
        .decode(&joined)
        .expect("decodes");
    assert_eq!(seen, with_authority(sent, LOCAL_AUTHORITY));
}

#[test]
fn frames_other_than_headers_pass_byte_for_byte() {
    let mut rewriter = HeaderRewriter::default();
    for sent in [
        frame(SETTINGS, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]),
        frame(DATA, PADDED | END_STREAM, 0x8000_0001, &[2, 9, 9, 0, 0]),
        frame(0x8, 0, 0, &[0, 1, 0, 0]),
        frame(0xfa, 0xff, 7, b"an extension frame"),
    ] {
        let mut expected = Vec::new();
        sent.write_to(&mut expected);
        assert_eq!(rewriter.frame(sent).expect("passes"), expected);
    }
}

#[test]
fn broken_header_frames_are_refused() {
    let block = encode(
        &mut loona_hpack::Encoder::new(),
        &request("/x", SOCKET_PATH),
    );
    let mut rewriter = HeaderRewriter::default();
    rewriter
        .frame(frame(HEADERS, 0, 1, &block[..4]))
        .expect("a first fragment");
    assert!(matches!(
        rewriter.frame(frame(DATA, 0, 1, b"x")),
        Err(FrontError::InterruptedHeaderBlock {
            kind: DATA,
            stream: 1
        })
    ));
    assert!(matches!(
        HeaderRewriter::default().frame(frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 1, 2])),
        Err(FrontError::ShortFrame { stream: 1, .. })
    ));
    assert!(matches!(
        HeaderRewriter::default().frame(frame(HEADERS, PRIORITY | END_HEADERS, 1, &[0, 0])),
        Err(FrontError::ShortFrame { stream: 1, .. })
    ));
    assert!(matches!(
        HeaderRewriter::default().frame(frame(HEADERS, END_HEADERS, 1, &[0xff])),
        Err(FrontError::Hpack { stream: 1, .. })
    ));
}

struct Plugin;

#[tonic::async_trait]
impl Registration for Plugin {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: "front.test".into(),
            endpoint: "/csi.sock".into(),
            supported_versions: vec!["1.0.0".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        _: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

/// How the server ended stream 1 of [`get_info_as_kubelet`].
#[derive(Debug, PartialEq)]
enum Answer {
    Info(PluginInfo),
    Reset,
}

/// GetInfo the way kubelet 1.20's plugin watcher asks it, byte by byte: the socket path as
/// `:authority`, which no Rust client can send.
async fn get_info_as_kubelet(path: &std::path::Path) -> Answer {
    let mut conn = UnixStream::connect(path).await.expect("connects");
    let mut out = PREFACE.to_vec();
    write_frame(&mut out, SETTINGS, 0, 0, &[]);
    let block = encode(
        &mut loona_hpack::Encoder::new(),
        &request("/pluginregistration.Registration/GetInfo", SOCKET_PATH),
    );
    write_frame(&mut out, HEADERS, END_HEADERS, 1, &block);
    let mut message = vec![0u8; 5];
    InfoRequest {}.encode(&mut message).expect("encodes");
    write_frame(&mut out, DATA, END_STREAM, 1, &message);
    conn.write_all(&out).await.expect("sends");
    let mut decoder = loona_hpack::Decoder::new();
    let mut body = Vec::new();
    loop {
        let f = read_frame(&mut conn)
            .await
            .expect("reads")
            .expect("the server answers before it closes");
        match (f.kind, f.stream) {
            (SETTINGS, 0) if f.flags & ACK == 0 => {
                let mut ack = Vec::new();
                write_frame(&mut ack, SETTINGS, ACK, 0, &[]);
                conn.write_all(&ack).await.expect("acks");
            }
            (RST_STREAM, 1) => return Answer::Reset,
            (DATA, 1) => body.extend_from_slice(&f.payload),
            (HEADERS, 1) => {
                let fields = decoder.decode(&f.payload).expect("decodes");
                if let Some((_, status)) = fields.iter().find(|(n, _)| n == b"grpc-status") {
                    assert_eq!(status, b"0", "{fields:?}");
                }
                if f.flags & END_STREAM != 0 {
                    let info = PluginInfo::decode(&body[5..]).expect("a PluginInfo");
                    return Answer::Info(info);
                }
            }
            _ => {}
        }
    }
}

async fn serve(path: &std::path::Path, behind_front: bool) {
    let listener = UnixListener::bind(path).expect("binds");
    let server = tonic::transport::Server::builder().add_service(RegistrationServer::new(Plugin));
    if behind_front {
        tokio::spawn(server.serve_with_incoming(incoming(listener)));
    } else {
        let accepted = futures::stream::unfold(listener, |l| async {
            Some((l.accept().await.map(|(s, _)| s), l))
        });
        tokio::spawn(server.serve_with_incoming(accepted));
    }
}

#[tokio::test]
async fn kubelets_get_info_is_reset_by_tonic_alone_and_answered_behind_the_front() {
    let dir = std::env::temp_dir().join(format!("h2-front-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let bare = dir.join("bare.sock");
    serve(&bare, false).await;
    assert_eq!(
        get_info_as_kubelet(&bare).await,
        Answer::Reset,
        "h2 still refuses a path authority: without that, the front is not needed"
    );
    let fronted = dir.join("fronted.sock");
    serve(&fronted, true).await;
    match get_info_as_kubelet(&fronted).await {
        Answer::Info(info) => assert_eq!(info.name, "front.test"),
        other => panic!("behind the front: {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_client_that_is_not_http2_is_dropped_and_the_server_sees_the_end() {
    let (client, mut near) = tokio::io::duplex(1024);
    let (server, mut far) = tokio::io::duplex(1024);
    let relaying = tokio::spawn(relay(client, server));
    near.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("writes");
    assert!(matches!(
        relaying.await.expect("the relay ends"),
        Err(FrontError::NotHttp2)
    ));
    let mut rest = Vec::new();
    far.read_to_end(&mut rest).await.expect("reads to the end");
    assert!(rest.is_empty(), "nothing reached the server: {rest:?}");
}

/// Opens a connection through the front with the client's preface, as every gRPC client does.
async fn opened_relay() -> (
    tokio::task::JoinHandle<Result<Ended, FrontError>>,
    tokio::io::DuplexStream,
    tokio::io::DuplexStream,
) {
    let (client, mut near) = tokio::io::duplex(1024);
    let (server, mut far) = tokio::io::duplex(1024);
    let relaying = tokio::spawn(relay(client, server));
    near.write_all(PREFACE).await.expect("writes");
    let mut preface = [0u8; PREFACE.len()];
    far.read_exact(&mut preface)
        .await
        .expect("the server gets the preface");
    (relaying, near, far)
}

#[tokio::test]
async fn a_connection_the_client_ends_is_told_from_one_the_server_ends() {
    // The client closes: the server sees the end, closes too, and the client ended it.
    let (relaying, near, mut far) = opened_relay().await;
    drop(near);
    let mut rest = Vec::new();
    far.read_to_end(&mut rest)
        .await
        .expect("the server sees the end");
    drop(far);
    assert_eq!(
        relaying.await.expect("the relay ends").expect("no error"),
        Ended::ByClient
    );

    // The server closes while the client holds on: the client sees the end first.
    let (relaying, mut near, far) = opened_relay().await;
    drop(far);
    let mut rest = Vec::new();
    near.read_to_end(&mut rest)
        .await
        .expect("the client sees the end");
    near.shutdown().await.expect("the client closes its side");
    assert_eq!(
        relaying.await.expect("the relay ends").expect("no error"),
        Ended::ByServer
    );
}
