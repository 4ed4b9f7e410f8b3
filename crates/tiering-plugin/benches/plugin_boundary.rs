//! The cost of the C-ABI boundary: `lookup` and a store job's round trip through a
//! `PluginTier` (the same vtable a loaded library uses, entered in-process) next to the same tier
//! called directly, measured in the same run. The report is the ratio.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tiering_core::testing::MemoryPrimary;
use tiering_core::{
    ControlWaker, JobId, JobKind, JobResult, KeySet, LookupResult, OffloadKey, PrimaryTier, ReqContext,
    SecondaryTier, TierError, TierInfo, TransferJob, arena::RowGrant, registry::SecondaryContext,
};
use tiering_plugin::export::{self, descriptor};
use tiering_plugin::ffi::{ErrSink, FfiFactoryCtx, FfiStatus, FfiStr, PluginDescriptor, TierState};
use tiering_plugin::{PluginTier, from_entry_point};

/// A tier that knows a set of keys and completes stores at once.
#[derive(Default)]
struct SetTier {
    keys: KeySet,
    done: Vec<JobResult>,
}

impl SecondaryTier for SetTier {
    fn info(&self) -> TierInfo {
        TierInfo::new("set", None, None)
    }
    fn lookup(&mut self, key: &OffloadKey, _: &ReqContext) -> LookupResult {
        if self.keys.contains(key) {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }
    fn submit_store(&mut self, job: TransferJob) {
        self.keys.extend(job.keys.iter().copied());
        self.done.push(JobResult::ok(job.id, 0, Duration::ZERO));
    }
    fn submit_load(&mut self, job: TransferJob) {
        self.done.push(JobResult::failed(job.id, Duration::ZERO));
    }
    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.done);
    }
    fn drain_jobs(&mut self) {}
}

#[allow(clippy::unnecessary_wraps)]
fn build(_: &toml::Table, _: &SecondaryContext) -> Result<Box<dyn SecondaryTier>, TierError> {
    let mut t = SetTier::default();
    t.keys.extend((0..1024).map(OffloadKey::from_u64));
    Ok(Box::new(t))
}

unsafe extern "C" fn create(
    o: FfiStr,
    c: *const FfiFactoryCtx,
    out: *mut TierState,
    e: ErrSink,
) -> FfiStatus {
    // SAFETY: forwarded verbatim from the host.
    unsafe { export::create(build, o, c, out, e) }
}

static DESCRIPTOR: PluginDescriptor = descriptor("set", create);

extern "C" fn entry() -> *const PluginDescriptor {
    &raw const DESCRIPTOR
}

fn store_round_trip(
    tier: &mut dyn SecondaryTier,
    arena: &Arc<tiering_core::arena::ChunkArena>,
    id: u64,
    out: &mut Vec<JobResult>,
) {
    let rows = arena.read_rows(&[0, 1, 2, 3]).unwrap();
    tier.submit_store(TransferJob {
        id: JobId(id),
        kind: JobKind::Store,
        keys: (0..4).map(OffloadKey::from_u64).collect(),
        chunk_ids: vec![0, 1, 2, 3],
        req: ReqContext::local("bench"),
        rows: RowGrant::Read(rows),
    });
    out.clear();
    tier.poll_finished(out);
    assert_eq!(out.len(), 1);
}

fn boundary(c: &mut Criterion) {
    let primary = MemoryPrimary::new(8, 4096);
    let arena = Arc::clone(primary.arena());
    let ctx = SecondaryContext::new(Arc::clone(&arena), ControlWaker::new());
    let lib = from_entry_point("bench", entry).unwrap();
    let mut plugin = PluginTier::create(lib, &toml::Table::new(), &ctx).unwrap();
    let mut native = build(&toml::Table::new(), &ctx).unwrap();
    let req = ReqContext::local("bench");
    let key = OffloadKey::from_u64(7);

    let mut g = c.benchmark_group("lookup");
    g.bench_function("native", |b| {
        b.iter(|| black_box(native.lookup(black_box(&key), &req)));
    });
    g.bench_function("plugin", |b| {
        b.iter(|| black_box(plugin.lookup(black_box(&key), &req)));
    });
    g.finish();

    let mut g = c.benchmark_group("store4_round_trip");
    let mut out = Vec::new();
    let mut id = 0;
    g.bench_function("native", |b| {
        b.iter(|| {
            id += 1;
            store_round_trip(native.as_mut(), &arena, id, &mut out);
        });
    });
    g.bench_function("plugin", |b| {
        b.iter(|| {
            id += 1;
            store_round_trip(&mut plugin, &arena, id, &mut out);
        });
    });
    g.finish();
}

criterion_group!(benches, boundary);
criterion_main!(benches);
