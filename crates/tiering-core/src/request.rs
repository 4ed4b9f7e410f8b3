//! Per-request context shared by the engine, the manager and every tier, and the tier filter that
//! limits which secondary tiers a request may promote from.

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::key::{KeyMap, OffloadKey};

/// The storage medium a tier advertises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Medium {
    /// Host memory.
    Cpu,
    /// Persistent storage (disk, object store).
    Storage,
}

/// Whether a tier's storage is local to this instance or remote.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Locality {
    /// On this node.
    Local,
    /// On another node (a peer, a remote store).
    Remote,
}

/// How a tier describes itself to the manager and to filters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierInfo {
    /// Human-readable tier name, unique within a chain (used in stats, events and logs).
    pub name: String,
    /// The medium; `None` matches every medium constraint.
    pub medium: Option<Medium>,
    /// The locality; `None` matches every locality constraint.
    pub locality: Option<Locality>,
}

impl TierInfo {
    /// A tier description.
    #[must_use]
    pub fn new(name: impl Into<String>, medium: Option<Medium>, locality: Option<Locality>) -> Self {
        Self {
            name: name.into(),
            medium,
            locality,
        }
    }
}

/// One (medium, locality) constraint. A field matches when the matcher leaves it open, when the
/// tier leaves it open, or when both name the same value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierMatcher {
    /// Required medium, or any.
    pub medium: Option<Medium>,
    /// Required locality, or any.
    pub locality: Option<Locality>,
}

impl TierMatcher {
    /// Whether a tier with this medium and locality satisfies the matcher.
    #[must_use]
    pub fn matches(&self, medium: Option<Medium>, locality: Option<Locality>) -> bool {
        fn field<T: PartialEq>(want: Option<T>, have: Option<T>) -> bool {
            match (want, have) {
                (Some(w), Some(h)) => w == h,
                _ => true,
            }
        }
        field(self.medium, medium) && field(self.locality, locality)
    }
}

/// Which secondary tiers a lookup may promote from. The primary tier is always consulted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TierFilter {
    /// Every secondary tier.
    #[default]
    All,
    /// Tiers matching any of the matchers; an empty list means "primary only".
    Matchers(Vec<TierMatcher>),
}

impl TierFilter {
    /// The filter that allows no secondary tier.
    #[must_use]
    pub fn primary_only() -> Self {
        Self::Matchers(Vec::new())
    }

    /// Whether a tier with this medium and locality may be promoted from.
    #[must_use]
    pub fn allows(&self, medium: Option<Medium>, locality: Option<Locality>) -> bool {
        match self {
            Self::All => true,
            Self::Matchers(ms) => ms.iter().any(|m| m.matches(medium, locality)),
        }
    }

    /// Whether the tier described by `info` may be promoted from.
    #[must_use]
    pub fn allows_tier(&self, info: &TierInfo) -> bool {
        self.allows(info.medium, info.locality)
    }
}

/// A request id. Local (engine) and remote (peer-originated) requests live in disjoint
/// namespaces, so a peer can never overwrite the state of a local request with the same name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RequestId {
    /// A request of this engine.
    Local(String),
    /// A request made by a peer, namespaced by the peer's identity.
    Remote {
        /// The peer (for example `host:port`).
        peer: String,
        /// The peer's own request id.
        id: String,
    },
}

impl RequestId {
    /// A local request id.
    #[must_use]
    pub fn local(id: impl Into<String>) -> Self {
        Self::Local(id.into())
    }

    /// A remote request id namespaced by `peer`.
    #[must_use]
    pub fn remote(peer: impl Into<String>, id: impl Into<String>) -> Self {
        Self::Remote {
            peer: peer.into(),
            id: id.into(),
        }
    }

    /// Whether the id belongs to a peer-originated request.
    #[must_use]
    pub fn is_remote(&self) -> bool {
        matches!(self, Self::Remote { .. })
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(id) => f.write_str(id),
            Self::Remote { peer, id } => write!(f, "{peer}/{id}"),
        }
    }
}

/// The per-request transfer parameters taken from the user request (a JSON object).
pub type TransferParams = serde_json::Map<String, serde_json::Value>;

struct ReqContextInner {
    id: RequestId,
    params: TransferParams,
    filter: TierFilter,
    positions: Mutex<KeyMap<u64>>,
    scratch: Mutex<Scratch>,
}

/// The scratch values of one request, one per type. A request holds a few (a tier's access
/// record, its policy's rank, another tier's parsed parameters), so a short vector searched by
/// `TypeId` costs less than a hash map (no hashing). Its first two entries live inline: a
/// request holding at most two values makes no allocation for the vector itself.
#[derive(Default)]
struct Scratch(SmallVec<[(TypeId, Box<dyn Any + Send>); 2]>);

