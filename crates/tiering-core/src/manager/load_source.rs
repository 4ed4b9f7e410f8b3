//! Where the chunks a request loads came from: the secondary tier whose promotion brought a key
//! into the primary for that request, else the primary itself. Engines report it as the source
//! of a request's cache hits (vLLM's `get_load_source`, asked after a lookup answered `Hit`);
//! the promotion has landed by then, so the origin is remembered per request (in
//! `super::request_table`) and answered by `TieringState::load_source_unlocked` (`super::lookup`).

use crate::request::TierInfo;

/// Where a chunk a request loads came from ([`Step::load_source`](super::Step::load_source)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadSource {
    /// `None` for the primary tier, else the secondary tier's index in chain order.
    pub secondary: Option<usize>,
    /// That tier's description.
    pub info: TierInfo,
}
