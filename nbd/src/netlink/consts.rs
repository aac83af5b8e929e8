//! The kernel's `nbd` generic-netlink family, mirrored from `include/uapi/linux/nbd-netlink.h`.
//! Attribute widths matter: the kernel checks them, so each attribute's type is noted.

use neli::neli_enum;

/// Family name registered by `drivers/block/nbd.c`.
pub const FAMILY_NAME: &str = "nbd";
/// Family version (`NBD_NL_VERSION`).
pub const FAMILY_VERSION: u8 = 1;
/// Multicast group on which `NBD_CMD_LINK_DEAD` is announced (`NBD_NL_MCAST_GROUP_NAME`).
pub const MCAST_GROUP: &str = "nbd_mc_group";

/// `enum { NBD_CMD_* }`.
#[neli_enum(serialized_type = "u8")]
pub enum NbdCmd {
    Unspec = 0,
    Connect = 1,
    Disconnect = 2,
    Reconfigure = 3,
    LinkDead = 4,
    Status = 5,
}
impl neli::consts::genl::Cmd for NbdCmd {}

/// `enum { NBD_ATTR_* }`.
#[neli_enum(serialized_type = "u16")]
pub enum NbdAttr {
    Unspec = 0,
    /// u32
    Index = 1,
    /// u64
    SizeBytes = 2,
    /// u64
    BlockSizeBytes = 3,
    /// u64, seconds
    Timeout = 4,
    /// u64, transmission flags
    ServerFlags = 5,
    /// u64, `NBD_CFLAG_*`
    ClientFlags = 6,
    /// nested `NbdSockItem`
    Sockets = 7,
    /// u64, seconds
    DeadConnTimeout = 8,
    /// nested `NbdDeviceItem` (STATUS reply)
    DeviceList = 9,
    /// NUL-terminated string
    BackendIdentifier = 10,
}
impl neli::consts::genl::NlAttrType for NbdAttr {}

/// `enum { NBD_SOCK_ITEM_* }`: the entries of `NBD_ATTR_SOCKETS`.
#[neli_enum(serialized_type = "u16")]
pub enum NbdSockItem {
    Unspec = 0,
    Item = 1,
}
impl neli::consts::genl::NlAttrType for NbdSockItem {}

/// `enum { NBD_SOCK_* }`: inside one socket item.
#[neli_enum(serialized_type = "u16")]
pub enum NbdSock {
    Unspec = 0,
    /// u32 file descriptor in the sender's table
    Fd = 1,
}
impl neli::consts::genl::NlAttrType for NbdSock {}

/// `enum { NBD_DEVICE_ITEM_* }`: the entries of `NBD_ATTR_DEVICE_LIST`.
#[neli_enum(serialized_type = "u16")]
pub enum NbdDeviceItem {
    Unspec = 0,
    Item = 1,
}
impl neli::consts::genl::NlAttrType for NbdDeviceItem {}

/// `enum { NBD_DEVICE_* }`: inside one device item.
#[neli_enum(serialized_type = "u16")]
pub enum NbdDevice {
    Unspec = 0,
    /// u32
    Index = 1,
    /// u8
    Connected = 2,
}
impl neli::consts::genl::NlAttrType for NbdDevice {}

/// `NBD_CFLAG_DESTROY_ON_DISCONNECT`: the device is freed when disconnected.
pub const CFLAG_DESTROY_ON_DISCONNECT: u64 = 1 << 0;
/// `NBD_CFLAG_DISCONNECT_ON_CLOSE`: disconnect when the last opener closes the device.
pub const CFLAG_DISCONNECT_ON_CLOSE: u64 = 1 << 1;
