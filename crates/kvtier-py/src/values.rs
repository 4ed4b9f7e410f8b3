//! The value types of the engine calls, shaped like vLLM 0.33.0's: `LookupResult`,
//! `OffloadPolicy`, `PrepareStoreOutput`, `OffloadingEvent`, `ScheduleEndContext` and
//! `ReqContext`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList};
use tiering_core::request::TransferParams;
use tiering_core::{Locality, Medium, ReqContext, RequestId, TierFilter, TierMatcher};

use crate::keys::{key_from_py, key_to_py};

/// The verdict of a lookup (vLLM's `LookupResult`).
#[pyclass(module = "kvtier", eq, eq_int, frozen, hash)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub(crate) enum LookupResult {
    /// Present and readable in the primary tier: `prepare_load` it in the same step.
    HIT,
    /// Known to exist, not readable yet (a write or a promotion is in flight).
    HIT_PENDING,
    /// Absent or unobtainable.
    MISS,
    /// Not known yet; ask again next step.
    RETRY,
}

static LOOKUP_RESULTS: PyOnceLock<[Py<PyAny>; 4]> = PyOnceLock::new();

impl LookupResult {
    /// The class attribute of a verdict (`LookupResult.HIT`, ...), so results compare with
    /// `is` and lookups return them without allocating.
    pub(crate) fn object(py: Python<'_>, r: tiering_core::LookupResult) -> PyResult<Py<PyAny>> {
        let all = LOOKUP_RESULTS.get_or_try_init(py, || -> PyResult<_> {
            let t = py.get_type::<Self>();
            Ok([
                t.getattr("HIT")?.unbind(),
                t.getattr("HIT_PENDING")?.unbind(),
                t.getattr("MISS")?.unbind(),
                t.getattr("RETRY")?.unbind(),
            ])
        })?;
        let i = match r {
            tiering_core::LookupResult::Hit => 0,
            tiering_core::LookupResult::HitPending => 1,
            tiering_core::LookupResult::Miss => 2,
            tiering_core::LookupResult::Retry => 3,
        };
        Ok(all[i].clone_ref(py))
    }
}

/// What a request wants offloaded (vLLM's `OffloadPolicy`).
#[pyclass(module = "kvtier", eq, eq_int, frozen, hash)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub(crate) enum OffloadPolicy {
    /// Only newly computed chunks are offered to `prepare_store`.
    CHUNK_LEVEL,
    /// Every chunk of the request is offered (a tier wants all of them).
    REQUEST_LEVEL,
}

impl OffloadPolicy {
    /// The class attribute of a policy, so policies compare with `is`.
    pub(crate) fn object(py: Python<'_>, p: tiering_core::OffloadPolicy) -> PyResult<Py<PyAny>> {
        let name = match p {
            tiering_core::OffloadPolicy::ChunkLevel => "CHUNK_LEVEL",
            tiering_core::OffloadPolicy::RequestLevel => "REQUEST_LEVEL",
        };
        Ok(py.get_type::<Self>().getattr(name)?.unbind())
    }
}

/// The result of `prepare_store`: the keys that really need writing, their arena rows (the
/// `store_spec` of vLLM, parallel to `keys_to_store`) and the keys evicted to make room.
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct PrepareStoreOutput {
    /// Keys to write (resident keys filtered out), in offer order.
    #[pyo3(get)]
    keys_to_store: Py<PyList>,
    /// Destination arena rows, parallel to `keys_to_store`.
    #[pyo3(get)]
    chunk_ids: Py<PyList>,
    /// Keys evicted to make room.
    #[pyo3(get)]
    evicted: Py<PyList>,
}

impl PrepareStoreOutput {
    pub(crate) fn from_core(py: Python<'_>, out: &tiering_core::PrepareStoreOutput) -> PyResult<Self> {
        Ok(Self {
            keys_to_store: keys_list(py, &out.keys_to_store)?,
            chunk_ids: PyList::new(py, &out.chunk_ids)?.unbind(),
            evicted: keys_list(py, &out.evicted)?,
        })
    }
}

#[pymethods]
impl PrepareStoreOutput {
    /// vLLM's name for `evicted`.
    #[getter]
    fn evicted_keys(&self, py: Python<'_>) -> Py<PyList> {
        self.evicted.clone_ref(py)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PrepareStoreOutput(keys_to_store={} keys, chunk_ids={}, evicted={} keys)",
            self.keys_to_store.bind(py).len(),
            self.chunk_ids
                .bind(py)
                .repr()
                .map_or_else(|_| "?".into(), |r| r.to_string()),
            self.evicted.bind(py).len()
        )
    }
}

pub(crate) fn keys_list(py: Python<'_>, keys: &[tiering_core::OffloadKey]) -> PyResult<Py<PyList>> {
    Ok(PyList::new(py, keys.iter().map(|k| key_to_py(py, k)))?.unbind())
}

/// Keys stored in, or removed from, one tier (vLLM's `OffloadingEvent`).
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct OffloadingEvent {
    /// The keys concerned.
    #[pyo3(get)]
    keys: Py<PyList>,
    /// `"CPU"`, `"STORAGE"` or `None`.
    #[pyo3(get)]
    medium: Option<&'static str>,
    /// `"LOCAL"`, `"REMOTE"` or `None`.
    #[pyo3(get)]
    locality: Option<&'static str>,
    /// `True` for a removal, `False` for a store.
    #[pyo3(get)]
    removed: bool,
    /// The emitting secondary tier's name; `None` for the primary tier.
    #[pyo3(get)]
    ownership: Option<String>,
    /// A removal of keys that never became readable (a failed store).
    #[pyo3(get)]
    metadata_only: bool,
}

