//! A tier library as built before tier ABI 5: it declares version 4 and returns the version-4
//! descriptor (no validate entry). The workspace tests load it to check that such libraries still
//! load and run, and that `kvtier check` says their options can only be checked by building.

use std::time::Duration;

use serde::Deserialize;
use tiering_core::options::{ByteSize, parse_options};
use tiering_core::{
    JobResult, LookupResult, OffloadKey, ReqContext, SecondaryTier, TierError, TierInfo, TransferJob,
    registry::SecondaryContext,
};
use tiering_plugin::export::{create, descriptor};
use tiering_plugin::ffi::{
    ErrSink, FfiFactoryCtx, FfiStaticStr, FfiStatus, FfiStr, PluginDescriptorV4, TierState,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    #[allow(dead_code)]
    capacity: ByteSize,
}

/// Keeps nothing: stores succeed and are forgotten, so every lookup misses.
struct Forgetful {
    finished: Vec<JobResult>,
}

impl SecondaryTier for Forgetful {
    fn info(&self) -> TierInfo {
        TierInfo::new("legacy", None, None)
    }

    fn lookup(&mut self, _key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        LookupResult::Miss
    }

    fn submit_store(&mut self, job: TransferJob) {
        self.finished.push(JobResult::ok(job.id, 0, Duration::ZERO));
    }

    fn submit_load(&mut self, job: TransferJob) {
        self.finished.push(JobResult::failed(job.id, Duration::ZERO));
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.finished);
    }

    fn drain_jobs(&mut self) {}
}

fn build(options: &toml::Table, _ctx: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let _: Options = parse_options(options)?;
    Ok(Box::new(Forgetful { finished: Vec::new() }))
}

unsafe extern "C" fn create_legacy(
    options: FfiStr,
    ctx: *const FfiFactoryCtx,
    out: *mut TierState,
    err: ErrSink,
) -> FfiStatus {
    // SAFETY: the host calls `create` under the vtable's contract, which is `create`'s.
    unsafe { create(build, options, ctx, out, err) }
}

/// Version 4 of the ABI, as such a library was compiled.
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static kvtier_tier_abi_version: u32 = 4;

static DESCRIPTOR: PluginDescriptorV4 = PluginDescriptorV4 {
    abi_version: 4,
    descriptor_size: size_of::<PluginDescriptorV4>(),
    core_version: FfiStaticStr::new(tiering_plugin::CORE_VERSION),
    fingerprint: FfiStaticStr::new(tiering_plugin::BUILD_FINGERPRINT),
    type_name: FfiStaticStr::new("legacy"),
    // The vtable did not change between versions 4 and 5.
    vtable: descriptor("legacy", create_legacy).vtable,
};

/// The entry point, returning the version-4 descriptor.
#[unsafe(no_mangle)]
pub extern "C" fn kvtier_tier_entry() -> *const PluginDescriptorV4 {
    &raw const DESCRIPTOR
}
