//! The advisory locks an arena file's owner and its views coordinate with: a whole-file
//! `flock` (the owner holds it exclusively, a view probes it to tell whether an owner is alive)
//! and open-file-description locks on single bytes (one per view slot, held by the view that
//! occupies the slot, so the owner can tell a live view from a dead one).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `flock(file, op | LOCK_NB)`: `Ok(true)` when taken, `Ok(false)` when another open file holds
/// a conflicting lock.
pub(super) fn try_flock(file: &File, op: libc::c_int) -> io::Result<bool> {
    // SAFETY: flock only reads the descriptor number, which `file` keeps open for the call.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let error = io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(error)
    }
}

/// Releases a lock taken with [`try_flock`].
pub(super) fn unflock(file: &File) -> io::Result<()> {
    // SAFETY: as in `try_flock`.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Takes an open-file-description write lock on one byte of `file` without waiting:
/// `Ok(false)` when another open file description holds it. OFD locks belong to the open file,
/// not the process, so they conflict between two opens in one process too, and the kernel drops
/// them when the file's last descriptor closes (including on process death).
pub(super) fn try_lock_byte(file: &File, offset: u64) -> io::Result<bool> {
    let rc = ofd_setlk(file, offset, libc::F_WRLCK)?;
    if rc == 0 {
        return Ok(true);
    }
    let error = io::Error::last_os_error();
    match error.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Ok(false),
        _ => Err(error),
    }
}

/// Releases a byte lock taken by [`try_lock_byte`].
pub(super) fn unlock_byte(file: &File, offset: u64) -> io::Result<()> {
    if ofd_setlk(file, offset, libc::F_UNLCK)? == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn ofd_setlk(file: &File, offset: u64, kind: libc::c_int) -> io::Result<libc::c_int> {
    // SAFETY: `flock` is a plain C struct for which all-zero bytes are a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::c_short::try_from(kind).map_err(io::Error::other)?;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = libc::off_t::try_from(offset).map_err(io::Error::other)?;
    lock.l_len = 1;
    // SAFETY: `lock` is a valid, initialised `flock` that outlives the call (F_OFD_SETLK only
    // reads it), and `file` keeps the descriptor open.
    Ok(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &raw const lock) })
}
