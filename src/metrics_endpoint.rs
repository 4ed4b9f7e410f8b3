//! The Prometheus endpoint of `kvtier run` and `kvtier peer`: the libraries record through the
//! `metrics` facade, and this installs the exporter that serves them as Prometheus text over
//! HTTP (`GET /metrics` or any path).

use std::net::SocketAddr;

use anyhow::{Context, Result};
use metrics_exporter_prometheus::PrometheusBuilder;

/// Histogram buckets in seconds, from a microsecond (a lookup, a lock hold) to ten seconds (a
/// stalled disk job), so quantiles can be computed across nodes.
const SECONDS_BUCKETS: &[f64] = &[
    1e-6, 4e-6, 16e-6, 64e-6, 256e-6, 1e-3, 4e-3, 16e-3, 64e-3, 0.256, 1.0, 4.0, 10.0,
];

/// Starts serving the metrics at `addr`. Call it before building the manager: the manager
/// registers its hot-path handles when it is built.
///
/// # Errors
/// The address cannot be bound, or a recorder is already installed.
pub fn serve(addr: SocketAddr) -> Result<()> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(SECONDS_BUCKETS)
        .context("invalid histogram buckets")?
        .install()
        .with_context(|| format!("cannot serve metrics on {addr}"))?;
    tracing::info!(%addr, "serving Prometheus metrics");
    Ok(())
}
