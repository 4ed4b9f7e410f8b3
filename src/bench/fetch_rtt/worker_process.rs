//! `--workers-process`: the producer's copy workers as separate OS processes, the way an engine
//! runs one copy worker per GPU rank.
//!
//! The producer re-executes the `kvtier` binary with the hidden `bench-copy-worker` subcommand,
//! once per rank. Each worker maps the producer's shared arena with an `ArenaView`, connects to
//! the manager's completion channel (off-step mode only) and then follows line orders on its
//! stdin:
//!
//! - `keys <request> <hex key>,<hex key>,…` — the request's keys; the worker builds their
//!   "device" bytes now, before any copy is timed;
//! - `sync` — answered with `ready` on stdout once every earlier line was handled;
//! - `copy <request> <row>,<row>,…` — copy this rank's share of the rows (the chunks whose index
//!   modulo the rank count is this rank), report the request's keys on the channel, and answer
//!   `done <request> <0|1>` on stdout.
//!
//! End of stdin: the worker says goodbye on the channel and exits. Every rank reports every
//! key of a store, so with `reporters = 2` a key completes off-step once both shares are copied.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tiering_core::arena::ArenaView;
use tiering_core::channel::{WorkerReporter, arena_fingerprint};
use tiering_core::{OffloadKey, arena::ChunkId};

use super::copy::{CopyDone, CopyOrder, copy_share, device_bytes};
use crate::bench::BenchError;
use crate::host_buffer::HostBuffer;

/// Arguments of the hidden `kvtier bench-copy-worker` subcommand (started by
/// `kvtier bench fetch-rtt --workers-process`, not by hand).
#[derive(Clone, Debug, clap::Args)]
pub struct CopyWorkerArgs {
    /// The producer's shared arena file.
    #[arg(long)]
    pub arena: PathBuf,
    /// This worker's rank.
    #[arg(long)]
    pub rank: u32,
    /// Number of ranks.
    #[arg(long)]
    pub ranks: u32,
    /// The manager's completion channel; no reports without it.
    #[arg(long)]
    pub channel: Option<PathBuf>,
    /// The producer's measured memcpy rate, bytes per second.
    #[arg(long)]
    pub memcpy_rate: f64,
}

fn hex(key: &OffloadKey) -> String {
    key.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<OffloadKey> {
    if s.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect();
    OffloadKey::from_bytes(&bytes?)
}

/// Runs one copy worker process until its stdin ends.
///
/// # Errors
/// The arena cannot be mapped, the channel cannot be reached, or an order is malformed.
pub fn copy_worker(args: &CopyWorkerArgs) -> Result<()> {
    if args.ranks == 0 || args.rank >= args.ranks {
        bail!("rank {} is outside 0..{}", args.rank, args.ranks);
    }
    let view = ArenaView::open(&args.arena)
        .with_context(|| format!("cannot map the arena {}", args.arena.display()))?;
    // A GPU worker registers the arena for DMA (`cudaHostRegister`), which maps every page of
    // its view before the first copy; populating the view stands in for that registration, so
    // the copies time the bytes rather than this process's first-touch page faults.
    view.arena()
        .register_for_dma(&populate_for_writing)
        .context("cannot populate the arena view")?;
    let mut reporter = match &args.channel {
        Some(path) => Some(
            WorkerReporter::connect(path, args.rank, arena_fingerprint(view.arena()))
                .with_context(|| format!("cannot reach the completion channel {}", path.display()))?,
        ),
        None => None,
    };
    let chunk_bytes = view.arena().chunk_bytes();
    let mut requests: Vec<(Vec<OffloadKey>, Vec<HostBuffer>)> = Vec::new();
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading orders")?;
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("keys"), Some(i), Some(list)) => {
                let i: usize = i.parse().context("request index")?;
                let keys: Option<Vec<OffloadKey>> = list.split(',').map(unhex).collect();
                let keys = keys.context("malformed key")?;
                if i != requests.len() {
                    bail!("keys of request {i} arrived out of order");
                }
                let sources = device_bytes(&keys, chunk_bytes);
                requests.push((keys, sources));
            }
            (Some("sync"), None, None) => {
                let mut out = stdout.lock();
                writeln!(out, "ready")?;
                out.flush()?;
            }
            (Some("copy"), Some(i), Some(list)) => {
                let i: usize = i.parse().context("request index")?;
                let rows: Vec<ChunkId> = list
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .context("malformed row")?;
                let (keys, sources) = requests
                    .get(i)
                    .with_context(|| format!("copy order for unknown request {i}"))?;
                let ok = copy_share(
                    view.arena(),
                    sources,
                    &rows,
                    args.rank,
                    args.ranks,
                    args.memcpy_rate,
                );
                if let Some(r) = reporter.as_mut() {
                    r.report(keys, ok)
                        .context("reporting on the completion channel")?;
                }
                let mut out = stdout.lock();
                writeln!(out, "done {i} {}", u8::from(ok))?;
                out.flush()?;
            }
            _ => bail!("malformed order `{line}`"),
        }
    }
    if let Some(r) = reporter {
        r.close().context("saying goodbye on the completion channel")?;
    }
    Ok(())
}

/// One running worker process.
struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<JoinHandle<()>>,
}

/// The producer's side: the worker processes, their order pipes and their answer readers.
pub(super) struct WorkerProcesses {
    workers: Vec<Worker>,
}