impl OffloadingEvent {
    pub(crate) fn from_core(py: Python<'_>, e: &tiering_core::OffloadingEvent) -> PyResult<Self> {
        Ok(Self {
            keys: keys_list(py, &e.keys)?,
            medium: e.medium.map(|m| match m {
                Medium::Cpu => "CPU",
                Medium::Storage => "STORAGE",
            }),
            locality: e.locality.map(|l| match l {
                Locality::Local => "LOCAL",
                Locality::Remote => "REMOTE",
            }),
            removed: e.removed,
            ownership: e.ownership.clone(),
            metadata_only: e.metadata_only,
        })
    }
}

#[pymethods]
impl OffloadingEvent {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "OffloadingEvent({} {} keys, medium={:?}, ownership={:?}, metadata_only={})",
            if self.removed { "removed" } else { "stored" },
            self.keys.bind(py).len(),
            self.medium,
            self.ownership,
            self.metadata_only
        )
    }
}

/// What the engine tells the manager at the end of a scheduler step.
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct ScheduleEndContext {
    /// Requests scheduled for the first time this step.
    #[pyo3(get)]
    new_req_ids: Vec<String>,
    /// Requests preempted this step.
    #[pyo3(get)]
    preempted_req_ids: Vec<String>,
}

#[pymethods]
impl ScheduleEndContext {
    #[new]
    #[pyo3(signature = (new_req_ids = Vec::new(), preempted_req_ids = Vec::new()))]
    fn new(new_req_ids: Vec<String>, preempted_req_ids: Vec<String>) -> Self {
        Self {
            new_req_ids,
            preempted_req_ids,
        }
    }
}

impl ScheduleEndContext {
    pub(crate) fn to_core(&self) -> tiering_core::ScheduleEndContext {
        tiering_core::ScheduleEndContext {
            new_requests: self.new_req_ids.iter().map(RequestId::local).collect(),
            preempted_requests: self.preempted_req_ids.iter().map(RequestId::local).collect(),
        }
    }
}

/// One request's context, shared by every call about the request (vLLM's `ReqContext`): keep
/// one instance per request, since the eviction policies keep per-request state in it.
#[pyclass(module = "kvtier", name = "ReqContext", frozen)]
pub(crate) struct PyReqContext {
    pub(crate) inner: ReqContext,
    req_id: String,
}

#[pymethods]
impl PyReqContext {
    /// `load_tier_filter`: `None` for every tier, or a list of `{"medium": ..., "locality":
    /// ...}` maps (either key optional; an empty list means primary only).
    #[new]
    #[pyo3(signature = (req_id, kv_transfer_params = None, load_tier_filter = None))]
    fn new(
        py: Python<'_>,
        req_id: String,
        kv_transfer_params: Option<&Bound<'_, PyDict>>,
        load_tier_filter: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut builder = ReqContext::builder(RequestId::local(req_id.clone()));
        if let Some(params) = kv_transfer_params {
            let json = py.import("json")?.call_method1("dumps", (params,))?;
            let text: String = json.extract()?;
            let map: TransferParams = serde_json::from_str(&text)
                .map_err(|e| PyValueError::new_err(format!("kv_transfer_params: {e}")))?;
            builder = builder.params(map);
        }
        if let Some(filter) = load_tier_filter {
            builder = builder.filter(filter_from_py(filter)?);
        }
        Ok(Self {
            inner: builder.build(),
            req_id,
        })
    }

    /// The request id.
    #[getter]
    fn req_id(&self) -> &str {
        &self.req_id
    }

    /// Records the end-token position of `key` in the request (the LRU policy orders a
    /// request's keys by it).
    fn set_offload_key_position(&self, key: &Bound<'_, PyAny>, position: u64) -> PyResult<()> {
        self.inner.set_key_position(key_from_py(key)?, position);
        Ok(())
    }

    /// The recorded position of `key`, if any.
    fn get_offload_key_position(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        Ok(self.inner.key_position(&key_from_py(key)?))
    }

    fn __repr__(&self) -> String {
        format!("ReqContext({:?})", self.req_id)
    }
}

fn filter_from_py(ob: &Bound<'_, PyAny>) -> PyResult<TierFilter> {
    let mut matchers = Vec::new();
    for item in ob.try_iter()? {
        let item = item?;
        let d = item
            .cast::<PyDict>()
            .map_err(|_| PyValueError::new_err("load_tier_filter entries must be dicts"))?;
        let medium = match d.get_item("medium")? {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => Some(match v.extract::<String>()?.to_ascii_uppercase().as_str() {
                "CPU" => Medium::Cpu,
                "STORAGE" => Medium::Storage,
                other => return Err(PyValueError::new_err(format!("unknown medium {other:?}"))),
            }),
        };
        let locality = match d.get_item("locality")? {
            None => None,
            Some(v) if v.is_none() => None,
            Some(v) => Some(match v.extract::<String>()?.to_ascii_uppercase().as_str() {
                "LOCAL" => Locality::Local,
                "REMOTE" => Locality::Remote,
                other => return Err(PyValueError::new_err(format!("unknown locality {other:?}"))),
            }),
        };
        matchers.push(TierMatcher { medium, locality });
    }
    Ok(TierFilter::Matchers(matchers))
}

/// Returns `bytes` of a row (a copy), for the row-access helpers.
pub(crate) fn row_bytes<'py>(py: Python<'py>, row: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, row)
}
