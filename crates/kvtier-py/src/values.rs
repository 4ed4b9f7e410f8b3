//! The value types of the engine calls, shaped like vLLM 0.33.0's: `LookupResult`,
//! `OffloadPolicy`, `PrepareStoreOutput`, `OffloadingEvent`, `ScheduleEndContext` and
//! `ReqContext`; and `LoadSource`, the answer to vLLM's `get_load_source`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use tiering_core::TransferParams;
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
static OFFLOAD_POLICIES: PyOnceLock<[Py<PyAny>; 2]> = PyOnceLock::new();

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
    /// The class attribute of a policy, so policies compare with `is` (looked up once, not
    /// per call).
    pub(crate) fn object(py: Python<'_>, p: tiering_core::OffloadPolicy) -> PyResult<Py<PyAny>> {
        let all = OFFLOAD_POLICIES.get_or_try_init(py, || -> PyResult<_> {
            let t = py.get_type::<Self>();
            Ok([
                t.getattr("CHUNK_LEVEL")?.unbind(),
                t.getattr("REQUEST_LEVEL")?.unbind(),
            ])
        })?;
        let i = match p {
            tiering_core::OffloadPolicy::ChunkLevel => 0,
            tiering_core::OffloadPolicy::RequestLevel => 1,
        };
        Ok(all[i].clone_ref(py))
    }
}

/// A list of keys built on first access: results carry the keys as Rust values, and the
/// `bytes` objects (one allocation each) are only made when Python reads them.
pub(crate) struct LazyKeys {
    keys: Vec<tiering_core::OffloadKey>,
    list: PyOnceLock<Py<PyList>>,
}

impl LazyKeys {
    pub(crate) fn new(keys: Vec<tiering_core::OffloadKey>) -> Self {
        Self {
            keys,
            list: PyOnceLock::new(),
        }
    }

    /// A list made already (for example of the caller's own key objects).
    pub(crate) fn ready(py: Python<'_>, keys: Vec<tiering_core::OffloadKey>, list: Py<PyList>) -> Self {
        let lazy = Self::new(keys);
        // A fresh cell takes the value; the result only says whether it was empty.
        let _ = lazy.list.set(py, list);
        lazy
    }

    /// The list (the same object on every access).
    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.list
            .get_or_try_init(py, || keys_list(py, &self.keys))
            .map(|l| l.clone_ref(py))
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }
}

/// The result of `prepare_store`: the keys that really need writing, their arena rows (the
/// `store_spec` of vLLM, parallel to `keys_to_store`) and the keys evicted to make room.
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct PrepareStoreOutput {
    keys_to_store: LazyKeys,
    /// Destination arena rows, parallel to `keys_to_store`.
    #[pyo3(get)]
    chunk_ids: Py<PyList>,
    evicted: LazyKeys,
}

impl PrepareStoreOutput {
    /// `offered`: the keys passed to `prepare_store` (parsed, and the Python sequence when it
    /// is a list or a tuple). `keys_to_store` is made of the caller's own key objects, as
    /// vLLM's manager returns them, instead of new `bytes`.
    pub(crate) fn from_core(
        py: Python<'_>,
        out: tiering_core::PrepareStoreOutput,
        offered: &[tiering_core::OffloadKey],
        offered_objects: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let keys_to_store = match same_objects(py, &out.keys_to_store, offered, offered_objects)? {
            Some(list) => LazyKeys::ready(py, out.keys_to_store, list),
            None => LazyKeys::new(out.keys_to_store),
        };
        Ok(Self {
            keys_to_store,
            chunk_ids: PyList::new(py, &out.chunk_ids)?.unbind(),
            evicted: LazyKeys::new(out.evicted),
        })
    }
}

/// A list of the objects of `offered_objects` (a list or tuple parallel to `offered`) whose
/// keys are `wanted`, which must appear in `offered` in the same order; `None` when the
/// sequence is of another kind or a key is not found in order.
fn same_objects(
    py: Python<'_>,
    wanted: &[tiering_core::OffloadKey],
    offered: &[tiering_core::OffloadKey],
    offered_objects: &Bound<'_, PyAny>,
) -> PyResult<Option<Py<PyList>>> {
    let item = |j: usize| -> PyResult<Option<Bound<'_, PyAny>>> {
        if let Ok(list) = offered_objects.cast::<PyList>() {
            // The list is read again here: if it no longer matches the parsed keys, make new
            // objects rather than hand back the wrong ones.
            if list.len() != offered.len() {
                return Ok(None);
            }
            return list.get_item(j).map(Some);
        }
        if let Ok(tuple) = offered_objects.cast::<PyTuple>() {
            return tuple.get_item(j).map(Some);
        }
        Ok(None)
    };
    // Every offered key is to be stored (a subsequence as long as the sequence is all of it):
    // one C-level copy of the caller's sequence instead of an item call per key.
    if wanted.len() == offered.len() {
        if let Ok(list) = offered_objects.cast::<PyList>()
            && list.len() == offered.len()
        {
            return Ok(Some(list.get_slice(0, list.len()).unbind()));
        }
        if let Ok(tuple) = offered_objects.cast::<PyTuple>() {
            return Ok(Some(PyList::new(py, tuple.iter())?.unbind()));
        }
    }
    let mut objects = Vec::with_capacity(wanted.len());
    let mut j = 0;
    for key in wanted {
        while j < offered.len() && offered[j] != *key {
            j += 1;
        }
        if j == offered.len() {
            return Ok(None);
        }
        let Some(ob) = item(j)? else {
            return Ok(None);
        };
        objects.push(ob);
        j += 1;
    }
    Ok(Some(PyList::new(py, objects)?.unbind()))
}

