//! The boundary exercised in-process: entry points linked into the test binary go through the
//! same descriptor checks and the same C vtable as a loaded library.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::export::{self, descriptor};
use super::ffi::{
    ErrSink, FfiConfigError, FfiFactoryCtx, FfiSink, FfiStaticStr, FfiStatus, FfiStr, PluginDescriptor,
    PluginDescriptorV4, TierState,
};
use super::{PluginError, PluginTier, from_entry_point};
use tiering_core::ControlWaker;
use tiering_core::OffloadKey;
use tiering_core::OffloadingManager;
use tiering_core::TransferJob;
use tiering_core::registry::SecondaryContext;
use tiering_core::testing::{MemoryPrimary, PeerRequest, ScriptedTier, ScriptedTierHandle};
use tiering_core::{JobResult, OffloadPolicy, TierInfo};
use tiering_core::{LookupResult, ScheduleEndContext};
use tiering_core::{ManagerConfig, Step, TieringManager};
use tiering_core::{ManagerError, TierError};
use tiering_core::{ParentManager, PrimaryTier, SecondaryTier};
use tiering_core::{ReqContext, RequestId};

const CHUNK: usize = 256;

static HANDLES: Mutex<Vec<(String, ScriptedTierHandle)>> = Mutex::new(Vec::new());

fn handle(name: &str) -> ScriptedTierHandle {
    HANDLES
        .lock()
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, h)| h.clone())
        .unwrap()
}

fn name_of(options: &toml::Table) -> String {
    options
        .get("name")
        .and_then(toml::Value::as_str)
        .unwrap_or("scripted")
        .to_owned()
}

// The registered signature returns `Result`.
#[allow(clippy::unnecessary_wraps)]
fn scripted_factory(
    options: &toml::Table,
    _: &SecondaryContext,
) -> Result<Box<dyn SecondaryTier>, TierError> {
    let name = name_of(options);
    let (tier, h) = ScriptedTier::new(&name);
    HANDLES.lock().push((name, h));
    Ok(Box::new(tier))
}

/// A scripted tier that panics in one chosen method.
struct Panicky {
    inner: ScriptedTier,
    panic_on: String,
}

impl Panicky {
    fn maybe_panic(&self, op: &str) {
        assert!(self.panic_on != op, "deliberate panic in {op}");
    }
}

impl SecondaryTier for Panicky {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }
    fn set_waker(&mut self, waker: ControlWaker) {
        self.inner.set_waker(waker);
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.maybe_panic("lookup");
        self.inner.lookup(key, ctx)
    }
    fn submit_store(&mut self, job: TransferJob) {
        self.maybe_panic("submit_store");
        self.inner.submit_store(job);
    }
    fn submit_load(&mut self, job: TransferJob) {
        self.inner.submit_load(job);
    }
    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.inner.poll_finished(out);
    }
    fn on_new_request(&mut self, ctx: &ReqContext) -> OffloadPolicy {
        self.inner.on_new_request(ctx)
    }
    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        self.inner.serve_external_requests(parent)
    }
    fn drain_jobs(&mut self) {
        self.inner.drain_jobs();
    }
}

fn panicky_factory(
    options: &toml::Table,
    ctx: &SecondaryContext,
) -> Result<Box<dyn SecondaryTier>, TierError> {
    let panic_on = options
        .get("panic_on")
        .and_then(toml::Value::as_str)
        .unwrap_or("")
        .to_owned();
    assert!(panic_on != "factory", "deliberate panic in the factory");
    if panic_on == "refuse" {
        return Err(TierError::Config("deliberately refused".into()));
    }
    let mut table = options.clone();
    table.remove("panic_on");
    let (inner, h) = ScriptedTier::new(&name_of(&table));
    HANDLES.lock().push((name_of(&table), h));
    let _ = ctx;
    Ok(Box::new(Panicky { inner, panic_on }))
}

unsafe extern "C" fn create_scripted(
    o: FfiStr,
    c: *const FfiFactoryCtx,
    out: *mut TierState,
    e: ErrSink,
) -> FfiStatus {
    // SAFETY: forwarded verbatim from the host.
    unsafe { export::create(scripted_factory, o, c, out, e) }
}

