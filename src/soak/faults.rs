//! The processes and the filesystem the soak breaks, and the operations that break them:
//! a `redis-server` it starts itself, the peer node (a second `kvtier` process), a small
//! tmpfs for the disk tiers, the disk tier's slab file, and the primary tier's arena.
//!
//! Every child process is started with `PR_SET_PDEATHSIG = SIGKILL` by one thread that lives
//! as long as the process, so none outlives the soak however it ends (and none dies with the
//! thread that asked for it); a reaper process (a shell waiting on a pipe from the soak) unmounts the
//! tmpfs and removes the soak's directory when that pipe closes, which is also when the soak
//! dies without cleaning up.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use parking_lot::Mutex;
use tier_disk::format::{BLOCK, SlabLayout, SlotSeal};
use tiering_core::{OffloadKey, arena::ChunkArena};

use crate::sim::SimRng;

/// The slab file a disk tier keeps in its directory.
pub const SLAB_FILE: &str = "kvtier-disk.slab";

/// A free loopback TCP port.
///
/// # Errors
/// No port can be bound.
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    Ok(l.local_addr()?.port())
}

/// Starts `cmd` so that its process is killed when the soak's process dies.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process:
/// a peer node restarted by the fault injector's thread was SIGKILLed the moment that thread
/// ended, before the soak asked it to finish. So every child is forked by one spawner thread
/// that lives as long as the process.
fn spawn_dying_with_process(mut cmd: Command) -> std::io::Result<Child> {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    // SAFETY: the closure runs in the child between fork and exec and only makes the
    // async-signal-safe `prctl` system call.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        // The sender stays in the static, so the thread never ends.
        let started = std::thread::Builder::new()
            .name("kvtier-soak-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start the soak's spawner thread");
        }
        Mutex::new(tx)
    });
    let (reply, answer) = mpsc::channel();
    spawner
        .lock()
        .send((cmd, reply))
        .map_err(|_| std::io::Error::other("the soak's spawner thread is gone"))?;
    answer
        .recv()
        .map_err(|_| std::io::Error::other("the soak's spawner thread is gone"))?
}

/// Sends `signal` to `pid`; false when the process is gone.
pub fn signal(pid: u32, signal: libc::c_int) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) with a process id this soak started and a valid signal number.
    unsafe { libc::kill(pid, signal) == 0 }
}

