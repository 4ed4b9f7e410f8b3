//! A tier library whose tier panics in `lookup` (or, with `panic_in = "factory"`, while being
//! built, or with `panic_in = "validate"`, in its validate-only hook), for the tests that check
//! panics never cross the boundary.

use serde::Deserialize;
use tiering_core::options::parse_options;
use tiering_core::{
    JobResult, LookupResult, OffloadKey, ReqContext, SecondaryTier, TierError, TierInfo, TransferJob,
    registry::SecondaryContext,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    #[serde(default)]
    panic_in: String,
}

struct Panicky {
    finished: Vec<JobResult>,
}

impl SecondaryTier for Panicky {
    fn info(&self) -> TierInfo {
        TierInfo::new("panicky", None, None)
    }

    fn lookup(&mut self, _key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        panic!("the panicky tier's lookup gave up");
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.finished
            .push(JobResult::ok(job.id, 0, std::time::Duration::ZERO));
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.finished
            .push(JobResult::failed(job.id, std::time::Duration::ZERO));
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.finished);
    }

    fn drain_jobs(&mut self) {}
}

fn build(options: &toml::Table, _ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let o: Options = parse_options(options)?;
    assert!(o.panic_in != "factory", "the panicky tier refuses to be built");
    Ok(Box::new(Panicky { finished: Vec::new() }))
}

fn validate(options: &toml::Table) -> Result<(), Vec<TierError>> {
    let o: Options = parse_options(options).map_err(|e| vec![e])?;
    assert!(
        o.panic_in != "validate",
        "the panicky tier's validate hook gave up"
    );
    Ok(())
}

tiering_plugin::export_tier!("panicky" => build, validate = validate);
