//! The gate's connection to nbdkit. Two nbdkit instances serve the same images, one of them
//! read-only (`-r`): a read-only grant must not open a writable export, and which grant a
//! connection has is known only once its name is read. So the gate greets the client with
//! the writable instance's greeting and, when the admitted grant is read-only, moves to the
//! read-only one before it forwards the name (both greet alike: the same nbdkit).

use std::path::PathBuf;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::gate::GateError;
use super::wire::{expect_magic, io, read_len, send_option};
use nbd::protocol::{rep, OPT_REPLY_MAGIC};

/// Option codes the client crate does not name.
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// nbdkit's unix sockets.
#[derive(Debug, Clone)]
pub struct Sockets {
    pub writable: PathBuf,
    pub read_only: PathBuf,
}

#[derive(Debug)]
pub struct Upstream {
    stream: UnixStream,
    read_only: bool,
    greeting: [u8; 18],
    /// The client's flags, sent again to an instance moved to.
    flags: Option<u32>,
    /// Structured replies were negotiated, so an instance moved to is asked for them too.
    structured: bool,
}

async fn connect(sockets: &Sockets, read_only: bool) -> Result<(UnixStream, [u8; 18]), GateError> {
    let socket = if read_only {
        &sockets.read_only
    } else {
        &sockets.writable
    };
    let mut stream = UnixStream::connect(socket)
        .await
        .map_err(|source| GateError::Upstream {
            socket: socket.clone(),
            source,
        })?;
    let mut greeting = [0u8; 18];
    stream
        .read_exact(&mut greeting)
        .await
        .map_err(io("nbdkit greeting"))?;
    Ok((stream, greeting))
}

impl Upstream {
    /// Connected to the writable instance, its greeting read.
    pub async fn open(sockets: &Sockets) -> Result<Self, GateError> {
        let (stream, greeting) = connect(sockets, false).await?;
        Ok(Self {
            stream,
            read_only: false,
            greeting,
            flags: None,
            structured: false,
        })
    }

    /// What the client is greeted with.
    pub fn greeting(&self) -> &[u8; 18] {
        &self.greeting
    }

    pub async fn send_flags(&mut self, flags: u32) -> Result<(), GateError> {
        self.flags = Some(flags);
        self.stream
            .write_u32(flags)
            .await
            .map_err(io("client flags to nbdkit"))
    }

    /// Notes that nbdkit acknowledged structured replies.
    pub fn structured(&mut self) {
        self.structured = true;
    }

    pub fn stream(&mut self) -> &mut UnixStream {
        &mut self.stream
    }

    pub fn into_stream(self) -> UnixStream {
        self.stream
    }

    /// On the instance of a grant that is `read_only` or not, in the state the client has
    /// negotiated so far.
    pub async fn serve(&mut self, sockets: &Sockets, read_only: bool) -> Result<(), GateError> {
        if self.read_only == read_only {
            return Ok(());
        }
        let (mut stream, greeting) = connect(sockets, read_only).await?;
        if greeting != self.greeting {
            return Err(GateError::UpstreamsDiffer);
        }
        if let Some(flags) = self.flags {
            stream
                .write_u32(flags)
                .await
                .map_err(io("client flags to nbdkit"))?;
        }
        if self.structured {
            const DURING: &str = "structured replies, again";
            send_option(&mut stream, OPT_STRUCTURED_REPLY, &[]).await?;
            expect_magic(&mut stream, OPT_REPLY_MAGIC, DURING).await?;
            let _option = stream.read_u32().await.map_err(io(DURING))?;
            let kind = stream.read_u32().await.map_err(io(DURING))?;
            read_len(&mut stream, DURING).await?;
            if kind != rep::ACK {
                return Err(GateError::UpstreamsDiffer);
            }
        }
        self.stream = stream;
        self.read_only = read_only;
        Ok(())
    }
}