#[pymethods]
impl PrepareStoreOutput {
    /// Keys to write (resident keys filtered out), in offer order.
    #[getter]
    fn keys_to_store(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.keys_to_store.get(py)
    }

    /// Keys evicted to make room.
    #[getter]
    fn evicted(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.evicted.get(py)
    }

    /// vLLM's name for `evicted`.
    #[getter]
    fn evicted_keys(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.evicted.get(py)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PrepareStoreOutput(keys_to_store={} keys, chunk_ids={}, evicted={} keys)",
            self.keys_to_store.len(),
            self.chunk_ids
                .bind(py)
                .repr()
                .map_or_else(|_| "?".into(), |r| r.to_string()),
            self.evicted.len()
        )
    }
}

pub(crate) fn keys_list(py: Python<'_>, keys: &[tiering_core::OffloadKey]) -> PyResult<Py<PyList>> {
    Ok(PyList::new(py, keys.iter().map(|k| key_to_py(py, k)))?.unbind())
}

/// Keys stored in, or removed from, one tier (vLLM's `OffloadingEvent`).
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct OffloadingEvent {
    keys: LazyKeys,
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
    /// A store whose removal the tier will report too (it evicts on its own).
    #[pyo3(get)]
    removal_expected: bool,
}

/// A medium as vLLM's `Medium` names it.
pub(crate) fn medium_name(m: Medium) -> &'static str {
    match m {
        Medium::Cpu => "CPU",
        Medium::Storage => "STORAGE",
    }
}

/// A locality as vLLM's `Locality` names it.
pub(crate) fn locality_name(l: Locality) -> &'static str {
    match l {
        Locality::Local => "LOCAL",
        Locality::Remote => "REMOTE",
    }
}

impl OffloadingEvent {
    pub(crate) fn from_core(e: tiering_core::OffloadingEvent) -> Self {
        Self {
            keys: LazyKeys::new(e.keys),
            medium: e.medium.map(medium_name),
            locality: e.locality.map(locality_name),
            removed: e.removed,
            ownership: e.ownership,
            metadata_only: e.metadata_only,
            removal_expected: e.removal_expected,
        }
    }
}

#[pymethods]
impl OffloadingEvent {
    /// The keys concerned.
    #[getter]
    fn keys(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.keys.get(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "OffloadingEvent({} {} keys, medium={:?}, ownership={:?}, metadata_only={})",
            if self.removed { "removed" } else { "stored" },
            self.keys.len(),
            self.medium,
            self.ownership,
            self.metadata_only
        )
    }
}

/// Where a chunk a request loads came from (`Step.load_source`): the secondary tier whose
/// promotion brought it into the primary for the request, else the primary tier.
#[pyclass(module = "kvtier", frozen)]
pub(crate) struct LoadSource {
    /// The tier's name (as in `stats()`).
    #[pyo3(get)]
    tier: String,
    /// The tier's `type` in the chain file (`"cpu"`, `"disk"`, `"p2p"`, `"redis"`, a plugin's).
    #[pyo3(get)]
    tier_type: String,
    /// The secondary tier's index in chain order; `None` for the primary tier.
    #[pyo3(get)]
    secondary: Option<usize>,
    /// `"CPU"`, `"STORAGE"` or `None`.
    #[pyo3(get)]
    medium: Option<&'static str>,
    /// `"LOCAL"`, `"REMOTE"` or `None`.
    #[pyo3(get)]
    locality: Option<&'static str>,
}

impl LoadSource {
    /// `tier_type`: the chain file's `type` of that tier.
    pub(crate) fn from_core(source: tiering_core::LoadSource, tier_type: String) -> Self {
        Self {
            tier: source.info.name,
            tier_type,
            secondary: source.secondary,
            medium: source.info.medium.map(medium_name),
            locality: source.info.locality.map(locality_name),
        }
    }
}

#[pymethods]
impl LoadSource {
    fn __repr__(&self) -> String {
        format!(
            "LoadSource(tier={:?}, tier_type={:?}, secondary={:?}, medium={:?}, locality={:?})",
            self.tier, self.tier_type, self.secondary, self.medium, self.locality
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
        let mut builder = ReqContext::builder(RequestId::local(req_id));
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
        })
    }

    /// The request id.
    #[getter]
    fn req_id(&self) -> String {
        // A context made here is always local; the id string is kept once, in the context.
        self.inner.id().to_string()
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
        format!("ReqContext({:?})", self.inner.id().to_string())
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

/// Events as a Python list.
pub(crate) fn events_list(
    py: Python<'_>,
    events: Vec<tiering_core::OffloadingEvent>,
) -> PyResult<Bound<'_, PyList>> {
    let items = events
        .into_iter()
        .map(|e| Bound::new(py, OffloadingEvent::from_core(e)))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// Stats as plain Python dicts and lists.
pub(crate) fn stats_to_py<'py>(
    py: Python<'py>,
    stats: &tiering_core::ManagerStats,
) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::json!({
        "manager": stats.manager,
        "primary": stats.primary,
        "secondaries": stats.secondaries,
        "jobs_in_flight": stats.jobs_in_flight,
        "gates": stats.gates,
        "decisions": stats.decisions,
    });
    py.import("json")?.call_method1("loads", (value.to_string(),))
}