unsafe extern "C" fn create_panicky(
    o: FfiStr,
    c: *const FfiFactoryCtx,
    out: *mut TierState,
    e: ErrSink,
) -> FfiStatus {
    // SAFETY: forwarded verbatim from the host.
    unsafe { export::create(panicky_factory, o, c, out, e) }
}

static SCRIPTED: PluginDescriptor = descriptor("scripted", create_scripted);
static PANICKY: PluginDescriptor = descriptor("panicky", create_panicky);
static WRONG_ABI: PluginDescriptor = PluginDescriptor {
    abi_version: 999,
    ..descriptor("wrong", create_scripted)
};

extern "C" fn scripted_entry() -> *const PluginDescriptor {
    &raw const SCRIPTED
}
extern "C" fn panicky_entry() -> *const PluginDescriptor {
    &raw const PANICKY
}
extern "C" fn wrong_abi_entry() -> *const PluginDescriptor {
    &raw const WRONG_ABI
}

crate::export_tier!("macro-made" => scripted_factory);

/// A validate-only hook: `name` must be a string other than "bad"; `panic_on = "validate"`
/// panics; any other key is unknown.
fn check_scripted(options: &toml::Table) -> Result<(), Vec<TierError>> {
    let mut problems = Vec::new();
    for (k, v) in options {
        match (k.as_str(), v.as_str()) {
            ("name", Some("bad")) => problems.push(TierError::Config("`name` must not be \"bad\"".into())),
            ("name", Some(_)) => {}
            ("panic_on", Some("validate")) => panic!("deliberate panic in validate"),
            _ => problems.push(TierError::Config(format!("unknown field `{k}`"))),
        }
    }
    if options.is_empty() {
        problems.push(TierError::Other("a table without keys".into()));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

unsafe extern "C" fn validate_scripted(o: FfiStr, out: FfiSink<FfiConfigError>, e: ErrSink) -> FfiStatus {
    // SAFETY: forwarded verbatim from the host.
    unsafe { export::validate(check_scripted, o, out, e) }
}

static CHECKED: PluginDescriptor = descriptor("checked", create_scripted).with_validate(validate_scripted);

extern "C" fn checked_entry() -> *const PluginDescriptor {
    &raw const CHECKED
}

/// A version-4 descriptor: the version-5 one without its trailing validate entry.
const fn legacy_descriptor() -> PluginDescriptorV4 {
    PluginDescriptorV4 {
        abi_version: 4,
        descriptor_size: size_of::<PluginDescriptorV4>(),
        core_version: FfiStaticStr::new(super::CORE_VERSION),
        fingerprint: FfiStaticStr::new(super::BUILD_FINGERPRINT),
        type_name: FfiStaticStr::new("scripted"),
        vtable: descriptor("scripted", create_scripted).vtable,
    }
}

static LEGACY: PluginDescriptorV4 = legacy_descriptor();

/// A version-4 descriptor claiming version 5's size.
static LEGACY_WRONG_SIZE: PluginDescriptorV4 = PluginDescriptorV4 {
    descriptor_size: size_of::<PluginDescriptor>(),
    ..legacy_descriptor()
};

extern "C" fn legacy_entry() -> *const PluginDescriptor {
    (&raw const LEGACY).cast()
}

extern "C" fn legacy_wrong_size_entry() -> *const PluginDescriptor {
    (&raw const LEGACY_WRONG_SIZE).cast()
}

fn table(pairs: &[(&str, &str)]) -> toml::Table {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), toml::Value::String((*v).to_owned())))
        .collect()
}

fn bytes_for(n: u64) -> Vec<u8> {
    (0..CHUNK).map(|i| (n as usize * 31 + i) as u8).collect()
}

/// Stores `keys` for `ctx` through the manager, writing each chunk's bytes as the engine would.
fn store(m: &mut Step<'_>, arena: &Arc<tiering_core::arena::ChunkArena>, ctx: &ReqContext, keys: &[u64]) {
    let ks: Vec<OffloadKey> = keys.iter().map(|&n| OffloadKey::from_u64(n)).collect();
    let out = m.prepare_store(&ks, ctx).unwrap().unwrap();
    for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        let n = keys[ks.iter().position(|x| x == k).unwrap()];
        arena.write_row(c).unwrap().copy_from_slice(&bytes_for(n));
    }
    m.complete_store(&out.keys_to_store, ctx, true).unwrap();
}

