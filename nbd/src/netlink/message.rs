//! Building requests and reading replies of the `nbd` family, without a socket: pure, so the
//! byte layout is unit-tested here and the kernel's acceptance of it in the VM tests.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

use neli::genl::{
    AttrTypeBuilder, Genlmsghdr, GenlmsghdrBuilder, Nlattr, NlattrBuilder, NoUserHeader,
};
use neli::types::{Buffer, GenlBuffer};

use super::consts::{
    NbdAttr, NbdCmd, NbdDevice, NbdDeviceItem, NbdSock, NbdSockItem, FAMILY_VERSION,
};
use crate::identity::{BackendId, DeviceIndex};
use crate::protocol::TransmissionFlags;

pub type NbdMessage = Genlmsghdr<NbdCmd, NbdAttr>;

/// Everything `NBD_CMD_CONNECT` takes.
#[derive(Debug)]
pub struct ConnectRequest<'fd> {
    /// `None` lets the kernel pick a free device (or create one).
    pub index: Option<DeviceIndex>,
    pub size_bytes: u64,
    /// Logical block size: a power of two from 512 to the page size.
    pub block_size: u64,
    pub server_flags: TransmissionFlags,
    /// Per-request timeout; `None` leaves the kernel's default (requests never fail, only
    /// "possible stuck request" is logged).
    pub timeout: Option<Duration>,
    /// How long I/O waits for a replacement socket after the link dies, before failing.
    pub dead_conn_timeout: Duration,
    /// `NBD_CFLAG_*`.
    pub client_flags: u64,
    pub identifier: &'fd BackendId,
    pub sockets: &'fd [BorrowedFd<'fd>],
}

/// What `NBD_CMD_RECONFIGURE` takes: new sockets for dead slots, under the same identifier.
#[derive(Debug)]
pub struct ReconfigureRequest<'fd> {
    pub index: DeviceIndex,
    pub identifier: &'fd BackendId,
    pub sockets: &'fd [BorrowedFd<'fd>],
    /// A new size (online resize), if any.
    pub size_bytes: Option<u64>,
    pub dead_conn_timeout: Option<Duration>,
}

/// One entry of a STATUS reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceStatus {
    pub index: DeviceIndex,
    /// The device has a configuration. A device merely opened by udev or blkid reports it too,
    /// so this alone proves nothing about ownership.
    pub connected: bool,
}

type Attr = Nlattr<NbdAttr, Buffer>;
type BuildError = String;

/// One attribute of any of the family's attribute sets (top level or nested).
fn attr<K, P>(kind: K, payload: P) -> Result<Nlattr<K, Buffer>, BuildError>
where
    K: neli::Size + Clone,
    P: neli::Size + neli::ToBytes,
{
    NlattrBuilder::default()
        .nla_type(
            AttrTypeBuilder::default()
                .nla_type(kind)
                .build()
                .map_err(|e| e.to_string())?,
        )
        .nla_payload(payload)
        .build()
        .map_err(|e| e.to_string())
}

