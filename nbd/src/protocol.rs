//! Constants of the NBD wire protocol (`doc/proto.md` of the NBD project) used by the handshake.
//! Names follow the specification so they can be looked up there.

use bitflags::bitflags;

/// "NBDMAGIC": first eight bytes a server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": second magic of the newstyle handshake, and prefix of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Second magic of the obsolete oldstyle handshake.
pub const CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Prefix of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

bitflags! {
    /// Handshake flags sent by the server right after the magics.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct HandshakeFlags: u16 {
        const FIXED_NEWSTYLE = 1 << 0;
        const NO_ZEROES = 1 << 1;
    }
}

bitflags! {
    /// Client flags answered to the handshake flags.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct ClientFlags: u32 {
        const FIXED_NEWSTYLE = 1 << 0;
        const NO_ZEROES = 1 << 1;
    }
}

bitflags! {
    /// Transmission flags of an export. The kernel's `NBD_ATTR_SERVER_FLAGS` takes these bits
    /// unchanged, so they are handed to it as the server sent them.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct TransmissionFlags: u16 {
        const HAS_FLAGS = 1 << 0;
        const READ_ONLY = 1 << 1;
        const SEND_FLUSH = 1 << 2;
        const SEND_FUA = 1 << 3;
        const ROTATIONAL = 1 << 4;
        const SEND_TRIM = 1 << 5;
        const SEND_WRITE_ZEROES = 1 << 6;
        const SEND_DF = 1 << 7;
        const CAN_MULTI_CONN = 1 << 8;
        const SEND_RESIZE = 1 << 9;
        const SEND_CACHE = 1 << 10;
        const SEND_FAST_ZERO = 1 << 11;
        const _ = !0;
    }
}

/// Option codes sent by the client.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const STARTTLS: u32 = 5;
    pub const GO: u32 = 7;
}

/// Information types requested with and returned by `NBD_OPT_GO`.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Option reply types. Errors have bit 31 set.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const INFO: u32 = 3;
    pub const FLAG_ERROR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = FLAG_ERROR | 1;
    pub const ERR_POLICY: u32 = FLAG_ERROR | 2;
    pub const ERR_INVALID: u32 = FLAG_ERROR | 3;
    pub const ERR_PLATFORM: u32 = FLAG_ERROR | 4;
    pub const ERR_TLS_REQD: u32 = FLAG_ERROR | 5;
    pub const ERR_UNKNOWN: u32 = FLAG_ERROR | 6;
    pub const ERR_SHUTDOWN: u32 = FLAG_ERROR | 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = FLAG_ERROR | 8;
    pub const ERR_TOO_BIG: u32 = FLAG_ERROR | 9;

    /// The specification's name of an error reply, for messages.
    pub fn error_name(code: u32) -> &'static str {
        match code {
            ERR_UNSUP => "NBD_REP_ERR_UNSUP",
            ERR_POLICY => "NBD_REP_ERR_POLICY",
            ERR_INVALID => "NBD_REP_ERR_INVALID",
            ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
            ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
            ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
            ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
            ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
            ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
            _ => "unknown NBD error reply",
        }
    }
}
