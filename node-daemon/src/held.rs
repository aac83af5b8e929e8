//! Our copies of the unix-socket connections handed to the kernel, kept so the daemon can
//! shut one down when the device must get new connections (an export that grew: see
//! `connections.rs`). A TCP connection can be aborted from outside by its addresses; a unix
//! one only through a descriptor of the socket, so the daemon keeps one, and parks it in
//! systemd's file-descriptor store (`FDSTORE=1`) so a restarted daemon gets it back.
//!
//! Which offered sockets did the kernel take? RECONFIGURE puts a socket into a dead slot or
//! silently drops it. The kernel sets a taken socket's send timeout (`SO_SNDTIMEO`) to the
//! device's I/O timeout, at CONNECT and at RECONFIGURE, and our dialer never sets one: a
//! socket with a send timeout is the kernel's. With an I/O timeout of 0 nothing can be told,
//! and nothing is kept. A slot the kernel gave up has its socket shut down (POLLHUP); such
//! copies are dropped, and systemd drops its own on the same hang-up.
//!
//! Store names are `nbd.<16 hex of sha256(identifier)>.<slots>.<inode>`: the identifier
//! ties a restored socket to its attachment (a re-attached volume has another), the slot
//! count says whether every slot's socket is held, the inode makes each name unique.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use sd_notify::NotifyState;
use sha2::{Digest, Sha256};
use socket2::SockRef;

struct Held {
    fd: OwnedFd,
    name: String,
}

struct Attachment {
    identifier: String,
    /// How many connections the device has: CONNECT's socket count.
    slots: usize,
    sockets: Vec<Held>,
}

/// The held sockets of every volume, by volume id.
#[derive(Default)]
pub struct HeldSockets {
    volumes: Mutex<HashMap<String, Attachment>>,
}

impl std::fmt::Debug for HeldSockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldSockets").finish_non_exhaustive()
    }
}

impl HeldSockets {
    /// After CONNECT: keeps the unix sockets of a new attachment (replacing anything held
    /// for an earlier one of the volume).
    pub fn attached(&self, volume: &str, identifier: &str, sockets: Vec<OwnedFd>) {
        let slots = sockets.len();
        let old = {
            let mut volumes = lock(&self.volumes);
            volumes.insert(
                volume.to_owned(),
                Attachment {
                    identifier: identifier.to_owned(),
                    slots,
                    sockets: Vec::new(),
                },
            )
        };
        if let Some(old) = old {
            unstore(old.sockets);
        }
        self.offered(volume, identifier, sockets);
    }

    /// After RECONFIGURE: keeps the sockets the kernel took, drops the rest and the copies of
    /// sockets whose slot died. Sockets of another attachment than the held one are dropped.
    pub fn offered(&self, volume: &str, identifier: &str, sockets: Vec<OwnedFd>) {
        let mut volumes = lock(&self.volumes);
        let Some(att) = volumes.get_mut(volume) else {
            return;
        };
        if att.identifier != identifier {
            return;
        }
        let slots = att.slots;
        for fd in sockets {
            if !is_unix(&fd) || !taken_by_kernel(&fd) {
                continue;
            }
            let Some(name) = store_name(identifier, slots, &fd) else {
                continue;
            };
            store(&fd, &name);
            att.sockets.push(Held { fd, name });
        }
        prune(att);
    }

    /// Whether a copy of every slot's socket is held, all alive: what shutting them all down
    /// and offering new ones needs (an unheld slot would keep serving the old size).
    pub fn holds_every_slot(&self, volume: &str) -> bool {
        let mut volumes = lock(&self.volumes);
        volumes.get_mut(volume).is_some_and(|att| {
            prune(att);
            att.slots > 0 && att.sockets.len() == att.slots
        })
    }

    /// Shuts down every held socket of `volume` (the kernel marks their slots dead and the
    /// healer or the caller offers new ones). Returns the store names of those sockets.
    pub fn shut_down_all(&self, volume: &str) -> Vec<String> {
        let volumes = lock(&self.volumes);
        let Some(att) = volumes.get(volume) else {
            return Vec::new();
        };
        for held in &att.sockets {
            if let Err(e) = SockRef::from(&held.fd).shutdown(std::net::Shutdown::Both) {
                tracing::warn!(volume, error = %e, "could not shut down a held connection");
            }
        }
        att.sockets.iter().map(|h| h.name.clone()).collect()
    }

    /// Whether any of `names` is still held alive.
    pub fn holds_any(&self, volume: &str, names: &[String]) -> bool {
        let mut volumes = lock(&self.volumes);
        volumes.get_mut(volume).is_some_and(|att| {
            prune(att);
            att.sockets.iter().any(|h| names.contains(&h.name))
        })
    }

