//! Checking a submitted job before it is queued: the checks every tier makes (`submit_store` /
//! `submit_load`), and the job taken apart with its rows typed for its direction.

use tiering_core::{
    JobId, JobKind, OffloadKey, TransferJob,
    arena::{RowGrant, RowRead, RowWrite},
};

/// A job the tier can run: its keys and, parallel to them, its granted rows.
#[derive(Debug)]
pub struct Accepted<R> {
    /// The job's id.
    pub id: JobId,
    /// Store or promotion.
    pub kind: JobKind,
    /// The chunks, in order.
    pub keys: Vec<OffloadKey>,
    /// The granted rows, parallel to `keys`: [`RowRead`] for a store, [`RowWrite`] for a load.
    pub rows: Vec<R>,
}

/// A job the tier refuses, with what reporting it failed takes (its row grants are dropped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// The job's id.
    pub id: JobId,
    /// Store or promotion.
    pub kind: JobKind,
    /// The chunks, in order.
    pub keys: Vec<OffloadKey>,
    /// Why, for the tier's warning.
    pub why: &'static str,
}

/// Accepts `job` as a `kind` job whose grants `typed` turns into rows, or says why not
/// (`wrong`: the grants are of the other direction).
fn accept<R>(
    job: TransferJob,
    kind: JobKind,
    chunk_bytes: usize,
    refusal: Option<&'static str>,
    typed: fn(RowGrant) -> Result<Vec<R>, RowGrant>,
    wrong: &'static str,
) -> Result<Accepted<R>, Rejected> {
    let why = refusal.or_else(|| job.defect(kind, chunk_bytes));
    let TransferJob {
        id, kind, keys, rows, ..
    } = job;
    let rejected = |keys, why| Rejected { id, kind, keys, why };
    if let Some(why) = why {
        return Err(rejected(keys, why));
    }
    match typed(rows) {
        Ok(rows) => Ok(Accepted { id, kind, keys, rows }),
        Err(_) => Err(rejected(keys, wrong)),
    }
}

/// Accepts a job given to `submit_store` by a tier of `chunk_bytes` chunks, unless `refusal`
/// names a reason of the tier's own (it is shut down) or the job is defective
/// (`TransferJob::defect`).
///
/// # Errors
/// [`Rejected`], saying why.
pub fn accept_store(
    job: TransferJob,
    chunk_bytes: usize,
    refusal: Option<&'static str>,
) -> Result<Accepted<RowRead>, Rejected> {
    let wrong = "a store came with write grants";
    accept(
        job,
        JobKind::Store,
        chunk_bytes,
        refusal,
        RowGrant::into_reads,
        wrong,
    )
}

/// As [`accept_store`], for a job given to `submit_load`.
///
/// # Errors
/// [`Rejected`], saying why.
pub fn accept_load(
    job: TransferJob,
    chunk_bytes: usize,
    refusal: Option<&'static str>,
) -> Result<Accepted<RowWrite>, Rejected> {
    let wrong = "a promotion came with read grants";
    accept(
        job,
        JobKind::Promotion,
        chunk_bytes,
        refusal,
        RowGrant::into_writes,
        wrong,
    )
}

#[cfg(test)]
mod tests {
    use tiering_core::{ReqContext, arena::ChunkArena};

    use super::*;

    fn job(kind: JobKind, rows: RowGrant) -> TransferJob {
        TransferJob {
            id: JobId(5),
            kind,
            keys: vec![OffloadKey::from_u64(1)],
            chunk_ids: vec![0],
            req: ReqContext::local("accept"),
            rows,
        }
    }

    #[test]
    fn a_sound_job_is_taken_apart_with_typed_rows() {
        let arena = ChunkArena::new(2, 64).unwrap();
        let store = job(JobKind::Store, RowGrant::Read(arena.read_rows(&[0]).unwrap()));
        let a = accept_store(store, 64, None).unwrap();
        assert_eq!(
            (a.id, a.kind, a.keys.len(), a.rows.len()),
            (JobId(5), JobKind::Store, 1, 1)
        );
        drop(a);
        let load = job(
            JobKind::Promotion,
            RowGrant::Write(arena.write_rows(&[1]).unwrap()),
        );
        assert_eq!(accept_load(load, 64, None).unwrap().rows.len(), 1);
    }

    #[test]
    fn refusals_say_why_and_keep_what_the_report_needs() {
        let arena = ChunkArena::new(2, 64).unwrap();
        let store = || job(JobKind::Store, RowGrant::Read(arena.read_rows(&[0]).unwrap()));
        let r = accept_store(store(), 64, Some("the tier is shut down")).unwrap_err();
        assert_eq!(
            (r.id, r.why, r.keys.len()),
            (JobId(5), "the tier is shut down", 1)
        );
        let r = accept_store(store(), 128, None).unwrap_err();
        assert_eq!(r.why, "a granted row is not one chunk long");
        let r = accept_load(store(), 64, None).unwrap_err();
        assert_eq!(r.why, "submitted through the wrong method for its kind");
        let mislabelled = job(JobKind::Store, RowGrant::Write(arena.write_rows(&[1]).unwrap()));
        assert_eq!(
            accept_store(mislabelled, 64, None).unwrap_err().why,
            "a store came with write grants"
        );
    }
}
