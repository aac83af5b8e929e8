//! Who else has a device open, and whether udev is still at work on one.
//!
//! DISCONNECT fails every request in flight, whoever sent it, so the daemon lets a device go
//! only once nothing else reads it. The usual reader is udev: kubelet keeps a loop device
//! over a raw block volume and releases it just before NodeUnstage. That release closes the
//! device after writing, udev's watch answers with a "change" event, and the event's blkid
//! probe was still reading the device when the DISCONNECT went out: the kernel logged I/O
//! errors on the real node.
//!
//! An empty queue is not enough: udevd turns the close into its "change" event only when it gets
//! to the inotify event, which under load came after the DISCONNECT (6.12, two guests on two
//! cores). So the daemon also takes the device's BSD lock, exclusively, and holds it across the
//! DISCONNECT: udevd takes that lock, shared, for the rules and probes of a block device's event,
//! and postpones an event it cannot lock (systemd.io/BLOCK_DEVICE_LOCKING). The lock is released
//! after the DISCONNECT, and the close that releases it drops the device's last reference, so
//! a postponed probe finds a device of size 0 and reads nothing.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant};

use nbd::DeviceIndex;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// Exists while udev's event queue is not empty (what `udevadm settle` waits for).
const UDEV_QUEUE: &str = "/run/udev/queue";

/// How often a wait below looks again.
const POLL: Duration = Duration::from_millis(20);

/// Calls `f(pid, command, fd link)` for every open file descriptor of every process.
fn each_open_file(mut f: impl FnMut(u32, &str, &Path)) {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
        for fd in fds.flatten() {
            f(pid, comm.trim(), &fd.path());
        }
    }
}

/// Holders of each nbd device by its name (`nbd3` → `["812 (qemu-img)"]`), for `status`:
/// every process with a descriptor on the device, whatever node it was opened through (`/dev`,
/// a container's own device node, a bind mount), matched by device number.
pub(crate) fn open_devices() -> BTreeMap<String, Vec<String>> {
    let mut numbers = std::collections::HashMap::new();
    if let Ok(dev) = std::fs::read_dir("/dev") {
        for entry in dev.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("nbd") || name.parse::<DeviceIndex>().is_err() {
                continue;
            }
            if let Ok(meta) = std::fs::metadata(entry.path()) {
                if meta.file_type().is_block_device() {
                    numbers.insert(meta.rdev(), name);
                }
            }
        }
    }
    opened_by_number(&numbers, |t| t.is_block_device())
}

/// Holders of the devices of `numbers` (device number → name) of the file type `kind`
/// accepts, by name.
fn opened_by_number(
    numbers: &std::collections::HashMap<u64, String>,
    kind: impl Fn(&std::fs::FileType) -> bool,
) -> BTreeMap<String, Vec<String>> {
    holders_by(|_, meta| {
        kind(&meta.file_type())
            .then(|| numbers.get(&meta.rdev()).cloned())
            .flatten()
    })
}

/// `pid (command)` of each process but this one with a file open that `is_it` accepts
/// (given what the descriptor has open, wherever that was named: `/dev`, a container's own
/// device node, a bind mount).
fn holders(is_it: impl Fn(&std::fs::Metadata) -> bool) -> Vec<String> {
    let own = std::process::id();
    holders_by(|pid, meta| (pid != own && is_it(meta)).then(String::new))
        .remove("")
        .unwrap_or_default()
}

/// Every process with an open file, `pid (command)` once each, grouped under the name
/// `group` gives what its descriptor has open (`None`: not counted).
fn holders_by(
    group: impl Fn(u32, &std::fs::Metadata) -> Option<String>,
) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    each_open_file(|pid, comm, fd| {
        let Some(name) = std::fs::metadata(fd).ok().and_then(|m| group(pid, &m)) else {
            return;
        };
        let holder = format!("{pid} ({comm})");
        let list = out.entry(name).or_default();
        if !list.contains(&holder) {
            list.push(holder);
        }
    });
    out
}

/// The device's BSD lock, held exclusively: udev postpones the device's events while it is
/// held. Released when dropped.
pub type UdevLock = Option<Flock<File>>;

