//! The slab file: opening (lock, format check, resize, pre-allocation, the `O_DIRECT` probe) and
//! positioned vectored I/O on it.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::buf::AlignedBuf;
use crate::error::DiskError;
#[cfg(feature = "test-utils")]
use crate::faults::FaultInjector;
use crate::format::{BLOCK, FORMAT_VERSION, SlabLayout, Superblock, SuperblockRead};
use crate::options::{DirectIo, DiskTierOptions};

/// The slab file's name inside the configured directory.
pub const SLAB_FILE: &str = "kvtier-disk.slab";

/// Most iovecs one `preadv`/`pwritev` takes (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// The slab file is reserved (`fallocate`) in steps of this size as slots are first used, so a
/// large, mostly empty tier does not hold its whole capacity on disk.
pub const GROW_STEP: u64 = 64 << 20;

/// An open, locked, correctly sized slab file.
pub(crate) struct Slab {
    /// The file descriptor all slot I/O goes through (`O_DIRECT` when enabled).
    io: File,
    /// The descriptor holding the `flock`; kept open for the slab's lifetime.
    _lock: File,
    path: PathBuf,
    layout: SlabLayout,
    direct: bool,
    growth: Mutex<Growth>,
    /// `growth.end`, readable without the lock.
    reserved_end: AtomicU64,
    #[cfg(feature = "test-utils")]
    faults: Option<FaultInjector>,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DiskError + 'a {
    move |source| DiskError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn offset(off: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(off).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))
}

fn lock_exclusive(file: &File, path: &Path) -> Result<(), DiskError> {
    // SAFETY: `flock` only reads the descriptor number, which `file` keeps open for the call.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Err(DiskError::Locked {
            path: path.to_owned(),
        })
    } else {
        Err(DiskError::Io {
            what: "locking",
            path: path.to_owned(),
            source: err,
        })
    }
}

/// `fallocate` `len` bytes from `off` (extending the file). `Ok(false)` when the filesystem
/// cannot pre-allocate.
fn preallocate(file: &File, off: u64, len: u64) -> io::Result<bool> {
    let (off, len) = (offset(off)?, offset(len)?);
    loop {
        // SAFETY: plain syscall on a descriptor `file` keeps open; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, off, len) };
        if rc == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EOPNOTSUPP | libc::ENOSYS) => return Ok(false),
            _ => return Err(err),
        }
    }
}

