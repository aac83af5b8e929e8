//! `nbdctl`: try the `nbd` library by hand on a node. Attach, list, detach, reconnect, watch.
//! It is a debugging tool; the node daemon is what attaches volumes in production.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use nbd::attach::{self, AttachOptions};
use nbd::dial::{self, DialOptions};
use nbd::netlink::{LinkDeadEvents, NbdNetlink};
use nbd::sysfs::Sysfs;
use nbd::{BackendId, DeviceIndex, NbdUri};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Attach NBD exports through the kernel's nbd netlink interface"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Handshake with an export and print what it advertises; attaches nothing.
    Probe { uri: NbdUri },
    /// Attach an export and print the device path.
    Attach {
        uri: NbdUri,
        /// Backend identifier the device will carry (shown in /sys/block/nbdN/backend).
        #[arg(long)]
        id: BackendId,
        /// A specific device (/dev/nbdN, nbdN or N); default: any free one.
        #[arg(long)]
        device: Option<DeviceIndex>,
        #[arg(long, default_value_t = 1)]
        connections: u8,
        /// Per-request timeout in seconds; 0 disables it.
        #[arg(long, default_value_t = nbd::attach::DEFAULT_IO_TIMEOUT.as_secs())]
        io_timeout: u64,
        /// Seconds I/O waits for a reconnect after the link dies.
        #[arg(long, default_value_t = nbd::attach::DEFAULT_DEAD_CONN_TIMEOUT.as_secs())]
        dead_conn_timeout: u64,
        #[arg(long)]
        block_size: Option<u32>,
    },
    /// Give a device fresh connections (after LINK_DEAD), under the same identifier.
    Reconnect {
        device: DeviceIndex,
        uri: NbdUri,
        #[arg(long)]
        id: BackendId,
        #[arg(long, default_value_t = 1)]
        connections: u8,
    },
    /// Detach a device, after checking it carries the given identifier.
    Detach {
        device: DeviceIndex,
        #[arg(long)]
        id: BackendId,
    },
    /// List NBD devices in use, with their state and identifier.
    List {
        /// Also list devices that are free.
        #[arg(long)]
        all: bool,
    },
    /// Print LINK_DEAD events as they arrive.
    Watch,
}

// One short-lived command: a single-threaded runtime starts faster than a thread pool.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let sysfs = Sysfs::default();
    match Cli::parse().command {
        Command::Probe { uri } => {
            let dialed = dial::dial(&uri, &DialOptions::default()).await?;
            let info = dialed.info;
            println!("size: {} bytes", info.size);
            println!("flags: {:?}", info.flags);
            if let Some(b) = info.block_sizes {
                println!(
                    "block sizes: minimum {} preferred {} maximum {}",
                    b.minimum, b.preferred, b.maximum
                );
            }
        }
        Command::Attach {
            uri,
            id,
            device,
            connections,
            io_timeout,
            dead_conn_timeout,
            block_size,
        } => {
            let nl = NbdNetlink::open().await?;
            let mut opts = AttachOptions::new(id);
            opts.index = device;
            opts.dial.connections = connections;
            opts.io_timeout = (io_timeout > 0).then(|| Duration::from_secs(io_timeout));
            opts.dead_conn_timeout = Duration::from_secs(dead_conn_timeout);
            opts.block_size = block_size;
            let attached = attach::attach(&nl, &sysfs, &uri, &opts).await?;
            println!("{}", sysfs.dev_path(attached.device.index()).display());
        }
        Command::Reconnect {
            device,
            uri,
            id,
            connections,
        } => {
            let nl = NbdNetlink::open().await?;
            let proven = sysfs.prove(device, &id)?;
            let opts = DialOptions {
                connections,
                ..DialOptions::default()
            };
            attach::reconnect(&nl, &uri, &proven, &opts).await?;
        }
        Command::Detach { device, id } => {
            let nl = NbdNetlink::open().await?;
            attach::detach(&nl, &sysfs, device, &id, Duration::from_secs(10)).await?;
        }
        Command::List { all } => {
            let nl = NbdNetlink::open().await?;
            println!(
                "{:<12} {:<9} {:>12}  BACKEND",
                "DEVICE", "CONNECTED", "SIZE"
            );
            for status in nl.status(None).await.context("STATUS")? {
                let index = status.index;
                let backend = sysfs.backend(index)?;
                if !all && !status.connected && backend.is_none() {
                    continue;
                }
                let backend = backend.unwrap_or_else(|| "-".into());
                let size = sysfs.size_bytes(index).unwrap_or(0);
                println!(
                    "{:<12} {:<9} {:>12}  {}",
                    index.to_string(),
                    if status.connected { "yes" } else { "no" },
                    size,
                    backend
                );
            }
        }
        Command::Watch => {
            let mut events = LinkDeadEvents::subscribe().await?;
            while let Some(event) = events.next().await {
                println!("link dead: {}", event?);
            }
        }
    }
    Ok(())
}