/// One whole engine step with nothing but the step-end flush.
fn step(m: &mut TieringManager) -> Result<(), ManagerError> {
    m.step().on_schedule_end(&ScheduleEndContext::default())
}

struct Fixture {
    manager: TieringManager,
    primary: MemoryPrimary,
    arena: Arc<tiering_core::arena::ChunkArena>,
    waker: ControlWaker,
}

fn fixture(entry: super::ffi::EntryFn, options: &toml::Table, with_native: Option<&str>) -> Fixture {
    let primary = MemoryPrimary::new(16, CHUNK);
    let arena = Arc::clone(primary.arena());
    let waker = ControlWaker::new();
    let lib = from_entry_point("in-process", entry).unwrap();
    let ctx = SecondaryContext::new(Arc::clone(&arena), waker.clone());
    let mut tiers: Vec<Box<dyn SecondaryTier>> =
        vec![Box::new(PluginTier::create(lib, options, &ctx).unwrap())];
    if let Some(name) = with_native {
        tiers.push(scripted_factory(&table(&[("name", name)]), &ctx).unwrap());
    }
    let manager = TieringManager::with_waker(
        Box::new(primary.clone()),
        tiers,
        ManagerConfig::step_driven(),
        waker.clone(),
    );
    Fixture {
        manager,
        primary,
        arena,
        waker,
    }
}

#[test]
fn descriptors_are_checked_and_the_macro_exports_a_valid_one() {
    let lib = from_entry_point("macro", kvtier_tier_entry).unwrap();
    assert_eq!(lib.type_name(), "macro-made");
    assert_eq!(lib.core_version(), super::CORE_VERSION);
    assert!(lib.same_build_as_host());
    assert_eq!(kvtier_tier_abi_version, super::ffi::ABI_VERSION);
    let err = from_entry_point("wrong", wrong_abi_entry).unwrap_err();
    assert!(
        matches!(
            err,
            PluginError::AbiMismatch {
                found: 999,
                expected: super::ffi::ABI_VERSION,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("version 999"), "{err}");
}

#[test]
fn cascades_promotions_and_peer_fan_out_cross_the_boundary() {
    let mut f = fixture(scripted_entry, &table(&[("name", "inproc-a")]), Some("native-b"));
    let a = handle("inproc-a");
    let b = handle("native-b");
    let ctx = ReqContext::local("r1");
    {
        let mut s = f.manager.step();
        s.on_new_request(&ctx).unwrap();
        store(&mut s, &f.arena, &ctx, &[1, 2]);
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    }
    assert!(a.wait_until(Duration::from_secs(10), |v| v.count("submit_store") >= 1));
    step(&mut f.manager).unwrap();
    assert_eq!(
        a.get(&OffloadKey::from_u64(1)),
        Some(bytes_for(1)),
        "cascade reached the library"
    );
    assert_eq!(b.get(&OffloadKey::from_u64(2)), Some(bytes_for(2)));
    assert_eq!(
        f.primary.total_pins(),
        0,
        "cascade pins released after the library reported"
    );
    assert_eq!(f.arena.granted_rows(), 0, "adopted grants were released");

    // Promotion: a key only the library holds.
    a.insert(OffloadKey::from_u64(7), bytes_for(7));
    let k7 = OffloadKey::from_u64(7);
    let r2 = ReqContext::local("r2");
    {
        let mut s = f.manager.step();
        s.on_new_request(&r2).unwrap();
        assert_eq!(s.lookup(&k7, &r2).unwrap(), LookupResult::HitPending);
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    }
    step(&mut f.manager).unwrap();
    {
        let mut s = f.manager.step();
        assert_eq!(s.lookup(&k7, &r2).unwrap(), LookupResult::Hit);
        let rows = s.prepare_load(&[k7], &r2).unwrap();
        assert_eq!(&*f.arena.read_row(rows[0]).unwrap(), bytes_for(7).as_slice());
        s.complete_load(&[k7], &r2).unwrap();
        s.on_request_finished(&r2).unwrap();
        s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    }

    // A peer asks the library's tier: the primary answers one key, the native tier another
    // (fan-out through the C-ABI ParentManager), and a fetch moves bytes through a store job.
    b.insert(OffloadKey::from_u64(9), bytes_for(9));
    let peer_ctx = ReqContext::new(RequestId::remote("peer:1", "p1"));
    a.push_peer_request(PeerRequest {
        ctx: peer_ctx,
        keys: vec![
            OffloadKey::from_u64(1),
            OffloadKey::from_u64(9),
            OffloadKey::from_u64(99),
        ],
        fetch: true,
        wait_for_pending: false,
    });
    step(&mut f.manager).unwrap();
    let served = a.served();
    let p = served.last().unwrap();
    assert_eq!(p.error, None);
    assert_eq!(
        p.lookups,
        vec![LookupResult::Hit, LookupResult::HitPending, LookupResult::Miss]
    );
    assert_eq!(p.fetched, vec![(OffloadKey::from_u64(1), bytes_for(1))]);
    step(&mut f.manager).unwrap();
    step(&mut f.manager).unwrap();
    assert_eq!(
        f.primary.total_pins(),
        0,
        "the peer store job was reported and unpinned"
    );
    assert_eq!(f.arena.granted_rows(), 0);
    f.manager.step().on_request_finished(&ctx).unwrap();
    f.manager.shutdown().unwrap();
}

#[test]
fn wakes_from_the_library_reach_the_host_waker() {
    let f = fixture(scripted_entry, &table(&[("name", "inproc-wake")]), None);
    let a = handle("inproc-wake");
    let _ = f.waker.wait(Duration::ZERO);
    a.push_peer_request_quietly(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("peer:2", "x")),
        keys: Vec::new(),
        fetch: false,
        wait_for_pending: false,
    });
    // The scripted tier wakes the waker it was given: the library's own, forwarded to ours.
    a.push_peer_request(PeerRequest {
        ctx: ReqContext::new(RequestId::remote("peer:2", "y")),
        keys: Vec::new(),
        fetch: false,
        wait_for_pending: false,
    });
    assert!(f.waker.wait(Duration::from_secs(30)), "the wake was forwarded");
}

