//! Creating the owner's mapping: the anonymous one, or the shared-memory file taken with an
//! exclusive `flock` (see the ownership rule in the module docs).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

use memmap2::{MmapOptions, MmapRaw};

use super::file_lock::{try_flock, try_lock_byte, unlock_byte};
use super::layout::{MAX_VIEWS, slot_lock_offset};
use super::{ArenaError, ArenaOptions};

/// The owner's side of a shared-memory arena.
pub(super) struct OwnedFile {
    pub file: File,
    pub map: MmapRaw,
    /// Whether this call created the file (and the owner therefore removes it on drop).
    pub created: bool,
}

/// Opens (or creates) `path`, takes the owner's exclusive lock on it, sizes it to `bytes` and
/// maps it shared.
pub(super) fn open_owned(path: &Path, bytes: usize, prefault: bool) -> Result<OwnedFile, ArenaError> {
    let map_err = |source| ArenaError::Map {
        bytes,
        path: Some(path.to_path_buf()),
        source,
    };
    let (file, created) = match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(file) => (file, true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(map_err)?;
            (file, false)
        }
        Err(e) => return Err(map_err(e)),
    };
    // Nothing is written before the lock is ours: a refused second owner leaves the first one's
    // file untouched (and does not remove it, even if it raced the first one to create it).
    if !try_flock(&file, libc::LOCK_EX).map_err(map_err)? {
        return Err(ArenaError::AlreadyOwned {
            path: path.to_path_buf(),
        });
    }
    if !created {
        let views = live_views(&file).map_err(map_err)?;
        if views > 0 {
            return Err(ArenaError::ViewsStillAttached {
                path: path.to_path_buf(),
                views,
            });
        }
    }
    let outcome = (|| {
        let len = u64::try_from(bytes).map_err(io::Error::other)?;
        if file.metadata()?.len() != len {
            file.set_len(len)?;
        }
        let mut opts = MmapOptions::new();
        opts.len(bytes);
        if prefault {
            opts.populate();
        }
        opts.map_raw(&file)
    })();
    match outcome {
        Ok(map) => Ok(OwnedFile { file, map, created }),
        Err(e) => {
            if created {
                // Best effort: a file we created and could not use is not left behind.
                let _ = std::fs::remove_file(path);
            }
            Err(map_err(e))
        }
    }
}

/// How many view slots of an existing file a live view holds. Reinitialising the header under
/// them would forget their grants, so the new owner refuses instead.
fn live_views(file: &File) -> io::Result<usize> {
    let mut live = 0;
    for slot in 0..MAX_VIEWS {
        let offset = slot_lock_offset(slot);
        if try_lock_byte(file, offset)? {
            unlock_byte(file, offset)?;
        } else {
            live += 1;
        }
    }
    Ok(live)
}

/// An anonymous mapping of `bytes`, on huge pages when asked for and available. Returns the
/// mapping and whether huge pages back it.
pub(super) fn map_anonymous(bytes: usize, options: &ArenaOptions) -> Result<(MmapRaw, bool), ArenaError> {
    let mut opts = MmapOptions::new();
    opts.len(bytes);
    if options.prefault {
        opts.populate();
    }
    if options.huge_pages {
        let mut huge = opts.clone();
        huge.huge(Some(21));
        if let Ok(m) = huge.map_anon() {
            return Ok((MmapRaw::from(m), true));
        }
        tracing::info!("huge pages unavailable for the chunk arena; using normal pages");
    }
    let map = opts.map_anon().map_err(|source| ArenaError::Map {
        bytes,
        path: None,
        source,
    })?;
    Ok((MmapRaw::from(map), false))
}