impl Scratch {
    fn position(&self, id: TypeId) -> Option<usize> {
        self.0.iter().position(|(t, _)| *t == id)
    }

    fn get(&self, id: TypeId) -> Option<&(dyn Any + Send)> {
        self.position(id).map(|i| &*self.0[i].1)
    }

    fn insert(&mut self, id: TypeId, value: Box<dyn Any + Send>) {
        match self.position(id) {
            Some(i) => self.0[i].1 = value,
            None => self.0.push((id, value)),
        }
    }

    fn get_or_insert_with(
        &mut self,
        id: TypeId,
        init: impl FnOnce() -> Box<dyn Any + Send>,
    ) -> &mut (dyn Any + Send) {
        let i = match self.position(id) {
            Some(i) => i,
            None => {
                self.0.push((id, init()));
                self.0.len() - 1
            }
        };
        &mut *self.0[i].1
    }

    fn remove(&mut self, id: TypeId) -> Option<Box<dyn Any + Send>> {
        self.position(id).map(|i| self.0.swap_remove(i).1)
    }
}

/// A cheap-to-clone handle for one request, shared by the engine, the manager and the tiers.
///
/// Besides the id, the transfer parameters and the load filter, it carries two pieces of mutable
/// state, as vLLM 0.33.0 does: the end-token position of each key (set by the scheduler before it
/// hands keys over, so policies can recover prefix order) and a scratch map keyed by type in which
/// a tier or policy keeps its per-request state (parsed parameters, observed keys, a rank).
#[derive(Clone)]
pub struct ReqContext(Arc<ReqContextInner>);

impl ReqContext {
    /// A context with no transfer parameters and the `All` filter.
    #[must_use]
    pub fn new(id: RequestId) -> Self {
        Self::builder(id).build()
    }

    /// A context for a local request named `id`.
    #[must_use]
    pub fn local(id: impl Into<String>) -> Self {
        Self::new(RequestId::local(id))
    }

    /// A builder for a context with parameters or a filter.
    #[must_use]
    pub fn builder(id: RequestId) -> ReqContextBuilder {
        ReqContextBuilder {
            id,
            params: TransferParams::new(),
            filter: TierFilter::All,
        }
    }

    /// The request id.
    #[must_use]
    pub fn id(&self) -> &RequestId {
        &self.0.id
    }

    /// The transfer parameters.
    #[must_use]
    pub fn params(&self) -> &TransferParams {
        &self.0.params
    }

    /// Which secondary tiers a lookup for this request may promote from.
    #[must_use]
    pub fn load_filter(&self) -> &TierFilter {
        &self.0.filter
    }

    /// Records the end-token position of `key` within the request.
    pub fn set_key_position(&self, key: OffloadKey, position: u64) {
        self.0.positions.lock().insert(key, position);
    }

    /// The recorded end-token position of `key`, if any.
    #[must_use]
    pub fn key_position(&self, key: &OffloadKey) -> Option<u64> {
        self.0.positions.lock().get(key).copied()
    }

    /// Whether any key position was recorded for this request (a tier can skip ordering by
    /// position when none was).
    #[must_use]
    pub fn has_key_positions(&self) -> bool {
        !self.0.positions.lock().is_empty()
    }

    /// The recorded positions of `keys`, appended to `out` in key order, taking the lock once
    /// (tiers resolve a whole batch with one call instead of one lock per key).
    pub fn key_positions_into(&self, keys: &[OffloadKey], out: &mut Vec<Option<u64>>) {
        let positions = self.0.positions.lock();
        if positions.is_empty() {
            out.extend(std::iter::repeat_n(None, keys.len()));
        } else {
            out.extend(keys.iter().map(|k| positions.get(k).copied()));
        }
    }

    /// Stores `value` in the scratch map under its type, replacing any previous value.
    pub fn set_state<T: Any + Send>(&self, value: T) {
        self.0.scratch.lock().insert(TypeId::of::<T>(), Box::new(value));
    }

    /// Runs `f` on the scratch value of type `T`, inserting `init()` first when absent.
    pub fn with_state<T: Any + Send, R>(&self, init: impl FnOnce() -> T, f: impl FnOnce(&mut T) -> R) -> R {
        let mut scratch = self.0.scratch.lock();
        let slot = scratch.get_or_insert_with(TypeId::of::<T>(), || Box::new(init()));
        match slot.downcast_mut::<T>() {
            Some(v) => f(v),
            None => unreachable!("scratch values are stored under their own TypeId"),
        }
    }

    /// A clone of the scratch value of type `T`, if present.
    #[must_use]
    pub fn state<T: Any + Send + Clone>(&self) -> Option<T> {
        self.0
            .scratch
            .lock()
            .get(TypeId::of::<T>())
            .and_then(|b| b.downcast_ref::<T>())
            .cloned()
    }