    /// Whether a socket other than `names` is held alive: a connection offered since those
    /// were shut down that the kernel still uses.
    pub fn holds_other_than(&self, volume: &str, names: &[String]) -> bool {
        let mut volumes = lock(&self.volumes);
        volumes.get_mut(volume).is_some_and(|att| {
            prune(att);
            att.sockets.iter().any(|h| !names.contains(&h.name))
        })
    }

    /// How many sockets are held for `volume`.
    #[cfg(test)]
    fn count(&self, volume: &str) -> usize {
        lock(&self.volumes)
            .get(volume)
            .map_or(0, |att| att.sockets.len())
    }

    /// The volume is detached: its copies go, in the store too.
    pub fn forget(&self, volume: &str) {
        let removed = lock(&self.volumes).remove(volume);
        if let Some(att) = removed {
            unstore(att.sockets);
        }
    }

    /// At start-up: takes the sockets systemd kept for the previous daemon (`LISTEN_FDS`),
    /// given `identifiers` (volume → identifier) from the journal. A socket is kept when its
    /// name carries the identifier of a journaled attachment and it is alive; any other is
    /// removed from the store and closed. Returns how many were kept.
    pub fn restore(
        &self,
        stored: Vec<(OwnedFd, String)>,
        identifiers: &HashMap<String, String>,
    ) -> usize {
        let by_hash: HashMap<String, (&String, &String)> = identifiers
            .iter()
            .map(|(volume, id)| (identifier_hash(id), (volume, id)))
            .collect();
        let mut kept = 0;
        let mut volumes = lock(&self.volumes);
        for (fd, name) in stored {
            let owner = parse_name(&name).and_then(|(hash, slots)| {
                by_hash.get(hash).map(|(volume, id)| (*volume, *id, slots))
            });
            match owner {
                Some((volume, identifier, slots)) if is_unix(&fd) && !hung_up(fd.as_fd()) => {
                    let att = volumes.entry(volume.clone()).or_insert_with(|| Attachment {
                        identifier: identifier.clone(),
                        slots,
                        sockets: Vec::new(),
                    });
                    att.sockets.push(Held { fd, name });
                    kept += 1;
                }
                _ => unstore(vec![Held { fd, name }]),
            }
        }
        kept
    }
}

