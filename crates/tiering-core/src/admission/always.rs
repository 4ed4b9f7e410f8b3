//! `always`: every chunk is cascaded (the behaviour before admission policies existed).

use super::{Access, AdmissionContext, AdmissionError, AdmissionPolicy};
use crate::key::OffloadKey;

/// Admits everything.
#[derive(Debug, Default)]
pub(crate) struct Always;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {}

impl AdmissionPolicy for Always {
    fn on_access(&mut self, _keys: &[OffloadKey], _access: Access) {}

    fn admit(&mut self, _key: &OffloadKey) -> bool {
        true
    }
}

fn build(options: &toml::Table, _ctx: &AdmissionContext) -> Result<Box<dyn AdmissionPolicy>, AdmissionError> {
    let Options {} = super::registry::parse(options)?;
    Ok(Box::new(Always))
}

crate::register_admission!("always" => build);