    /// Removes and returns the scratch value of type `T`.
    pub fn take_state<T: Any + Send>(&self) -> Option<T> {
        self.0
            .scratch
            .lock()
            .remove(TypeId::of::<T>())
            .and_then(|b| b.downcast::<T>().ok())
            .map(|b| *b)
    }

    /// Whether two handles refer to the same context.
    #[must_use]
    pub fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Tells whether a [`ReqContext`] is still alive (any handle of it left) without keeping it
/// alive: for state a tier keeps per request outside the context, to be let go of once the
/// engine has let go of the request. Costs no allocation.
#[derive(Clone, Debug, Default)]
pub struct ReqLiveness(Weak<ReqContextInner>);

impl ReqLiveness {
    /// Whether any handle of the context is left (`false` for the default value).
    #[must_use]
    pub fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl ReqContext {
    /// A [`ReqLiveness`] of this context.
    #[must_use]
    pub fn liveness(&self) -> ReqLiveness {
        ReqLiveness(Arc::downgrade(&self.0))
    }
}

impl fmt::Debug for ReqContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReqContext")
            .field("id", &self.0.id)
            .field("filter", &self.0.filter)
            .finish_non_exhaustive()
    }
}

/// Builds a [`ReqContext`].
#[derive(Debug)]
pub struct ReqContextBuilder {
    id: RequestId,
    params: TransferParams,
    filter: TierFilter,
}

impl ReqContextBuilder {
    /// Sets the transfer parameters.
    #[must_use]
    pub fn params(mut self, params: TransferParams) -> Self {
        self.params = params;
        self
    }

    /// Sets the load filter.
    #[must_use]
    pub fn filter(mut self, filter: TierFilter) -> Self {
        self.filter = filter;
        self
    }

    /// Builds the context.
    #[must_use]
    pub fn build(self) -> ReqContext {
        ReqContext(Arc::new(ReqContextInner {
            id: self.id,
            params: self.params,
            filter: self.filter,
            positions: Mutex::new(KeyMap::default()),
            scratch: Mutex::new(Scratch::default()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matcher_fields_are_wildcards_on_either_side() {
        let m = TierMatcher {
            medium: Some(Medium::Storage),
            locality: Some(Locality::Remote),
        };
        assert!(m.matches(Some(Medium::Storage), Some(Locality::Remote)));
        assert!(
            m.matches(Some(Medium::Storage), None),
            "a tier without locality matches"
        );
        assert!(m.matches(None, None));
        assert!(!m.matches(Some(Medium::Cpu), Some(Locality::Remote)));
        assert!(!m.matches(Some(Medium::Storage), Some(Locality::Local)));
        assert!(TierMatcher::default().matches(Some(Medium::Cpu), Some(Locality::Local)));
    }

    #[test]
    fn empty_filter_means_primary_only_and_all_allows_everything() {
        assert!(!TierFilter::primary_only().allows(None, None));
        assert!(TierFilter::All.allows(Some(Medium::Cpu), Some(Locality::Remote)));
        let f = TierFilter::Matchers(vec![
            TierMatcher {
                medium: Some(Medium::Cpu),
                locality: None,
            },
            TierMatcher {
                medium: None,
                locality: Some(Locality::Local),
            },
        ]);
        assert!(f.allows(Some(Medium::Cpu), Some(Locality::Remote)));
        assert!(f.allows(Some(Medium::Storage), Some(Locality::Local)));
        assert!(!f.allows(Some(Medium::Storage), Some(Locality::Remote)));
    }

    #[test]
    fn local_and_remote_ids_are_disjoint() {
        assert_ne!(RequestId::local("a"), RequestId::remote("", "a"));
        assert_eq!(RequestId::remote("h:1", "r").to_string(), "h:1/r");
    }

    #[test]
    fn scratch_state_is_keyed_by_type_and_positions_are_per_key() {
        let ctx = ReqContext::local("r");
        ctx.set_state(5u32);
        ctx.with_state(|| 0u64, |v| *v += 2);
        ctx.with_state(|| 0u64, |v| *v += 2);
        assert_eq!(ctx.state::<u32>(), Some(5));
        assert_eq!(ctx.state::<u64>(), Some(4));
        assert_eq!(ctx.take_state::<u32>(), Some(5));
        assert_eq!(ctx.state::<u32>(), None);
        let k = OffloadKey::from_u64(1);
        assert_eq!(ctx.key_position(&k), None);
        let mut batch = Vec::new();
        ctx.key_positions_into(&[k, k], &mut batch);
        assert_eq!(batch, vec![None, None]);
        ctx.set_key_position(k, 64);
        assert_eq!(ctx.clone().key_position(&k), Some(64));
        batch.clear();
        ctx.key_positions_into(&[OffloadKey::from_u64(2), k], &mut batch);
        assert_eq!(batch, vec![None, Some(64)]);
    }
}