/// The sockets systemd handed this process from its store, with their names. Call once, at
/// start-up: the descriptors are owned by the caller from then on.
pub fn from_systemd() -> Vec<(OwnedFd, String)> {
    match sd_notify::listen_fds_with_names() {
        Ok(fds) => fds
            // SAFETY: LISTEN_FDS names descriptors systemd passed to this process (LISTEN_PID
            // checked), which nothing else in it owns; each is taken exactly once.
            .map(|(fd, name)| (unsafe { OwnedFd::from_raw_fd(fd) }, name))
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the descriptors systemd passed");
            Vec::new()
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn prune(att: &mut Attachment) {
    let (dead, alive): (Vec<Held>, Vec<Held>) = std::mem::take(&mut att.sockets)
        .into_iter()
        .partition(|h| hung_up(h.fd.as_fd()));
    att.sockets = alive;
    unstore(dead);
}

fn unstore(sockets: Vec<Held>) {
    for held in sockets {
        notify_store(
            &[NotifyState::FdStoreRemove, NotifyState::FdName(&held.name)],
            None,
        );
    }
}

fn store(fd: &OwnedFd, name: &str) {
    notify_store(
        &[NotifyState::FdStore, NotifyState::FdName(name)],
        Some(fd.as_fd()),
    );
}

fn notify_store(states: &[NotifyState<'_>], fd: Option<BorrowedFd<'_>>) {
    let sent = match fd {
        Some(fd) => sd_notify::notify_with_fds(states, &[fd]),
        None => sd_notify::notify(states),
    };
    if let Err(e) = sent {
        tracing::warn!(error = %e, "systemd's file-descriptor store did not take the message");
    }
}

fn is_unix(fd: &OwnedFd) -> bool {
    SockRef::from(fd)
        .domain()
        .is_ok_and(|d| d == socket2::Domain::UNIX)
}

/// See the module comment: the kernel gives the sockets it takes a send timeout.
fn taken_by_kernel(fd: &OwnedFd) -> bool {
    SockRef::from(fd).write_timeout().is_ok_and(|t| t.is_some())
}

/// The socket was shut down: by the kernel giving up its slot, by the server, or by us.
fn hung_up(fd: BorrowedFd<'_>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // POLLHUP and POLLERR are reported whatever is asked for.
    let mut fds = [PollFd::new(fd, PollFlags::empty())];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(0) => false,
        Ok(_) => fds[0].revents().is_some_and(|r| {
            r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL)
        }),
        Err(_) => true,
    }
}

fn identifier_hash(identifier: &str) -> String {
    let digest = Sha256::digest(identifier.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn store_name(identifier: &str, slots: usize, fd: &OwnedFd) -> Option<String> {
    let inode = nix::sys::stat::fstat(fd).ok()?.st_ino;
    Some(format!(
        "nbd.{}.{slots}.{inode}",
        identifier_hash(identifier)
    ))
}

/// `nbd.<hash>.<slots>.<inode>` → (hash, slots).
fn parse_name(name: &str) -> Option<(&str, usize)> {
    let mut parts = name.split('.');
    let (Some("nbd"), Some(hash), Some(slots), Some(inode), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    inode.parse::<u64>().ok()?;
    Some((hash, slots.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    fn pair() -> (OwnedFd, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (a.into(), b)
    }

    /// A connected pair whose first socket the kernel took: it gave it a send timeout.
    fn taken_pair() -> (OwnedFd, UnixStream) {
        let (fd, peer) = pair();
        SockRef::from(&fd)
            .set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        (fd, peer)
    }

    #[test]
    fn keeps_only_the_sockets_the_kernel_took_and_drops_them_when_their_slot_dies() {
        let held = HeldSockets::default();
        let (a, _pa) = taken_pair();
        let (b, pb) = taken_pair();
        held.attached("v", "id:1", vec![a, b]);
        assert_eq!(held.count("v"), 2);
        assert!(held.holds_every_slot("v"));

        // The server side of one connection goes: that slot is dead.
        drop(pb);
        assert!(!held.holds_every_slot("v"));
        assert_eq!(held.count("v"), 1);

        // Two offered, the kernel took one: only that one is kept.
        let (c, _pc) = taken_pair();
        let (d, mut pd) = pair();
        held.offered("v", "id:1", vec![c, d]);
        assert_eq!(held.count("v"), 2);
        assert!(held.holds_every_slot("v"));
        // The refused one was closed: its peer reads end of file.
        use std::io::Read;
        assert_eq!(pd.read(&mut [0u8; 1]).unwrap(), 0);
    }

    #[test]
    fn sockets_of_another_attachment_or_not_unix_are_not_kept() {
        let held = HeldSockets::default();
        let (a, _pa) = taken_pair();
        held.attached("v", "id:1", vec![a]);
        let (b, _pb) = taken_pair();
        held.offered("v", "id:2", vec![b]);
        assert_eq!(held.count("v"), 1);
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let t = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
        t.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
        held.offered("v", "id:1", vec![t.into()]);
        assert_eq!(held.count("v"), 1);
    }

    #[test]
    fn shutting_down_marks_every_held_socket_gone() {
        let held = HeldSockets::default();
        let (a, _pa) = taken_pair();
        let (b, _pb) = taken_pair();
        held.attached("v", "id:1", vec![a, b]);
        let names = held.shut_down_all("v");
        assert_eq!(names.len(), 2);
        assert!(!held.holds_any("v", &names));
        assert!(!held.holds_other_than("v", &names), "nothing new yet");
        assert_eq!(held.count("v"), 0);
        let (c, _pc) = taken_pair();
        held.offered("v", "id:1", vec![c]);
        assert!(
            held.holds_other_than("v", &names),
            "a new connection is held"
        );
        held.forget("v");
        assert!(!held.holds_every_slot("v"));
    }

    #[test]
    fn restore_keeps_live_sockets_of_journaled_attachments_only() {
        let (a, _pa) = pair();
        let (b, _pb) = pair();
        let (c, pc) = pair();
        drop(pc);
        let name = |id: &str, fd: &OwnedFd| store_name(id, 2, fd).unwrap();
        let stored = vec![
            (name("id:1", &a), a),
            (name("id:gone", &b), b),
            (name("id:1", &c), c),
        ]
        .into_iter()
        .map(|(n, fd)| (fd, n))
        .chain(std::iter::once((pair().0, "something-else".to_owned())))
        .collect();
        let identifiers = HashMap::from([("v".to_owned(), "id:1".to_owned())]);
        let held = HeldSockets::default();
        assert_eq!(held.restore(stored, &identifiers), 1);
        assert_eq!(held.count("v"), 1);
        assert!(!held.holds_every_slot("v"), "one of two slots is held");
    }

    #[test]
    fn names_round_trip() {
        let (a, _pa) = pair();
        let name = store_name("ustor:n:vol:01", 4, &a).unwrap();
        assert!(!name.contains(':') && name.len() < 255, "{name}");
        let (hash, slots) = parse_name(&name).unwrap();
        assert_eq!(hash, identifier_hash("ustor:n:vol:01"));
        assert_eq!(slots, 4);
        assert!(parse_name("nbd.x.y.z").is_none());
        assert!(parse_name("other").is_none());
    }
}
