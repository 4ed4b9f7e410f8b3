//! Keys cross the boundary as `bytes`: vLLM's packing, the 32-byte block hash followed by the
//! group index as 4 big-endian bytes (36 bytes). A bare 32-byte hash means group 0.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use tiering_core::OffloadKey;
use tiering_core::{KEY_BYTES, KEY_HASH_BYTES};

/// One key from a Python object (`bytes` of 36 or 32 bytes).
pub(crate) fn key_from_py(ob: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    // SAFETY: `ob` is a live object bound to the held GIL; the slice is parsed before `ob` is
    // released.
    match unsafe { bytes_contents(ob.as_ptr()) } {
        Some(b) => key_from_slice(b),
        None => Err(PyTypeError::new_err(format!(
            "a key must be bytes (32-byte hash + 4-byte big-endian group), not {}",
            ob.get_type().name()?
        ))),
    }
}

/// The contents of `ob` when it is a `bytes` object (one C call besides the type check, where
/// pyo3's `as_bytes` makes two).
///
/// # Safety
/// `ob` is a live object, the GIL is held, and the slice is not used after `ob` may be freed.
unsafe fn bytes_contents<'a>(ob: *mut ffi::PyObject) -> Option<&'a [u8]> {
    let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
    let mut size: ffi::Py_ssize_t = 0;
    // SAFETY: the caller's contract; for a `bytes` object `PyBytes_AsStringAndSize` succeeds
    // (it only fails on other types, which the check excludes, so no exception is left set)
    // and points `data` at its `size` bytes, owned by the object.
    unsafe {
        if ffi::PyBytes_Check(ob) == 0 || ffi::PyBytes_AsStringAndSize(ob, &raw mut data, &raw mut size) != 0
        {
            return None;
        }
        Some(std::slice::from_raw_parts(
            data.cast::<u8>(),
            usize::try_from(size).ok()?,
        ))
    }
}

/// Parses one key. Inlined into the loops that read batches: returned through memory from a
/// call, the key was reread with wider loads than the callee's stores, a store-forwarding stall
/// that cost more than the parse (profiled).
#[inline(always)]
fn key_from_slice(b: &[u8]) -> PyResult<OffloadKey> {
    // The packed form, parsed here (one call per key into tiering-core showed in profiles):
    // the hash, then the group as 4 big-endian bytes, as `OffloadKey::to_bytes`.
    if let Some((hash, rest)) = b.split_first_chunk::<KEY_HASH_BYTES>() {
        if let Ok(group) = <[u8; 4]>::try_from(rest) {
            return Ok(OffloadKey::new(*hash, u32::from_be_bytes(group)));
        }
        if rest.is_empty() {
            return Ok(OffloadKey::new(*hash, 0));
        }
    }
    Err(bad_key_length(b))
}

#[cold]
fn bad_key_length(b: &[u8]) -> PyErr {
    // vLLM's xxhash prefix-caching hashes are 16 bytes (keys of 20 with the group).
    let hint = if matches!(b.len(), 16 | 20) {
        "; a 16-byte block hash is vLLM's xxhash: run vLLM with --prefix-caching-hash-algo sha256 or sha256_cbor"
    } else {
        ""
    };
    PyValueError::new_err(format!(
        "a key must be {KEY_BYTES} bytes (hash + group) or {KEY_HASH_BYTES} bytes (hash, group 0), got {}{hint}",
        b.len()
    ))
}

/// Keys from any iterable of key objects.
pub(crate) fn keys_from_py(ob: &Bound<'_, PyAny>) -> PyResult<Vec<OffloadKey>> {
    if ob.cast::<PyBytes>().is_ok() {
        return Err(PyTypeError::new_err(
            "expected a sequence of keys, got a single bytes object",
        ));
    }
    // Lists and tuples (what the connector passes) are read by index through the C API: the
    // generic iterator, and pyo3's checked item access with its reference counting, cost more
    // per key than the key's parsing (profiled: ~110 instructions per item).
    if let Ok(list) = ob.cast::<PyList>() {
        return read_keys(list.as_any(), list.len(), ffi::PyList_GetItem);
    }
    if let Ok(tuple) = ob.cast::<PyTuple>() {
        return read_keys(tuple.as_any(), tuple.len(), ffi::PyTuple_GetItem);
    }
    let mut out = Vec::with_capacity(ob.len().unwrap_or(0));
    for item in ob.try_iter()? {
        out.push(key_from_py(&item?)?);
    }
    Ok(out)
}

/// The keys of a list or tuple of `len` items, read with `get_item` (`PyList_GetItem` or
/// `PyTuple_GetItem`: a borrowed reference).
fn read_keys(
    seq: &Bound<'_, PyAny>,
    len: usize,
    get_item: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
) -> PyResult<Vec<OffloadKey>> {
    let mut out = Vec::with_capacity(len);
    for (i, index) in (0..len).zip(0 as ffi::Py_ssize_t..) {
        // SAFETY: the GIL is held (`seq` is bound to it) and no Python code runs in this loop,
        // so `seq` (a list or tuple, checked by the caller) cannot change: `index < len` names an
        // item, and the borrowed reference stays valid while `seq` holds it; the key is parsed
        // from the item's bytes before the next iteration.
        let parsed = unsafe {
            let item = get_item(seq.as_ptr(), index);
            if item.is_null() {
                return Err(PyErr::fetch(seq.py()));
            }
            bytes_contents(item).map(key_from_slice)
        };
        match parsed {
            Some(key) => out.push(key?),
            // Not bytes: the checked path builds the error message.
            None => {
                let item = seq.get_item(i)?;
                out.push(key_from_py(&item)?);
            }
        }
    }
    Ok(out)
}

/// A key as Python `bytes` (36 bytes).
pub(crate) fn key_to_py<'py>(py: Python<'py>, key: &OffloadKey) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &key.to_bytes())
}

/// Packs `block_hash` (32 bytes) and `group_idx` into a key, as vLLM's `make_offload_key` does.
#[pyfunction]
#[pyo3(signature = (block_hash, group_idx = 0))]
pub(crate) fn make_offload_key<'py>(
    py: Python<'py>,
    block_hash: &[u8],
    group_idx: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let Ok(hash) = <[u8; KEY_HASH_BYTES]>::try_from(block_hash) else {
        return Err(PyValueError::new_err(format!(
            "block_hash must be {KEY_HASH_BYTES} bytes, got {}",
            block_hash.len()
        )));
    };
    Ok(key_to_py(py, &OffloadKey::new(hash, group_idx)))
}

/// Splits a key into `(block_hash, group_idx)`.
#[pyfunction]
pub(crate) fn split_offload_key<'py>(
    py: Python<'py>,
    key: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, u32)> {
    let k = key_from_py(key)?;
    Ok((PyBytes::new(py, k.hash_bytes()), k.group()))
}