fn spawn_err(message: impl Into<String>) -> BenchError {
    BenchError::Tier {
        tier: "copy worker process".into(),
        message: message.into(),
    }
}

impl WorkerProcesses {
    /// Starts `ranks` workers of `exe` on the arena at `arena`, hands them every request's
    /// keys, and waits until each is ready. Their `done` answers go to `done`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start(
        exe: &Path,
        arena: &Path,
        channel: Option<&Path>,
        ranks: u32,
        rate: f64,
        keys: &[Vec<OffloadKey>],
        timeout: Duration,
        done: &Sender<CopyDone>,
    ) -> Result<Self, BenchError> {
        let mut out = Self { workers: Vec::new() };
        let (ready_tx, ready_rx) = mpsc::channel::<u32>();
        for rank in 0..ranks {
            let mut cmd = Command::new(exe);
            cmd.arg("bench-copy-worker")
                .arg("--arena")
                .arg(arena)
                .arg("--rank")
                .arg(rank.to_string())
                .arg("--ranks")
                .arg(ranks.to_string())
                .arg("--memcpy-rate")
                .arg(rate.to_string());
            if let Some(c) = channel {
                cmd.arg("--channel").arg(c);
            }
            let mut child = cmd
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| spawn_err(format!("cannot start {}: {e}", exe.display())))?;
            let stdin = child.stdin.take();
            let stdout = child.stdout.take();
            let done = done.clone();
            let ready = ready_tx.clone();
            let reader = stdout.map(|s| {
                std::thread::spawn(move || {
                    for line in BufReader::new(s).lines() {
                        let Ok(line) = line else { return };
                        let mut w = line.split_whitespace();
                        match (w.next(), w.next(), w.next()) {
                            (Some("ready"), None, None) => {
                                let _ = ready.send(rank);
                            }
                            (Some("done"), Some(i), Some(ok)) => {
                                let Ok(i) = i.parse() else { return };
                                if done
                                    .send((i, rank, ok == "1", std::time::Instant::now()))
                                    .is_err()
                                {
                                    return;
                                }
                            }
                            _ => {
                                tracing::error!(rank, %line, "copy worker said something unexpected");
                                return;
                            }
                        }
                    }
                })
            });
            out.workers.push(Worker { child, stdin, reader });
        }
        let mut text = String::new();
        for (i, ks) in keys.iter().enumerate() {
            let list: Vec<String> = ks.iter().map(hex).collect();
            text.push_str(&format!("keys {i} {}\n", list.join(",")));
        }
        text.push_str("sync\n");
        out.send_all(&text)?;
        for _ in 0..ranks {
            ready_rx
                .recv_timeout(timeout)
                .map_err(|_| spawn_err("a copy worker did not become ready (see its errors above)"))?;
        }
        Ok(out)
    }

    fn send_all(&mut self, text: &str) -> Result<(), BenchError> {
        for (rank, w) in self.workers.iter_mut().enumerate() {
            let stdin = w
                .stdin
                .as_mut()
                .ok_or_else(|| spawn_err(format!("worker {rank} has no order pipe")))?;
            stdin
                .write_all(text.as_bytes())
                .and_then(|()| stdin.flush())
                .map_err(|e| spawn_err(format!("worker {rank} stopped taking orders: {e}")))?;
        }
        Ok(())
    }

    /// Ranks (worker processes).
    pub(super) fn ranks(&self) -> u32 {
        self.workers.len() as u32
    }

    /// Hands a store to every worker.
    pub(super) fn order(&mut self, order: &CopyOrder) -> Result<(), BenchError> {
        let rows: Vec<String> = order.rows.iter().map(ToString::to_string).collect();
        self.send_all(&format!("copy {} {}\n", order.request, rows.join(",")))
    }

    /// Closes the order pipes and waits for every worker to exit.
    pub(super) fn finish(mut self) -> Result<(), BenchError> {
        let mut failed = Vec::new();
        for (rank, w) in self.workers.iter_mut().enumerate() {
            drop(w.stdin.take());
            match w.child.wait() {
                Ok(s) if s.success() => {}
                Ok(s) => failed.push(format!("worker {rank} exited with {s}")),
                Err(e) => failed.push(format!("worker {rank}: {e}")),
            }
            if let Some(r) = w.reader.take() {
                let _ = r.join();
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(spawn_err(failed.join("; ")))
        }
    }
}

impl Drop for WorkerProcesses {
    fn drop(&mut self) {
        // Not finished (an error path): no worker outlives the benchmark.
        for w in &mut self.workers {
            drop(w.stdin.take());
            if matches!(w.child.try_wait(), Ok(None)) {
                let _ = w.child.kill();
            }
            let _ = w.child.wait();
        }
    }
}

/// Maps every page of `len` bytes at `ptr` writable in this process (`MADV_POPULATE_WRITE`),
/// as a device registration of pinned host memory does.
fn populate_for_writing(ptr: *mut u8, len: usize) -> Result<(), String> {
    // SAFETY: the arena hands over its own row region, a live shared mapping of `len` bytes
    // that stays mapped for the call; MADV_POPULATE_WRITE only faults its pages in and changes
    // no byte.
    let rc = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_POPULATE_WRITE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!(
            "madvise(MADV_POPULATE_WRITE): {}",
            std::io::Error::last_os_error()
        ))
    }
}
