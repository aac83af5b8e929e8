//! The framing of the NBD handshake the gate reads and writes: option requests and option
//! replies, each a magic, its 32-bit words and a length-prefixed payload.

use nbd::protocol::{IHAVEOPT, OPT_REPLY_MAGIC};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::gate::GateError;

/// Strings in the protocol are capped at 4096 bytes: no option or reply we relay is longer
/// than this, and a longer one is a broken or hostile peer.
pub const MAX_LEN: u32 = 16 * 1024;

/// For `map_err`: an I/O failure `during` a step.
pub fn io(during: &'static str) -> impl FnOnce(std::io::Error) -> GateError {
    move |source| GateError::Io { during, source }
}

pub async fn read_len<R: AsyncRead + Unpin>(
    r: &mut R,
    during: &'static str,
) -> Result<Vec<u8>, GateError> {
    let len = r.read_u32().await.map_err(io(during))?;
    if len > MAX_LEN {
        return Err(GateError::Oversized { during, len });
    }
    let mut data = vec![0; len as usize];
    r.read_exact(&mut data).await.map_err(io(during))?;
    Ok(data)
}

pub async fn expect_magic<R: AsyncRead + Unpin>(
    r: &mut R,
    magic: u64,
    during: &'static str,
) -> Result<(), GateError> {
    match r.read_u64().await.map_err(io(during))? {
        got if got == magic => Ok(()),
        got => Err(GateError::BadMagic { during, got }),
    }
}

pub async fn read_option<R: AsyncRead + Unpin>(
    client: &mut R,
) -> Result<(u32, Vec<u8>), GateError> {
    const DURING: &str = "option request";
    expect_magic(client, IHAVEOPT, DURING).await?;
    let option = client.read_u32().await.map_err(io(DURING))?;
    Ok((option, read_len(client, DURING).await?))
}

/// One handshake message: its magic, its 32-bit words, then its data with the length.
fn frame(magic: u64, words: &[u32], data: &[u8]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(12 + 4 * words.len() + data.len());
    buf.extend_from_slice(&magic.to_be_bytes());
    for w in words {
        buf.extend_from_slice(&w.to_be_bytes());
    }
    // What the gate sends was read with at most MAX_LEN bytes, or is its own short text.
    buf.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    buf.extend_from_slice(data);
    buf
}

pub async fn send_option<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    data: &[u8],
) -> Result<(), GateError> {
    w.write_all(&frame(IHAVEOPT, &[option], data))
        .await
        .map_err(io("option to nbdkit"))
}

/// One option reply, as the gate's own answer or relayed.
pub async fn write_reply<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    kind: u32,
    data: &[u8],
) -> Result<(), GateError> {
    w.write_all(&frame(OPT_REPLY_MAGIC, &[option, kind], data))
        .await
        .map_err(io("option reply"))
}
