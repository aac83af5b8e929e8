//! Node daemon benchmarks, run in the VM by `tests/vm/run --bench`, all in one guest run:
//!
//! - attach: NodeStageVolume (block) through the CSI socket vs `nbd-client` on the same export,
//!   20 runs each, interleaved, medians and ratio;
//! - storm: 64 NodeStageVolume (block) at once from one client, beside 64 `nbd-client` at once:
//!   p50, p95 and max per call, and the wall time of each storm;
//! - restart: daemon start to "ready" (Probe) with 16, 64, 256 and 1,024 staged volumes;
//! - footprint: daemon RSS with 16, 64, 256 and 1,024 staged volumes, idle;
//! - reconnect: from the NBD server's restart to I/O flowing again on a staged volume.

// A benchmark stops on the first failure. Its clocks count from its own start: micro- and
// milliseconds since then fit a u64 for 584,000 years.
#![allow(clippy::unwrap_used, clippy::cast_possible_truncation)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_proto::csi::volume_capability::access_mode::Mode;
use nbd::sysfs::Sysfs;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::{pattern, DirectFile, Listen, NbdServer};

const RUNS: usize = 20;
const SIZE: u64 = 64 << 20;

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn staging(daemon: &NodeDaemon, id: &str) -> PathBuf {
    let p = daemon.scratch().join(format!("staging/{id}"));
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

fn daemon_pid(daemon: &NodeDaemon) -> u32 {
    let out = Command::new("pidof")
        .arg("ustor-csi-node")
        .output()
        .unwrap();
    let pids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    assert_eq!(pids.len(), 1, "one daemon running for {}", daemon.node_id);
    pids[0]
}

async fn attach_latency(server: &NbdServer) {
    let mut daemon = NodeDaemon::new("bench-attach", "").unwrap();
    let mut c = daemon.start(None).await;
    let uri = server.uri().to_string();
    let nbd::uri::Endpoint::Tcp { port, .. } = server.uri().endpoint().clone() else {
        unreachable!()
    };
    let sysfs = Sysfs::default();
    let (mut node, mut client) = (Vec::new(), Vec::new());
    for run in 0..RUNS {
        let id = format!("lat-{run}");
        let path = staging(&daemon, &id);
        let t = Instant::now();
        c.node
            .node_stage_volume(stage_request(
                &id,
                &path,
                block_capability(Mode::SingleNodeSingleWriter),
                &uri,
            ))
            .await
            .unwrap();
        node.push(t.elapsed());
        c.node
            .node_unstage_volume(unstage_request(&id, &path))
            .await
            .unwrap();

        // nbd-client on the first free device, timed to "device ready" like NodeStage.
        let index = testkit::nbd_client::free_device(&sysfs);
        let t = Instant::now();
        testkit::nbd_client::attach(&sysfs, index, "bench", port, &["-b", "512"], SIZE).await;
        client.push(t.elapsed());
        testkit::nbd_client::detach(&sysfs, index).await;
    }
    let (n, m) = (median(&mut node), median(&mut client));
    println!("attach, {RUNS} runs each, median (call to device ready):");
    println!("  NodeStageVolume (block) : {:8.2} ms", ms(n));
    println!("  nbd-client              : {:8.2} ms", ms(m));
    println!("  ratio NodeStage / nbd-client : {:.2}", ms(n) / ms(m));
}

/// Percentile `p` (0–100) of sorted samples.
fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

/// One storm's line. `ends` are the calls' completions, counted from the storm's start: the
/// kernel takes one CONNECT at a time, so how far apart they come shows that queue, the floor
/// of any client's storm.
fn storm_line(what: &str, mut calls: Vec<Duration>, mut ends: Vec<Duration>, wall: Duration) {
    calls.sort();
    ends.sort();
    let spread = *ends.last().unwrap() - ends[0];
    println!(
        "  {what:<24}: wall {:8.1} ms; per call p50 {:7.1} ms, p95 {:7.1} ms, max {:7.1} ms; \
         a completion every {:5.1} ms",
        ms(wall),
        ms(percentile(&calls, 50)),
        ms(percentile(&calls, 95)),
        ms(*calls.last().unwrap()),
        ms(spread) / (ends.len() - 1) as f64
    );
}

/// 64 NodeStage(block) calls at once from one client process, as kubelet makes them (one
/// process per call would measure the client's start-up), beside 64 `nbd-client` attaches at
/// once on 64 free devices, in the same guest run.
async fn attach_storm(server: &NbdServer) {
    const STORM: usize = 64;
    let mut daemon = NodeDaemon::new("bench-storm", "").unwrap();
    let mut c = daemon.start(None).await;
    let started = Instant::now();
    let calls: Vec<_> = (0..STORM)
        .map(|n| {
            let id = format!("storm-{n}");
            let path = staging(&daemon, &id);
            let (mut node, uri) = (c.node.clone(), server.uri_for(&id).to_string());
            tokio::spawn(async move {
                let t = Instant::now();
                node.node_stage_volume(stage_request(
                    &id,
                    &path,
                    block_capability(Mode::SingleNodeSingleWriter),
                    &uri,
                ))
                .await
                .unwrap();
                (id, path, t.elapsed(), started.elapsed())
            })
        })
        .collect();
    let mut staged = Vec::new();
    for call in calls {
        staged.push(call.await.unwrap());
    }
    let node_wall = started.elapsed();
    let node_calls: Vec<Duration> = staged.iter().map(|(_, _, d, _)| *d).collect();
    let node_ends: Vec<Duration> = staged.iter().map(|(_, _, _, end)| *end).collect();
    for (id, path, _, _) in &staged {
        c.node
            .node_unstage_volume(unstage_request(id, path))
            .await
            .unwrap();
    }

    let sysfs = Sysfs::default();
    let nbd::uri::Endpoint::Tcp { port, .. } = server.uri().endpoint().clone() else {
        unreachable!()
    };
    let free: Vec<_> = sysfs
        .devices()
        .unwrap()
        .into_iter()
        .filter(|i| {
            sysfs.backend(*i).ok().flatten().is_none() && sysfs.size_bytes(*i).ok() == Some(0)
        })
        .take(STORM)
        .collect();
    assert_eq!(free.len(), STORM, "free devices for the nbd-client storm");
    let started = Instant::now();
    let attaches: Vec<_> = free
        .iter()
        .map(|index| {
            let (sysfs, index) = (sysfs.clone(), *index);
            // nbd-client is a process the helper waits for: on a thread each, so all 64 run
            // at once, not two at a time on the runtime's workers.
            let runtime = tokio::runtime::Handle::current();
            tokio::task::spawn_blocking(move || {
                let t = Instant::now();
                runtime.block_on(testkit::nbd_client::attach(
                    &sysfs,
                    index,
                    "bench",
                    port,
                    &["-b", "512"],
                    SIZE,
                ));
                (t.elapsed(), started.elapsed())
            })
        })
        .collect();
    let (mut client_calls, mut client_ends) = (Vec::new(), Vec::new());
    for a in attaches {
        let (call, end) = a.await.unwrap();
        client_calls.push(call);
        client_ends.push(end);
    }
    let client_wall = started.elapsed();
    for index in &free {
        testkit::nbd_client::detach(&sysfs, *index).await;
    }
    println!("attach storm, {STORM} at once (call to device ready):");
    storm_line("NodeStageVolume (block)", node_calls, node_ends, node_wall);
    storm_line("nbd-client", client_calls, client_ends, client_wall);
    println!(
        "  wall ratio NodeStage / nbd-client : {:.2}",
        ms(node_wall) / ms(client_wall)
    );
}

async fn restart_and_footprint(server: &NbdServer) {
    for count in [16usize, 64, 256, 1024] {
        let mut daemon = NodeDaemon::new(&format!("bench-restart-{count}"), "").unwrap();
        let mut c = daemon.start(None).await;
        let mut paths = Vec::new();
        for n in 0..count {
            let id = format!("vol-{n}");
            let path = staging(&daemon, &id);
            c.node
                .node_stage_volume(stage_request(
                    &id,
                    &path,
                    block_capability(Mode::SingleNodeSingleWriter),
                    // One export per volume, as the daemon allows (the memory plugin serves
                    // every export name the same data, which a benchmark does not mind).
                    &server.uri_for(&id).to_string(),
                ))
                .await
                .unwrap();
            paths.push((id, path));
        }
        let mut ready = Vec::new();
        for _ in 0..5 {
            daemon.kill();
            let t = Instant::now();
            c = daemon.start(None).await;
            ready.push(t.elapsed());
        }
        // Idle footprint, after the post-restart connection refresh settled.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss = rss_kib(daemon_pid(&daemon));
        println!(
            "restart with {count} staged volumes: start to ready median {:.1} ms (5 restarts); idle RSS {} KiB",
            ms(median(&mut ready)),
            rss
        );
        for (id, path) in &paths {
            c.node
                .node_unstage_volume(unstage_request(id, path))
                .await
                .unwrap();
        }
    }
}

async fn reconnect_time() {
    let backing = tempfile::NamedTempFile::new().unwrap();
    backing.as_file().set_len(SIZE).unwrap();
    let file = format!("file={}", backing.path().display());
    let mut server = NbdServer::nbdkit(Listen::Tcp, &["file", &file]).unwrap();
    let mut daemon = NodeDaemon::new("bench-heal", "io-timeout-secs = 2\n").unwrap();
    let mut c = daemon.start(None).await;
    let path = staging(&daemon, "heal");
    let cap = block_capability(Mode::SingleNodeSingleWriter);
    c.node
        .node_stage_volume(stage_request(
            "heal",
            &path,
            cap.clone(),
            &server.uri().to_string(),
        ))
        .await
        .unwrap();
    let target = daemon.scratch().join("target");
    c.node
        .node_publish_volume(publish_request(
            "heal",
            &path,
            &target,
            cap,
            &server.uri().to_string(),
            false,
        ))
        .await
        .unwrap();
    let mut samples = Vec::new();
    for round in 0..5 {
        let last_write = Arc::new(AtomicU64::new(0));
        let epoch = Instant::now();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (target, last_write, stop) =
                (target.clone(), Arc::clone(&last_write), Arc::clone(&stop));
            std::thread::spawn(move || {
                let f = DirectFile::open(&target, true).unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    f.write_at(&pattern(round, n * 4096, 4096), (n % 1024) * 4096)
                        .unwrap();
                    last_write.store(epoch.elapsed().as_micros() as u64, Ordering::SeqCst);
                    n += 1;
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        server.kill();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let restarted = epoch.elapsed();
        server.start().unwrap();
        loop {
            let w = Duration::from_micros(last_write.load(Ordering::SeqCst));
            if w > restarted {
                samples.push(w - restarted);
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        stop.store(true, Ordering::SeqCst);
        writer.join().unwrap();
    }
    println!(
        "reconnect: server restart to the next completed write, median of 5: {:.1} ms (writes failed: 0)",
        ms(median(&mut samples))
    );
    c.node
        .node_unpublish_volume(unpublish_request("heal", &target))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_request("heal", &path))
        .await
        .unwrap();
}

/// Sections to run: all, or those named on the command line (`tests/vm/run --bench --filter
/// "attach restart"`); the outage section alone takes over ten minutes.
fn wanted(section: &str) -> bool {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    args.is_empty() || args.iter().any(|a| section.contains(a.as_str()))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = NbdServer::nbdkit(Listen::Tcp, &["memory", "64M"]).unwrap();
    if wanted("attach") {
        attach_latency(&server).await;
    }
    if wanted("storm") {
        attach_storm(&server).await;
    }
    if wanted("restart footprint") {
        restart_and_footprint(&server).await;
    }
    if wanted("reconnect") {
        reconnect_time().await;
    }
    if wanted("outage") {
        outages_with_default_timeouts().await;
    }
}

/// What an application and an operator see when the export's server is gone for a while,
/// with the daemon's default timeouts (io-timeout 10 s, dead-conn-timeout 300 s): the
/// longest a write waited, whether any failed, and what the volume condition and metrics said
/// meanwhile. "forever" is a server that does not come back before I/O fails; it is then
/// started again to see whether the volume recovers.
async fn outages_with_default_timeouts() {
    let backing = tempfile::NamedTempFile::new().unwrap();
    backing.as_file().set_len(SIZE).unwrap();
    let file = format!("file={}", backing.path().display());
    let mut server = NbdServer::nbdkit(Listen::Tcp, &["file", &file]).unwrap();
    let mut daemon = NodeDaemon::new("bench-outage", "").unwrap();
    let mut c = daemon.start(None).await;
    let path = staging(&daemon, "outage");
    let target = daemon.scratch().join("outage-target");
    let cap = block_capability(Mode::SingleNodeSingleWriter);
    let uri = server.uri().to_string();
    c.node
        .node_stage_volume(stage_request("outage", &path, cap.clone(), &uri))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_request("outage", &path, &target, cap, &uri, false))
        .await
        .unwrap();
    println!("outages, default timeouts (io 10 s, dead connection 300 s), one O_DIRECT writer:");
    for (label, outage) in [
        ("1 s", Some(Duration::from_secs(1))),
        ("30 s", Some(Duration::from_secs(30))),
        ("5 min", Some(Duration::from_secs(300))),
        ("forever", None),
    ] {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let longest = Arc::new(AtomicU64::new(0));
        let writer = {
            let (target, stop, longest) = (target.clone(), Arc::clone(&stop), Arc::clone(&longest));
            std::thread::spawn(move || -> Result<u64, (u64, std::io::Error)> {
                let f = DirectFile::open(&target, true).map_err(|e| (0, e))?;
                let mut n = 0u64;
                let epoch = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    let t = Instant::now();
                    f.write_at(&pattern(n, 0, 4096), (n % 1024) * 4096)
                        .map_err(|e| (epoch.elapsed().as_millis() as u64, e))?;
                    longest.fetch_max(t.elapsed().as_millis() as u64, Ordering::SeqCst);
                    n += 1;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(n)
            })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.kill();
        let killed = Instant::now();
        tokio::time::sleep(Duration::from_secs(1).min(outage.unwrap_or(Duration::MAX)) / 2).await;
        let cond = c
            .node
            .node_get_volume_stats(stats_request("outage", &target))
            .await
            .unwrap()
            .into_inner()
            .volume_condition
            .unwrap();
        let metrics = daemon.scrape().await;
        let links_down = metrics
            .lines()
            .find(|l| l.starts_with("ustor_csi_node_links_down "))
            .unwrap_or("ustor_csi_node_links_down ?")
            .to_owned();
        let outcome = match outage {
            Some(d) => {
                tokio::time::sleep(d.saturating_sub(killed.elapsed())).await;
                server.start().unwrap();
                let back = Instant::now();
                let before = longest.load(Ordering::SeqCst);
                // Until a write completes after the server is back.
                let mut waited = Duration::ZERO;
                while longest.load(Ordering::SeqCst) == before && !writer.is_finished() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    waited = back.elapsed();
                    if waited > Duration::from_secs(120) {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                stop.store(true, Ordering::SeqCst);
                let result = tokio::task::spawn_blocking(move || writer.join().unwrap())
                    .await
                    .unwrap();
                format!(
                    "longest write {:.1} s, I/O flowing {:.1} s after the server was back, writer {}",
                    longest.load(Ordering::SeqCst) as f64 / 1e3,
                    waited.as_secs_f64(),
                    match result {
                        Ok(n) => format!("ok ({n} writes)"),
                        Err((at, e)) => format!("FAILED after {:.1} s: {e}", at as f64 / 1e3),
                    }
                )
            }
            None => {
                let result = tokio::task::spawn_blocking(move || writer.join().unwrap())
                    .await
                    .unwrap();
                let failed = killed.elapsed();
                server.start().unwrap();
                tokio::time::sleep(Duration::from_secs(10)).await;
                let again = DirectFile::open(&target, true)
                    .and_then(|f| f.write_at(&pattern(1, 0, 4096), 0));
                format!(
                    "writer {} after {:.1} s; server started again: a new write {}",
                    match result {
                        Ok(_) => "did not fail".to_owned(),
                        Err((_, e)) => format!("failed ({e})"),
                    },
                    failed.as_secs_f64(),
                    match again {
                        Ok(()) => "succeeds".to_owned(),
                        Err(e) => format!("fails ({e})"),
                    }
                )
            }
        };
        println!(
            "  {label:>7}: {outcome}; during it: condition abnormal={} ({}), {links_down}",
            cond.abnormal, cond.message
        );
    }
}
