//! The API server's way to a guest's kubelet: kube-apiserver's egress selector sends every
//! connection of its "cluster" egress (to kubelets for exec, logs and port-forward, and to
//! webhooks) as an HTTP CONNECT over a unix socket, and this proxy answers it. The kubelet of a
//! VM guest listens on the guest's address, which this machine cannot dial; QEMU forwards a
//! loopback port to it, and the proxy sends a CONNECT for the kubelet's port there. Other
//! targets are dialled as asked, loopback only: nothing here lets the API server reach beyond
//! this machine.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// The kubelet's serving port, the one a node reports in `status.daemonEndpoints`.
pub const KUBELET_PORT: u16 = 10250;

/// The egress selector configuration that makes kube-apiserver use the proxy at `socket`
/// for its "cluster" egress.
pub fn selector_config(socket: &Path) -> String {
    format!(
        "apiVersion: apiserver.k8s.io/v1beta1\nkind: EgressSelectorConfiguration\n\
         egressSelections:\n- name: cluster\n  connection:\n    proxyProtocol: HTTPConnect\n\
         \x20   transport:\n      uds:\n        udsName: {}\n",
        socket.display()
    )
}

/// Serves CONNECTs on `socket` in a background thread for as long as the process runs:
/// `host:10250` goes to `kubelet` (any node: a guest is the only node), other loopback
/// targets as asked, anything else is refused.
pub fn spawn(socket: &Path, kubelet: SocketAddr) -> io::Result<()> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)?;
    std::thread::Builder::new()
        .name("egress-proxy".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = std::thread::Builder::new()
                    .name("egress-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve(conn, kubelet) {
                            eprintln!("egress proxy: {e}");
                        }
                    });
            }
        })?;
    Ok(())
}

/// Where a CONNECT to `target` goes, or why it may not.
fn route(target: &str, kubelet: SocketAddr) -> Result<SocketAddr, String> {
    let (host, port) = target
        .rsplit_once(':')
        .ok_or_else(|| format!("CONNECT target {target:?} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("CONNECT target {target:?} has a bad port"))?;
    if port == KUBELET_PORT {
        return Ok(kubelet);
    }
    let ip: IpAddr = host
        .trim_matches(|c| c == '[' || c == ']')
        .parse()
        .map_err(|_| format!("CONNECT target {target:?} is not an address"))?;
    if ip.is_loopback() {
        Ok(SocketAddr::new(ip, port))
    } else {
        Err(format!("CONNECT target {target:?} is not on loopback"))
    }
}

fn serve(conn: UnixStream, kubelet: SocketAddr) -> io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    // The rest of the request head, up to its blank line; no body follows a CONNECT.
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut words = request.split_whitespace();
    let (Some("CONNECT"), Some(target)) = (words.next(), words.next()) else {
        return refuse(
            conn,
            "400 Bad Request",
            &format!("not a CONNECT: {request:?}"),
        );
    };
    let to = match route(target, kubelet) {
        Ok(to) => to,
        Err(why) => return refuse(conn, "403 Forbidden", &why),
    };
    let upstream = match TcpStream::connect_timeout(&to, Duration::from_secs(10)) {
        Ok(s) => s,
        Err(e) => return refuse(conn, "502 Bad Gateway", &format!("{target} via {to}: {e}")),
    };
    conn.set_read_timeout(None)?;
    // Exactly this answer and nothing after it: the API server's dialer reads the status line
    // and hands every following byte to TLS.
    (&conn).write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")?;
    // Bytes the reader buffered past the head belong to the tunnel.
    let early = reader.buffer().to_vec();
    (&upstream).write_all(&early)?;
    let (down_from, down_to) = (upstream.try_clone()?, conn.try_clone()?);
    let down = std::thread::spawn(move || pipe(down_from, down_to));
    pipe(conn, upstream);
    let _ = down.join();
    Ok(())
}

fn refuse(conn: UnixStream, status: &str, why: &str) -> io::Result<()> {
    eprintln!("egress proxy: refused: {why}");
    (&conn).write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes())
}

/// Copies until either side ends, then ends both directions of the other.
fn pipe<R: io::Read + ShutdownBoth, W: io::Write + ShutdownBoth>(mut from: R, mut to: W) {
    let _ = io::copy(&mut from, &mut to);
    to.shutdown_write();
    from.shutdown_read();
}

trait ShutdownBoth {
    fn shutdown_write(&self);
    fn shutdown_read(&self);
}

impl ShutdownBoth for TcpStream {
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
    fn shutdown_read(&self) {
        let _ = self.shutdown(std::net::Shutdown::Read);
    }
}

impl ShutdownBoth for UnixStream {
    fn shutdown_write(&self) {
        let _ = self.shutdown(std::net::Shutdown::Write);
    }
    fn shutdown_read(&self) {
        let _ = self.shutdown(std::net::Shutdown::Read);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    #[test]
    fn routes_the_kubelet_port_to_the_forward_and_refuses_other_hosts() {
        let kubelet: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        assert_eq!(route("10.0.2.15:10250", kubelet), Ok(kubelet));
        assert_eq!(
            route("127.0.0.1:9443", kubelet),
            Ok("127.0.0.1:9443".parse().unwrap())
        );
        assert_eq!(
            route("[::1]:9443", kubelet),
            Ok("[::1]:9443".parse().unwrap())
        );
        assert!(route("10.0.2.15:22", kubelet).is_err());
        assert!(route("example.com:443", kubelet).is_err());
        assert!(route("10.0.2.15", kubelet).is_err());
    }

    #[test]
    fn tunnels_a_connect_to_the_kubelet_forward_byte_for_byte() {
        let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
        let kubelet = upstream.local_addr().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("egress.sock");
        spawn(&socket, kubelet).unwrap();
        let echo = std::thread::spawn(move || {
            let (mut s, _) = upstream.accept().unwrap();
            let mut got = [0u8; 5];
            s.read_exact(&mut got).unwrap();
            s.write_all(&got.map(|b| b.to_ascii_uppercase())).unwrap();
        });
        let mut client = UnixStream::connect(&socket).unwrap();
        // The head and the tunnel's first bytes in one write, as a fast client sends them.
        client
            .write_all(b"CONNECT 10.0.2.15:10250 HTTP/1.1\r\nHost: 10.0.2.15:10250\r\n\r\nhello")
            .unwrap();
        let mut answer = Vec::new();
        let expected = b"HTTP/1.1 200 Connection established\r\n\r\nHELLO";
        answer.resize(expected.len(), 0);
        client.read_exact(&mut answer).unwrap();
        assert_eq!(answer, expected);
        echo.join().unwrap();
    }

    #[test]
    fn refuses_a_target_off_this_machine() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("egress.sock");
        spawn(&socket, "127.0.0.1:1".parse().unwrap()).unwrap();
        let mut client = UnixStream::connect(&socket).unwrap();
        client
            .write_all(b"CONNECT 192.0.2.1:443 HTTP/1.1\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        client.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    }
}