/// Waits, for at most `within`, until udev has no event queued, no process but this one has
/// the block device `device` open and this one holds its BSD lock exclusively (udev holds it
/// shared while it probes). `Err` names the holders left at the deadline. A queue busy past
/// the deadline (other devices' events) is not waited out: only holders of this device stop it.
pub(crate) fn wait_unused(device: &Path, within: Duration) -> Result<UdevLock, Vec<String>> {
    let until = Instant::now() + within;
    while Path::new(UDEV_QUEUE).exists() && Instant::now() < until {
        std::thread::sleep(POLL);
    }
    // No device node: nothing can have it open through /dev, and the kernel has let it go.
    let Ok(rdev) = std::fs::metadata(device).map(|m| m.rdev()) else {
        return Ok(None);
    };
    loop {
        let left = holders(|m| m.file_type().is_block_device() && m.rdev() == rdev);
        if left.is_empty() {
            match lock_exclusively(device) {
                Ok(lock) => return Ok(lock),
                // Someone probes it right now (udev's worker holds the lock shared).
                Err(()) if Instant::now() < until => {}
                Err(()) => return Err(vec![format!("a BSD lock on {}", device.display())]),
            }
        } else if Instant::now() >= until {
            return Err(left);
        }
        std::thread::sleep(POLL);
    }
}

/// The device's BSD lock, exclusively, without waiting: `Err` while another process holds it.
/// A device that cannot be opened (gone, or not a device this kernel serves) has nothing to
/// lock, and nothing udev could probe.
fn lock_exclusively(device: &Path) -> Result<UdevLock, ()> {
    let Ok(file) = File::open(device) else {
        return Ok(None);
    };
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, Errno::EWOULDBLOCK)) => Err(()),
        // A lock this kernel refuses to take (not EWOULDBLOCK) is one udev cannot take either.
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// A device held through any node is named by its number: a child holding /dev/null as
    /// its stdin is listed under the name given for /dev/null's number.
    #[test]
    fn devices_are_matched_by_number_not_by_path() {
        let null = std::fs::metadata("/dev/null").unwrap();
        let numbers = std::collections::HashMap::from([(null.rdev(), "the-null".to_owned())]);
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        // Until the child has exec'd, it shows the test's own command.
        let want = format!("{} (sleep)", child.id());
        let holders_of_null = || {
            opened_by_number(&numbers, |t| t.is_char_device())
                .remove("the-null")
                .unwrap_or_default()
        };
        let until = Instant::now() + Duration::from_secs(10);
        let mut holders = holders_of_null();
        while !holders.contains(&want) && Instant::now() < until {
            std::thread::sleep(POLL);
            holders = holders_of_null();
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(holders.contains(&want), "holders of /dev/null: {holders:?}");
        let none = opened_by_number(&numbers, |t| t.is_block_device());
        assert!(
            none.is_empty(),
            "a char device counted as a block device: {none:?}"
        );
    }

    /// Another process with the file open is named; this process, which has it open too,
    /// is not; once the other has exited, nobody is.
    #[test]
    fn names_the_other_processes_that_hold_a_file() {
        let dir = std::env::temp_dir().join(format!("openers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("held");
        std::fs::write(&path, b"x").unwrap();
        let ours = std::fs::File::open(&path).unwrap();
        let meta = ours.metadata().unwrap();
        let is_it = |m: &std::fs::Metadata| m.dev() == meta.dev() && m.ino() == meta.ino();

        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::from(std::fs::File::open(&path).unwrap()))
            .spawn()
            .unwrap();
        // Until the child has exec'd, it shows the test's own command.
        let want = vec![format!("{} (sleep)", child.id())];
        let until = Instant::now() + Duration::from_secs(10);
        let mut found = holders(is_it);
        while found != want && Instant::now() < until {
            std::thread::sleep(POLL);
            found = holders(is_it);
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let after = holders(is_it);
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(found, want);
        assert_eq!(after, Vec::<String>::new());
    }

    /// A path that is no device node (it does not exist): nothing to wait for.
    #[test]
    fn a_missing_device_node_is_unused() {
        assert!(matches!(
            wait_unused(Path::new("/dev/nbd-none-such"), Duration::ZERO),
            Ok(None)
        ));
    }

    /// While another open file holds the lock shared (as udev's worker does while it probes),
    /// the exclusive lock is refused; once it is let go, taken; and while it is held, a shared
    /// lock (udev's next probe) is refused.
    #[test]
    fn the_exclusive_lock_waits_out_a_probe_and_keeps_the_next_one_off() {
        let dir = std::env::temp_dir().join(format!("openers-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("device");
        std::fs::write(&path, b"x").unwrap();

        let probe = Flock::lock(File::open(&path).unwrap(), FlockArg::LockSharedNonblock)
            .map_err(|(_, e)| e)
            .unwrap();
        assert!(lock_exclusively(&path).is_err());
        drop(probe);

        let ours = lock_exclusively(&path).unwrap();
        assert!(ours.is_some());
        let next = Flock::lock(File::open(&path).unwrap(), FlockArg::LockSharedNonblock);
        assert!(matches!(next, Err((_, Errno::EWOULDBLOCK))));
        drop(ours);
        assert!(Flock::lock(File::open(&path).unwrap(), FlockArg::LockSharedNonblock).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