#[test]
fn a_panic_in_lookup_quarantines_the_library_tier_as_a_linked_in_panic_would() {
    let mut f = fixture(
        panicky_entry,
        &table(&[("name", "inproc-p1"), ("panic_on", "lookup")]),
        None,
    );
    let ctx = ReqContext::local("r");
    let mut s = f.manager.step();
    s.on_new_request(&ctx).unwrap();
    // Caught in the library, raised again in the host after the call returned, caught by the
    // manager's guard: the lookup walks on without the tier (a miss), no error, no unwind.
    assert_eq!(
        s.lookup(&OffloadKey::from_u64(5), &ctx).unwrap(),
        LookupResult::Miss
    );
    s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    drop(s);
    let quarantined = f.manager.inspect(|s| s.quarantined_tiers());
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    let (tier, why) = &quarantined[0];
    assert_eq!(tier, "inproc-p1");
    assert!(
        why.contains("panicked in lookup") && why.contains("deliberate panic"),
        "{why}"
    );
    let stats = f.manager.stats().unwrap();
    assert_eq!(stats.manager.tier_panics, 1);
    assert_eq!(stats.manager.tiers_quarantined, 1);
    f.manager.shutdown().unwrap();
}

#[test]
fn a_panic_while_taking_a_job_quarantines_the_tier_and_fails_the_job_once() {
    let mut f = fixture(
        panicky_entry,
        &table(&[("name", "inproc-p2"), ("panic_on", "submit_store")]),
        None,
    );
    let ctx = ReqContext::local("r");
    let mut s = f.manager.step();
    s.on_new_request(&ctx).unwrap();
    store(&mut s, &f.arena, &ctx, &[3]);
    s.on_schedule_end(&ScheduleEndContext::default()).unwrap();
    drop(s);
    let quarantined = f.manager.inspect(|s| s.quarantined_tiers());
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert!(
        quarantined[0].1.contains("panicked in submit_store"),
        "{quarantined:?}"
    );
    // The job was failed once by the quarantine (unpinning the chunk); later steps see no
    // unknown job.
    step(&mut f.manager).unwrap();
    assert_eq!(f.manager.inspect(|s| s.jobs_in_flight()), 0);
    assert_eq!(f.primary.total_pins(), 0);
    assert_eq!(f.arena.granted_rows(), 0);
}