/// Kills `child` with `sig`, then waits for it, at most `patience` (then SIGKILL).
fn kill_and_wait(child: &mut Child, sig: libc::c_int, patience: Duration) {
    signal(child.id(), sig);
    let deadline = Instant::now() + patience;
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// A `redis-server` on a loopback port, without persistence, in its own directory.
pub struct RedisServer {
    /// Its port.
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port, its working directory `dir` (created).
    ///
    /// # Errors
    /// `redis-server` is not installed, or it does not answer within 10 s.
    pub fn start(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut s = Self {
            port: free_port()?,
            dir: dir.to_owned(),
            child: None,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
            .arg("--dir")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = spawn_dying_with_process(cmd).context(
            "starting redis-server (install it with scripts/install-test-deps.sh or your package manager)",
        )?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.answers() {
            if Instant::now() > deadline {
                bail!(
                    "redis-server on 127.0.0.1:{} did not answer within 10 s",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Whether the server answers a PING.
    #[must_use]
    pub fn answers(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// The server's process id (0 when it is down).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGKILLs the server.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_and_wait(&mut c, libc::SIGKILL, Duration::from_secs(5));
        }
    }

    /// Starts it again on the same port.
    ///
    /// # Errors
    /// As [`RedisServer::start`].
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What the peer node reported, over every process it ran as.
#[derive(Clone, Debug, Default)]
pub struct PeerTotals {
    /// Rounds it completed.
    pub rounds: u64,
    /// Requests it completed.
    pub requests: u64,
    /// Bytes it loaded and verified.
    pub verified_bytes: u64,
    /// Loaded chunks whose bytes were wrong.
    pub corrupt_chunks: u64,
    /// Wrong bytes among them.
    pub wrong_bytes: u64,
    /// Prompt tokens it loaded from its p2p tier (chunks this node served it).
    pub p2p_tokens: u64,
    /// Slots its disk tier recovered when it opened, summed over its starts.
    pub recovered_slots: u64,
    /// Errors it reported (a failed round ends the process).
    pub errors: Vec<String>,
    /// Process ids it ran as.
    pub pids: Vec<u32>,
}

/// One status line of the peer node (JSON on its stdout).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct PeerLine {
    /// The round just completed (or `None` for the start line).
    pub round: Option<u64>,
    /// Requests completed in it.
    pub requests: u64,
    /// Bytes loaded and verified in it.
    pub verified_bytes: u64,
    /// Loaded chunks with wrong bytes in it.
    pub corrupt_chunks: u64,
    /// Wrong bytes in it.
    pub wrong_bytes: u64,
    /// Prompt tokens loaded from the p2p tier in it.
    pub p2p_tokens: u64,
    /// Start line: slots the disk tier recovered at open.
    pub recovered_slots: u64,
    /// A failure (the node exits after it).
    pub error: Option<String>,
}

/// The peer node: a `kvtier soak-node` child process, restarted at will.
pub struct PeerNode {
    exe: PathBuf,
    args: Vec<String>,
    child: Option<(Child, Option<ChildStdin>)>,
    totals: Arc<Mutex<PeerTotals>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl PeerNode {
    /// Starts `exe soak-node <args>`.
    ///
    /// # Errors
    /// The process cannot be started.
    pub fn start(exe: &Path, args: Vec<String>) -> Result<Self> {
        let mut p = Self {
            exe: exe.to_owned(),
            args,
            child: None,
            totals: Arc::default(),
            readers: Vec::new(),
        };
        p.spawn()?;
        Ok(p)
    }

    fn spawn(&mut self) -> Result<()> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("soak-node")
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = spawn_dying_with_process(cmd)
            .with_context(|| format!("starting the peer node {} soak-node", self.exe.display()))?;
        let stdout = child.stdout.take().context("the peer node's stdout")?;
        let stdin = child.stdin.take();
        let totals = Arc::clone(&self.totals);
        totals.lock().pids.push(child.id());
        let reader = std::thread::Builder::new()
            .name("kvtier-soak-peer".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let Ok(l) = serde_json::from_str::<PeerLine>(&line) else {
                        continue;
                    };
                    let mut t = totals.lock();
                    if l.round.is_some() {
                        t.rounds += 1;
                    }
                    t.requests += l.requests;
                    t.verified_bytes += l.verified_bytes;
                    t.corrupt_chunks += l.corrupt_chunks;
                    t.wrong_bytes += l.wrong_bytes;
                    t.p2p_tokens += l.p2p_tokens;
                    t.recovered_slots += l.recovered_slots;
                    if let Some(e) = l.error {
                        t.errors.push(e);
                    }
                }
            })
            .context("starting the peer node's reader thread")?;
        self.readers.push(reader);
        self.child = Some((child, stdin));
        Ok(())
    }

    /// The node's process id (0 when it is down).
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |(c, _)| c.id())
    }

    /// Stops the node with `sig` (SIGTERM, SIGKILL).
    pub fn kill(&mut self, sig: libc::c_int) {
        if let Some((mut c, stdin)) = self.child.take() {
            drop(stdin);
            kill_and_wait(&mut c, sig, Duration::from_secs(10));
        }
    }

    /// Starts the node again (the same arguments: the same ports and disk directory).
    ///
    /// # Errors
    /// The process cannot be started.
    pub fn restart(&mut self) -> Result<()> {
        self.kill(libc::SIGKILL);
        self.spawn()
    }

    /// Whether the node exited on its own; its exit status if so (it is then down).
    pub fn exited(&mut self) -> Option<String> {
        let (c, _) = self.child.as_mut()?;
        match c.try_wait() {
            Ok(Some(status)) => {
                self.child = None;
                Some(status.to_string())
            }
            Ok(None) | Err(_) => None,
        }
    }

    /// Asks the node to finish (its stdin closes: it ends the round it is in, shuts its chain
    /// down and exits), waits up to `patience`, then SIGKILLs it; returns whether it exited
    /// cleanly, and everything it reported.
    pub fn finish(mut self, patience: Duration) -> (Result<(), String>, PeerTotals) {
        let mut clean = Ok(());
        if let Some((mut c, stdin)) = self.child.take() {
            drop(stdin);
            let deadline = Instant::now() + patience;
            clean = loop {
                match c.try_wait() {
                    Ok(Some(s)) if s.success() => break Ok(()),
                    Ok(Some(s)) => break Err(s.to_string()),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    _ => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break Err(format!("still running after {patience:?}; killed"));
                    }
                }
            };
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let totals = self.totals.lock().clone();
        (clean, totals)
    }
}

impl Drop for PeerNode {
    fn drop(&mut self) {
        self.kill(libc::SIGKILL);
    }
}

/// The soak's directory and, when the kernel lets us, a small tmpfs inside it for the disk
/// tiers; a reaper process removes both if the soak dies without doing so.
pub struct Scratch {
    /// The soak's directory.
    pub root: PathBuf,
    /// Where the disk tiers live (the tmpfs mount, or a plain directory).
    pub disk: PathBuf,
    /// Why the disk directory is not its own tmpfs (the fill fault is then skipped).
    pub no_mount: Option<String>,
    mounted: bool,
    reaper: Option<(Child, ChildStdin)>,
}

impl Scratch {
    /// Creates `root` (which must not exist), and mounts a tmpfs of `tmpfs_bytes` at
    /// `root/disk`.
    ///
    /// # Errors
    /// `root` exists or cannot be created, or the reaper cannot be started.
    pub fn create(root: &Path, tmpfs_bytes: u64) -> Result<Self> {
        std::fs::create_dir(root)
            .with_context(|| format!("creating the soak directory {}", root.display()))?;
        let disk = root.join("disk");
        std::fs::create_dir(&disk)?;
        let mut cmd = Command::new("sh");
        // The pipe closes when the soak exits, however it exits; `read` then returns.
        cmd.arg("-c")
            .arg("read _ignored; umount -l \"$1\" 2>/dev/null; rm -rf \"$2\"")
            .arg("kvtier-soak-reaper")
            .arg(&disk)
            .arg(root)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().context("starting the soak's clean-up process (sh)")?;
        let stdin = child.stdin.take().context("the clean-up process's stdin")?;
        let mut s = Self {
            root: root.to_owned(),
            disk,
            no_mount: None,
            mounted: false,
            reaper: Some((child, stdin)),
        };
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={tmpfs_bytes},mode=0700"))
            .arg("kvtier-soak")
            .arg(&s.disk)
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(o) if o.status.success() => s.mounted = true,
            Ok(o) => {
                s.no_mount = Some(format!(
                    "mount -t tmpfs refused ({}): {}",
                    o.status,
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
            Err(e) => s.no_mount = Some(format!("cannot run mount: {e}")),
        }
        Ok(s)
    }

    /// Whether the disk directory is a tmpfs of its own.
    #[must_use]
    pub fn mounted(&self) -> bool {
        self.mounted
    }

    /// Unmounts the tmpfs, removes the soak's directory and ends the reaper.
    ///
    /// # Errors
    /// The tmpfs cannot be unmounted or the directory removed.
    pub fn remove(mut self) -> Result<()> {
        self.cleanup()
    }

    fn cleanup(&mut self) -> Result<()> {
        let mut result = Ok(());
        if self.mounted {
            let ok = Command::new("umount")
                .arg(&self.disk)
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                self.mounted = false;
            } else {
                result = Err(anyhow::anyhow!("cannot unmount {}", self.disk.display()));
            }
        }
        if self.root.exists()
            && let Err(e) = std::fs::remove_dir_all(&self.root)
            && result.is_ok()
        {
            result = Err(anyhow::anyhow!("cannot remove {}: {e}", self.root.display()));
        }
        if let Some((mut child, stdin)) = self.reaper.take() {
            drop(stdin);
            let _ = child.wait();
        }
        result
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = self.cleanup();
    }
}

/// Fills the filesystem holding `dir` with a file until it is full (bounded by `limit`
/// bytes); returns the file and how much it took. Removing the file frees the space.
///
/// # Errors
/// The file cannot be created.
pub fn fill(dir: &Path, limit: u64) -> Result<(PathBuf, u64)> {
    let path = dir.join("soak-fill");
    let mut f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let block = vec![0x5au8; 1 << 20];
    let mut written = 0u64;
    while written < limit {
        match f.write(&block) {
            Ok(0) | Err(_) => break,
            Ok(n) => written += n as u64,
        }
    }
    Ok((path, written))
}

/// What corrupting a slab did.
#[derive(Clone, Debug, Default)]
pub struct Corruption {
    /// Slots whose payload was overwritten.
    pub slots: u64,
    /// The keys those slots held.
    pub keys: Vec<OffloadKey>,
}

/// Overwrites 8 bytes inside the payload of up to `n` sealed slots of the slab in `dir`,
/// chosen with `seed`: never in the payload's first block, which the start-up scan checks, so
/// only a load's full checksum can tell (the strongest test of "never served").
///
/// # Errors
/// The slab cannot be opened, or a read or write fails.
pub fn corrupt_slab(
    dir: &Path,
    chunk_bytes: usize,
    capacity: u64,
    n: usize,
    seed: u64,
) -> Result<Corruption> {
    let path = dir.join(SLAB_FILE);
    let Some(layout) = SlabLayout::for_capacity(chunk_bytes, capacity) else {
        bail!("no slab layout for {chunk_bytes}-byte chunks in {capacity} bytes");
    };
    let mut out = Corruption::default();
    if chunk_bytes <= BLOCK {
        return Ok(out);
    }
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    let written = (len.saturating_sub(BLOCK as u64) / layout.slot_bytes).min(u64::from(layout.num_slots));
    if written == 0 {
        return Ok(out);
    }
    let mut rng = SimRng::new(seed);
    let mut seal = vec![0u8; BLOCK];
    for _ in 0..n * 8 {
        if out.slots as usize >= n {
            break;
        }
        let slot = u32::try_from(rng.range(0, written - 1)).unwrap_or(0);
        f.read_exact_at(&mut seal, layout.seal_offset(slot))?;
        let Some(s) = SlotSeal::decode(&seal) else {
            continue;
        };
        if out.keys.contains(&s.key) {
            continue;
        }
        let at = layout.slot_offset(slot) + rng.range(BLOCK as u64, chunk_bytes as u64 - 8);
        let mut bytes = [0u8; 8];
        f.read_exact_at(&mut bytes, at)?;
        for b in &mut bytes {
            *b ^= 0xa5;
        }
        f.write_all_at(&bytes, at)?;
        out.slots += 1;
        out.keys.push(s.key);
    }
    Ok(out)
}

/// Flips one byte in every arena row nobody holds: resident chunks then hold wrong bytes that
/// no tier checksum covers (a deliberate violation, to show the checks catch it). Returns the
/// rows changed.
#[must_use]
pub fn corrupt_arena(arena: &Arc<ChunkArena>) -> u64 {
    let mut rows = 0;
    for row in 0..arena.num_chunks() {
        let Ok(row) = u32::try_from(row) else { break };
        if let Ok(mut w) = arena.write_row(row) {
            if let Some(b) = w.get_mut(7) {
                *b ^= 0xff;
                rows += 1;
            }
        }
    }
    rows
}
