//! Keys cross the boundary as `bytes`: vLLM's packing, the 32-byte block hash followed by the
//! group index as 4 big-endian bytes (36 bytes). A bare 32-byte hash means group 0.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use tiering_core::OffloadKey;
use tiering_core::key::{KEY_BYTES, KEY_HASH_BYTES};

/// One key from a Python object (`bytes` of 36 or 32 bytes).
pub(crate) fn key_from_py(ob: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    let Ok(bytes) = ob.cast::<PyBytes>() else {
        return Err(PyTypeError::new_err(format!(
            "a key must be bytes (32-byte hash + 4-byte big-endian group), not {}",
            ob.get_type().name()?
        )));
    };
    key_from_slice(bytes.as_bytes())
}

fn key_from_slice(b: &[u8]) -> PyResult<OffloadKey> {
    if b.len() == KEY_HASH_BYTES {
        let mut hash = [0u8; KEY_HASH_BYTES];
        hash.copy_from_slice(b);
        return Ok(OffloadKey::new(hash, 0));
    }
    // The packed form, parsed here so it inlines (one call per key into tiering-core showed
    // in profiles): the hash, then the group as 4 big-endian bytes, as `OffloadKey::to_bytes`.
    if let Some((hash, group)) = b
        .split_first_chunk::<KEY_HASH_BYTES>()
        .and_then(|(hash, rest)| Some((hash, <[u8; 4]>::try_from(rest).ok()?)))
    {
        return Ok(OffloadKey::new(*hash, u32::from_be_bytes(group)));
    }
    OffloadKey::from_bytes(b).ok_or_else(|| {
        PyValueError::new_err(format!(
            "a key must be {KEY_BYTES} bytes (hash + group) or {KEY_HASH_BYTES} bytes (hash, group 0), got {}",
            b.len()
        ))
    })
}

/// Keys from any iterable of key objects.
pub(crate) fn keys_from_py(ob: &Bound<'_, PyAny>) -> PyResult<Vec<OffloadKey>> {
    if ob.cast::<PyBytes>().is_ok() {
        return Err(PyTypeError::new_err(
            "expected a sequence of keys, got a single bytes object",
        ));
    }
    // Lists and tuples (what the connector passes) are read by index, skipping the generic
    // iterator object and its per-item protocol calls.
    if let Ok(list) = ob.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(key_from_py(&item)?);
        }
        return Ok(out);
    }
    if let Ok(tuple) = ob.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for item in tuple.iter() {
            out.push(key_from_py(&item)?);
        }
        return Ok(out);
    }
    let mut out = Vec::with_capacity(ob.len().unwrap_or(0));
    for item in ob.try_iter()? {
        out.push(key_from_py(&item?)?);
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