#[test]
fn factory_failures_and_panics_are_errors() {
    let primary = MemoryPrimary::new(4, CHUNK);
    let ctx = SecondaryContext::new(Arc::clone(primary.arena()), ControlWaker::new());
    let lib = from_entry_point("in-process", panicky_entry).unwrap();
    let err = PluginTier::create(lib, &table(&[("panic_on", "factory")]), &ctx).unwrap_err();
    assert!(matches!(err, PluginError::Create { .. }));
    assert!(
        err.to_string().contains("panicked in the tier's factory"),
        "{err}"
    );
    let err = PluginTier::create(lib, &table(&[("panic_on", "refuse")]), &ctx).unwrap_err();
    assert!(err.to_string().contains("deliberately refused"), "{err}");
}

#[test]
fn info_and_stats_come_from_the_library() {
    let primary = MemoryPrimary::new(4, CHUNK);
    let ctx = SecondaryContext::new(Arc::clone(primary.arena()), ControlWaker::new());
    let lib = from_entry_point("in-process", scripted_entry).unwrap();
    let mut t = PluginTier::create(lib, &table(&[("name", "inproc-info")]), &ctx).unwrap();
    assert_eq!(t.info().name, "inproc-info");
    handle("inproc-info").insert(OffloadKey::from_u64(1), vec![0; CHUNK]);
    assert_eq!(t.stats().resident_chunks, 1);
    assert!(t.take_events().is_empty());
    assert!(!t.has_pending_work());
    t.shutdown().unwrap();
}

#[test]
fn a_validate_entry_checks_options_without_building_a_tier() {
    let lib = from_entry_point("in-process", checked_entry).unwrap();
    assert_eq!(lib.abi_version(), super::ffi::ABI_VERSION);
    assert!(lib.validates());
    let before = HANDLES.lock().len();
    assert_eq!(
        lib.validate_options(&table(&[("name", "fine")]))
            .unwrap()
            .unwrap(),
        vec![]
    );
    let mut problems = lib
        .validate_options(&table(&[("name", "bad"), ("colour", "blue")]))
        .unwrap()
        .unwrap();
    problems.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(
        problems,
        vec![
            super::OptionProblem {
                key: Some("colour".into()),
                message: "unknown field `colour`".into(),
            },
            super::OptionProblem {
                key: Some("name".into()),
                message: "`name` must not be \"bad\"".into(),
            },
        ]
    );
    // A problem about no key of the table goes out without one (and keeps its text).
    let problems = lib.validate_options(&toml::Table::new()).unwrap().unwrap();
    assert_eq!(problems[0].key, None);
    assert_eq!(problems[0].message, "a table without keys");
    // A panic in the hook is caught in the library and is an error of the check.
    let err = lib
        .validate_options(&table(&[("panic_on", "validate")]))
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, PluginError::Validate { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("panicked in the validate hook: deliberate panic in validate"),
        "{err}"
    );
    assert_eq!(HANDLES.lock().len(), before, "no tier was built");
    // A library exported without a hook has no entry.
    let plain = from_entry_point("macro", kvtier_tier_entry).unwrap();
    assert!(!plain.validates());
    assert!(plain.validate_options(&table(&[("name", "x")])).is_none());
}

#[test]
fn an_abi_4_descriptor_still_loads_and_runs_without_a_validate_entry() {
    let lib = from_entry_point("legacy", legacy_entry).unwrap();
    assert_eq!(lib.abi_version(), 4);
    assert!(!lib.validates());
    assert!(lib.validate_options(&table(&[("name", "x")])).is_none());
    let mut f = fixture(legacy_entry, &table(&[("name", "legacy-a")]), None);
    let a = handle("legacy-a");
    a.insert(OffloadKey::from_u64(7), bytes_for(7));
    let ctx = ReqContext::local("legacy-r");
    let mut s = f.manager.step();
    s.on_new_request(&ctx).unwrap();
    assert_ne!(
        s.lookup(&OffloadKey::from_u64(7), &ctx).unwrap(),
        LookupResult::Miss
    );
    drop(s);
    f.manager.shutdown().unwrap();
    let err = from_entry_point("legacy", legacy_wrong_size_entry).unwrap_err();
    assert!(matches!(err, PluginError::BadDescriptor { .. }), "{err}");
    assert!(err.to_string().contains("version-4 descriptor"), "{err}");
}