fn secs(d: Duration) -> u64 {
    // The kernel counts whole seconds; round up so a sub-second timeout is not 0 ("none").
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn sockets_attr(sockets: &[BorrowedFd<'_>]) -> Result<Attr, BuildError> {
    let mut list = attr(NbdAttr::Sockets, Vec::<u8>::new())?;
    for fd in sockets {
        let fd_attr = attr(NbdSock::Fd, fd.as_raw_fd() as u32)?;
        let item = attr(NbdSockItem::Item, Vec::<u8>::new())?
            .nest(&fd_attr)
            .map_err(|e| e.to_string())?;
        list = list.nest(&item).map_err(|e| e.to_string())?;
    }
    Ok(list)
}

fn message(cmd: NbdCmd, attrs: Vec<Attr>) -> Result<NbdMessage, BuildError> {
    GenlmsghdrBuilder::<NbdCmd, NbdAttr, NoUserHeader>::default()
        .cmd(cmd)
        .version(FAMILY_VERSION)
        .attrs(attrs.into_iter().collect::<GenlBuffer<_, _>>())
        .build()
        .map_err(|e| e.to_string())
}

pub fn connect(req: &ConnectRequest<'_>) -> Result<NbdMessage, BuildError> {
    let mut attrs = Vec::with_capacity(9);
    if let Some(index) = req.index {
        attrs.push(attr(NbdAttr::Index, index.0)?);
    }
    attrs.push(attr(NbdAttr::SizeBytes, req.size_bytes)?);
    attrs.push(attr(NbdAttr::BlockSizeBytes, req.block_size)?);
    attrs.push(attr(
        NbdAttr::ServerFlags,
        u64::from(req.server_flags.bits()),
    )?);
    if let Some(t) = req.timeout {
        attrs.push(attr(NbdAttr::Timeout, secs(t))?);
    }
    attrs.push(attr(NbdAttr::DeadConnTimeout, secs(req.dead_conn_timeout))?);
    attrs.push(attr(NbdAttr::ClientFlags, req.client_flags)?);
    attrs.push(attr(NbdAttr::BackendIdentifier, req.identifier.as_str())?);
    attrs.push(sockets_attr(req.sockets)?);
    message(NbdCmd::Connect, attrs)
}

pub fn reconfigure(req: &ReconfigureRequest<'_>) -> Result<NbdMessage, BuildError> {
    let mut attrs = vec![
        attr(NbdAttr::Index, req.index.0)?,
        attr(NbdAttr::BackendIdentifier, req.identifier.as_str())?,
    ];
    if let Some(size) = req.size_bytes {
        attrs.push(attr(NbdAttr::SizeBytes, size)?);
    }
    if let Some(t) = req.dead_conn_timeout {
        attrs.push(attr(NbdAttr::DeadConnTimeout, secs(t))?);
    }
    if !req.sockets.is_empty() {
        attrs.push(sockets_attr(req.sockets)?);
    }
    message(NbdCmd::Reconfigure, attrs)
}

pub fn disconnect(index: DeviceIndex) -> Result<NbdMessage, BuildError> {
    message(NbdCmd::Disconnect, vec![attr(NbdAttr::Index, index.0)?])
}

pub fn status(index: Option<DeviceIndex>) -> Result<NbdMessage, BuildError> {
    let attrs = match index {
        Some(i) => vec![attr(NbdAttr::Index, i.0)?],
        None => Vec::new(),
    };
    message(NbdCmd::Status, attrs)
}

/// The index in a CONNECT reply or a LINK_DEAD event.
pub fn parse_index(msg: &NbdMessage) -> Result<DeviceIndex, String> {
    msg.attrs()
        .get_attr_handle()
        .get_attr_payload_as::<u32>(NbdAttr::Index)
        .map(DeviceIndex)
        .map_err(|e| format!("no NBD_ATTR_INDEX in {:?} message: {e}", msg.cmd()))
}

/// The device list of a STATUS reply.
pub fn parse_status(msg: &NbdMessage) -> Result<Vec<DeviceStatus>, String> {
    let top = msg.attrs().get_attr_handle();
    let list = top
        .get_nested_attributes::<NbdDeviceItem>(NbdAttr::DeviceList)
        .map_err(|e| format!("STATUS reply without NBD_ATTR_DEVICE_LIST: {e}"))?;
    let mut devices = Vec::new();
    for item in list.iter() {
        if *item.nla_type().nla_type() != NbdDeviceItem::Item {
            continue;
        }
        let fields = item
            .get_attr_handle::<NbdDevice>()
            .map_err(|e| format!("malformed device item: {e}"))?;
        let index = fields
            .get_attr_payload_as::<u32>(NbdDevice::Index)
            .map_err(|e| format!("device item without index: {e}"))?;
        let connected = fields
            .get_attr_payload_as::<u8>(NbdDevice::Connected)
            .map_err(|e| format!("device item without connected flag: {e}"))?;
        devices.push(DeviceStatus {
            index: DeviceIndex(index),
            connected: connected != 0,
        });
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::os::fd::AsFd;

    use neli::{FromBytesWithInput, Size, ToBytes};

    use super::*;

    fn bytes(msg: &NbdMessage) -> Vec<u8> {
        let mut c = Cursor::new(Vec::new());
        msg.to_bytes(&mut c).unwrap();
        c.into_inner()
    }

    /// One attribute as the kernel lays it out: little-endian length and type, payload, padding.
    fn nla(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = u16::try_from(4 + payload.len())
            .unwrap()
            .to_le_bytes()
            .to_vec();
        v.extend_from_slice(&kind.to_le_bytes());
        v.extend_from_slice(payload);
        while !v.len().is_multiple_of(4) {
            v.push(0);
        }
        v
    }

    const NESTED: u16 = 1 << 15;

    #[test]
    fn connect_layout_has_exact_widths() {
        let id = BackendId::new("vol-1:a").unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        let fd = file.as_fd();
        let raw = fd.as_raw_fd() as u32;
        let req = ConnectRequest {
            index: Some(DeviceIndex(5)),
            size_bytes: 64 << 20,
            block_size: 512,
            server_flags: TransmissionFlags::HAS_FLAGS | TransmissionFlags::SEND_FLUSH,
            timeout: Some(Duration::from_millis(1500)),
            dead_conn_timeout: Duration::from_secs(120),
            client_flags: 0,
            identifier: &id,
            sockets: &[fd],
        };
        let got = bytes(&connect(&req).unwrap());

        let mut want = vec![1u8, 1, 0, 0]; // cmd CONNECT, version 1, reserved
        want.extend(nla(1, &5u32.to_ne_bytes()));
        want.extend(nla(2, &(64u64 << 20).to_ne_bytes()));
        want.extend(nla(3, &512u64.to_ne_bytes()));
        want.extend(nla(5, &5u64.to_ne_bytes()));
        want.extend(nla(4, &2u64.to_ne_bytes())); // 1.5 s rounds up to 2
        want.extend(nla(8, &120u64.to_ne_bytes()));
        want.extend(nla(6, &0u64.to_ne_bytes()));
        want.extend(nla(10, b"vol-1:a\0"));
        let sock_fd = nla(1, &raw.to_ne_bytes());
        let item = nla(1 | NESTED, &sock_fd);
        want.extend(nla(7 | NESTED, &item));
        assert_eq!(got, want);
    }

    #[test]
    fn connect_without_index_or_timeout_omits_them() {
        let id = BackendId::new("x").unwrap();
        let req = ConnectRequest {
            index: None,
            size_bytes: 4096,
            block_size: 4096,
            server_flags: TransmissionFlags::HAS_FLAGS,
            timeout: None,
            dead_conn_timeout: Duration::from_secs(30),
            client_flags: 0,
            identifier: &id,
            sockets: &[],
        };
        let msg = connect(&req).unwrap();
        let handle = msg.attrs().get_attr_handle();
        assert!(handle.get_attribute(NbdAttr::Index).is_none());
        assert!(handle.get_attribute(NbdAttr::Timeout).is_none());
        assert_eq!(
            handle
                .get_attr_payload_as::<u64>(NbdAttr::DeadConnTimeout)
                .unwrap(),
            30
        );
    }

    #[test]
    fn reconfigure_and_disconnect_layout() {
        let id = BackendId::new("v").unwrap();
        let got = bytes(
            &reconfigure(&ReconfigureRequest {
                index: DeviceIndex(2),
                identifier: &id,
                sockets: &[],
                size_bytes: Some(1 << 30),
                dead_conn_timeout: None,
            })
            .unwrap(),
        );
        let mut want = vec![3u8, 1, 0, 0];
        want.extend(nla(1, &2u32.to_ne_bytes()));
        want.extend(nla(10, b"v\0"));
        want.extend(nla(2, &(1u64 << 30).to_ne_bytes()));
        assert_eq!(got, want);

        let mut want = vec![2u8, 1, 0, 0];
        want.extend(nla(1, &9u32.to_ne_bytes()));
        assert_eq!(bytes(&disconnect(DeviceIndex(9)).unwrap()), want);
        assert_eq!(bytes(&status(None).unwrap()), vec![5u8, 1, 0, 0]);
    }

    /// A STATUS reply as the kernel builds it (`populate_nbd_status`): a device list of items,
    /// each with a u32 index and a u8 connected flag.
    #[test]
    fn parses_kernel_status_reply() {
        let dev = |index: u32, connected: u8| {
            let mut fields = nla(1, &index.to_ne_bytes());
            fields.extend(nla(2, &[connected]));
            nla(1 | NESTED, &fields)
        };
        let mut items = dev(0, 1);
        items.extend(dev(3, 0));
        let mut raw = vec![5u8, 1, 0, 0];
        raw.extend(nla(9 | NESTED, &items));
        let msg = NbdMessage::from_bytes_with_input(&mut Cursor::new(&raw), raw.len()).unwrap();
        assert_eq!(msg.unpadded_size(), raw.len());
        assert_eq!(
            parse_status(&msg).unwrap(),
            vec![
                DeviceStatus {
                    index: DeviceIndex(0),
                    connected: true
                },
                DeviceStatus {
                    index: DeviceIndex(3),
                    connected: false
                },
            ]
        );

        let mut raw = vec![4u8, 1, 0, 0];
        raw.extend(nla(1, &7u32.to_ne_bytes()));
        let msg = NbdMessage::from_bytes_with_input(&mut Cursor::new(&raw), raw.len()).unwrap();
        assert_eq!(parse_index(&msg), Ok(DeviceIndex(7)));

        let raw = vec![5u8, 1, 0, 0];
        let msg = NbdMessage::from_bytes_with_input(&mut Cursor::new(&raw), raw.len()).unwrap();
        assert!(parse_status(&msg).is_err());
        assert!(parse_index(&msg).is_err());
    }
}