/// Bytes an unprivileged writer may still allocate on `file`'s filesystem.
fn available_bytes(file: &File) -> io::Result<u64> {
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `fstatvfs` writes one `statvfs` into the pointer, which points to zeroed memory
    // of exactly that type and lives for the call.
    let rc = unsafe { libc::fstatvfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the call succeeded, so the kernel filled the struct (it was zeroed before anyway).
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// What opening created, removed again when opening fails.
struct Created {
    file: Option<PathBuf>,
    /// Directories created, deepest first.
    dirs: Vec<PathBuf>,
}

impl Created {
    fn remove(self) {
        if let Some(f) = &self.file
            && let Err(e) = std::fs::remove_file(f)
        {
            tracing::warn!(path = %f.display(), error = %e, "cannot remove the slab file of a failed open");
        }
        for d in &self.dirs {
            // Only empty directories go; anything else put there meanwhile stays.
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// The directories on the way to `dir` (itself included) that do not exist yet, deepest first.
fn missing_dirs(dir: &Path) -> Vec<PathBuf> {
    dir.ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .map(Path::to_path_buf)
        .collect()
}

/// How far the file is reserved, and how to grow it.
struct Growth {
    /// File length up to which space is allocated (or, when pre-allocation is off or not
    /// supported, `u64::MAX`: writes extend the file themselves).
    end: u64,
}

/// Writes every byte of `bufs` at `off`, retrying short writes.
fn pwritev_all(file: &File, mut bufs: &mut [IoSlice<'_>], mut off: u64) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let count = bufs.len().min(IOV_MAX);
        // SAFETY: `IoSlice` is guaranteed ABI-compatible with `struct iovec` on Unix; the
        // pointer and count describe `count` live, borrowed slices for the duration of the call,
        // and the kernel only reads them.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                bufs.as_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                offset(off)?,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let n = n.unsigned_abs();
        IoSlice::advance_slices(&mut bufs, n);
        off += n as u64;
    }
    Ok(())
}

/// Reads into `bufs` from `off` until they are full or the file ends; returns the bytes read.
fn preadv_all(file: &File, mut bufs: &mut [IoSliceMut<'_>], mut off: u64) -> io::Result<usize> {
    let mut total = 0;
    IoSliceMut::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let count = bufs.len().min(IOV_MAX);
        // SAFETY: `IoSliceMut` is guaranteed ABI-compatible with `struct iovec` on Unix; the
        // slices are exclusively borrowed for the call, so the kernel may write them.
        let n = unsafe {
            libc::preadv(
                file.as_raw_fd(),
                bufs.as_mut_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                offset(off)?,
            )
        };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if n == 0 {
            break;
        }
        let n = n.unsigned_abs();
        total += n;
        IoSliceMut::advance_slices(&mut bufs, n);
        off += n as u64;
    }
    Ok(total)
}

/// What opening found on disk.
pub(crate) struct Opened {
    pub(crate) slab: Slab,
    /// Whether an existing slab of another geometry was wiped.
    pub(crate) wiped: bool,
    /// Slots that may hold data from before: those inside the file as it was found (none for a
    /// new or wiped file; slots added by growing it are zero).
    pub(crate) slots_to_scan: u32,
}

impl Slab {
    /// Opens (creating or adopting) the slab under `opts.path` for `chunk_bytes`-byte chunks.
    pub(crate) fn open(
        opts: &DiskTierOptions,
        chunk_bytes: usize,
        #[cfg(feature = "test-utils")] faults: Option<FaultInjector>,
    ) -> Result<Opened, DiskError> {
        let layout = SlabLayout::for_capacity(chunk_bytes, opts.capacity.bytes()).ok_or_else(|| {
            DiskError::InvalidOptions(format!(
                "capacity {} cannot hold one slot of a {chunk_bytes}-byte chunk (plus {} bytes of superblock and seal)",
                opts.capacity,
                2 * BLOCK
            ))
        })?;
        let created_dirs = missing_dirs(&opts.path);
        std::fs::create_dir_all(&opts.path).map_err(io_err("creating directory", &opts.path))?;
        let path = opts.path.join(SLAB_FILE);
        let (lock, created_file) = match Self::create_new(&path) {
            Ok(file) => (file, true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(io_err("opening", &path))?;
                (file, false)
            }
            Err(e) => {
                Created {
                    file: None,
                    dirs: created_dirs,
                }
                .remove();
                return Err(io_err("opening", &path)(e));
            }
        };
        let created = Created {
            file: created_file.then(|| path.clone()),
            dirs: created_dirs,
        };
        match Self::finish_open(
            opts,
            chunk_bytes,
            layout,
            lock,
            path,
            #[cfg(feature = "test-utils")]
            faults,
        ) {
            Ok(opened) => Ok(opened),
            Err(e) => {
                created.remove();
                Err(e)
            }
        }
    }

    fn create_new(path: &Path) -> io::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(path)
    }

    fn finish_open(
        opts: &DiskTierOptions,
        chunk_bytes: usize,
        layout: SlabLayout,
        lock: File,
        path: PathBuf,
        #[cfg(feature = "test-utils")] faults: Option<FaultInjector>,
    ) -> Result<Opened, DiskError> {
        lock_exclusive(&lock, &path)?;

        let wiped = Self::check_format(&lock, &path, &layout, opts.wipe_on_mismatch)?;
        let len = layout.file_len();
        let meta = lock.metadata().map_err(io_err("inspecting", &path))?;
        let current = meta.len();
        let slots_to_scan = u32::try_from(current.saturating_sub(BLOCK as u64).div_ceil(layout.slot_bytes))
            .unwrap_or(u32::MAX)
            .min(layout.num_slots);
        if current > len {
            // Shrinking drops the slots past the new end. The file is never grown here: it
            // grows as slots are first written (slots past its end read as empty).
            lock.set_len(len).map_err(io_err("resizing", &path))?;
        }
        let growth_end = if opts.preallocate {
            // Check the whole capacity fits now, so a too-small filesystem is a clear error at
            // open, but reserve it step by step as slots are used.
            use std::os::unix::fs::MetadataExt;
            let allocated = meta.blocks().saturating_mul(512);
            let needed = len.saturating_sub(allocated);
            let available = available_bytes(&lock).map_err(io_err("inspecting the filesystem of", &path))?;
            if needed > available {
                return Err(DiskError::NoSpace {
                    path,
                    bytes: len,
                    source: io::Error::from_raw_os_error(libc::ENOSPC),
                });
            }
            current.min(len).max(BLOCK as u64)
        } else {
            u64::MAX
        };

        let (io, direct) = Self::open_io(opts.direct_io, chunk_bytes, &lock, &path, &layout)?;
        let slab = Self {
            io,
            _lock: lock,
            path,
            layout,
            direct,
            growth: Mutex::new(Growth { end: growth_end }),
            reserved_end: AtomicU64::new(growth_end),
            #[cfg(feature = "test-utils")]
            faults,
        };
        Ok(Opened {
            slab,
            wiped,
            slots_to_scan,
        })
    }

    /// Makes sure the file is reserved up to `end`: grows the reservation by [`GROW_STEP`]s
    /// (never past the slab's full length). A reservation that fails is undone (the file is
    /// cut back to what was reserved before), so a full filesystem is not left fuller.
    fn reserve_through(&self, end: u64) -> io::Result<()> {
        if end <= self.reserved_end.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut g = self.growth.lock();
        if end <= g.end {
            return Ok(());
        }
        let full = self.layout.file_len();
        let target = end.next_multiple_of(GROW_STEP).min(full).max(end);
        match preallocate(&self.io, g.end, target - g.end) {
            Ok(true) => g.end = target,
            Ok(false) => {
                tracing::info!(path = %self.path.display(), "filesystem cannot pre-allocate; the slab grows as it is written");
                g.end = u64::MAX;
            }
            Err(e) => {
                if let Err(cut) = self.io.set_len(g.end) {
                    tracing::warn!(path = %self.path.display(), error = %cut, "cannot undo a failed reservation");
                }
                return Err(e);
            }
        }
        self.reserved_end.store(g.end, Ordering::Release);
        Ok(())
    }

    /// Validates the superblock; returns whether the file was wiped.
    fn check_format(file: &File, path: &Path, layout: &SlabLayout, wipe: bool) -> Result<bool, DiskError> {
        let mut block = vec![0u8; BLOCK];
        let n = file.read_at(&mut block, 0).map_err(io_err("reading", path))?;
        let verdict = if n == 0 {
            SuperblockRead::Blank
        } else if n < BLOCK {
            SuperblockRead::Foreign(format!("only {n} bytes long"))
        } else {
            Superblock::decode(&block)
        };
        let want = Superblock::for_layout(layout);
        let problem = match verdict {
            SuperblockRead::Blank => None,
            SuperblockRead::Valid(found) => {
                let same = found.format_version == FORMAT_VERSION
                    && found.block == want.block
                    && found.chunk_bytes == want.chunk_bytes
                    && found.slot_bytes == want.slot_bytes;
                (!same).then(|| DiskError::Mismatch {
                    path: path.to_owned(),
                    found: found.to_string(),
                    expected: want.to_string(),
                })
            }
            SuperblockRead::Foreign(reason) => Some(DiskError::NotASlab {
                path: path.to_owned(),
                reason,
            }),
        };
        match problem {
            None => Ok(false),
            Some(e) if wipe => {
                tracing::warn!(path = %path.display(), reason = %e, "wiping the disk tier's slab (wipe_on_mismatch)");
                file.set_len(0).map_err(io_err("wiping", path))?;
                Ok(true)
            }
            Some(e) => Err(e),
        }
    }

    /// Picks the descriptor for slot I/O and writes the superblock through it, which doubles as
    /// the `O_DIRECT` probe.
    fn open_io(
        mode: DirectIo,
        chunk_bytes: usize,
        lock: &File,
        path: &Path,
        layout: &SlabLayout,
    ) -> Result<(File, bool), DiskError> {
        let mut sb = AlignedBuf::zeroed(BLOCK).map_err(io_err("allocating a buffer for", path))?;
        Superblock::for_layout(layout).encode(&mut sb);
        let buffered = || -> Result<(File, bool), DiskError> {
            lock.write_all_at(&sb, 0)
                .map_err(io_err("writing the superblock of", path))?;
            lock.sync_data().map_err(io_err("syncing", path))?;
            let io = lock
                .try_clone()
                .map_err(io_err("duplicating the descriptor of", path))?;
            Ok((io, false))
        };
        let why_not = match mode {
            DirectIo::Off => return buffered(),
            _ if chunk_bytes % BLOCK != 0 => {
                format!("the chunk size {chunk_bytes} is not a multiple of {BLOCK}")
            }
            _ => match Self::probe_direct(path, &sb) {
                Ok(file) => {
                    lock.sync_data().map_err(io_err("syncing", path))?;
                    tracing::debug!(path = %path.display(), "disk tier uses O_DIRECT");
                    return Ok((file, true));
                }
                Err(e) => format!("the filesystem refused it ({e})"),
            },
        };
        if mode == DirectIo::On {
            return Err(DiskError::DirectIoUnavailable(why_not));
        }
        tracing::info!(path = %path.display(), reason = %why_not, "O_DIRECT unavailable; the disk tier uses buffered I/O");
        buffered()
    }

    fn probe_direct(path: &Path, superblock: &[u8]) -> io::Result<File> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        file.write_all_at(superblock, 0)?;
        let mut back = AlignedBuf::zeroed(BLOCK)?;
        file.read_exact_at(&mut back, 0)?;
        if &back[..] != superblock {
            return Err(io::Error::other("O_DIRECT read-back differs"));
        }
        Ok(file)
    }

    /// The slab's layout.
    pub(crate) fn layout(&self) -> &SlabLayout {
        &self.layout
    }

    /// The slab file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether slot I/O bypasses the page cache.
    pub(crate) fn direct(&self) -> bool {
        self.direct
    }

    /// Writes `slots` whole consecutive slots from `first` (payload, padding and seal block
    /// each) in one vectored write.
    pub(crate) fn write_run(&self, first: u32, slots: usize, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        #[cfg(feature = "test-utils")]
        if let Some(f) = &self.faults {
            f.before_write(bufs.iter().map(|b| b.len() as u64).sum())?;
        }
        let off = self.layout.slot_offset(first);
        self.reserve_through(off + slots as u64 * self.layout.slot_bytes)?;
        pwritev_all(&self.io, bufs, off)
    }

    /// Reads whole consecutive slots from `first` in one vectored read; returns the bytes read
    /// (less than asked at end of file).
    pub(crate) fn read_run(&self, first: u32, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        #[cfg(feature = "test-utils")]
        if let Some(f) = &self.faults {
            f.before_read()?;
        }
        preadv_all(&self.io, bufs, self.layout.slot_offset(first))
    }

    /// Reads one aligned block at `off` (start-up scan); returns the bytes read.
    pub(crate) fn read_block(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        preadv_all(&self.io, &mut [IoSliceMut::new(buf)], off)
    }

    /// Overwrites slot `slot`'s seal block with `zero_block`, so the slot never reappears.
    pub(crate) fn invalidate(&self, slot: u32, zero_block: &[u8]) -> io::Result<()> {
        pwritev_all(
            &self.io,
            &mut [IoSlice::new(zero_block)],
            self.layout.seal_offset(slot),
        )
    }

    /// `fdatasync`.
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.io.sync_data()
    }

    /// The fault injector, when one is installed.
    #[cfg(feature = "test-utils")]
    pub(crate) fn faults(&self) -> Option<&FaultInjector> {
        self.faults.as_ref()
    }
}
