//! Deleting a namespace: every key `kvtier:<namespace>:*` (all layouts), on every master, with
//! `SCAN` and pipelined `UNLINK` in batches, so a large namespace never blocks the server.

use redis::Value;

use crate::conn::Endpoint;
use crate::error::RedisTierError;
use crate::format::KeyScheme;
use crate::options::{RedisTierOptions, validate_namespace};

/// Keys asked for per `SCAN` call (and deleted per pipeline).
const SCAN_COUNT: usize = 1000;

/// Deletes every chunk of `namespace` on the server(s) of `opts` (its `namespace` is ignored);
/// returns how many keys were deleted.
///
/// # Errors
/// An invalid namespace or server options, or a server that fails.
pub fn invalidate_namespace(opts: &RedisTierOptions, namespace: &str) -> Result<u64, RedisTierError> {
    validate_namespace(namespace)?;
    let endpoint = Endpoint::new(opts)?;
    endpoint.check()?;
    let server = |what, source| RedisTierError::Server {
        url: endpoint.display().to_owned(),
        what,
        source,
    };
    let pattern = format!("{}*", KeyScheme::namespace_prefix(namespace));
    let mut deleted = 0u64;
    for master in endpoint.masters().map_err(|e| server("listing masters", e))? {
        let mut conn = endpoint
            .connect_node(&master)
            .map_err(|e| server("connecting", e))?;
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query(&mut conn)
                .map_err(|e| server("SCAN", e))?;
            if !keys.is_empty() {
                // One UNLINK per key: in a cluster a multi-key UNLINK across slots is refused.
                let mut p = redis::pipe();
                for k in &keys {
                    p.cmd("UNLINK").arg(k);
                }
                let replies: Vec<Value> = p.query(&mut conn).map_err(|e| server("UNLINK", e))?;
                deleted += replies
                    .iter()
                    .map(|v| match v {
                        Value::Int(n) => u64::try_from(*n).unwrap_or(0),
                        _ => 0,
                    })
                    .sum::<u64>();
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    tracing::info!(namespace, deleted, servers = %endpoint.display(), "redis namespace invalidated");
    Ok(deleted)
}
