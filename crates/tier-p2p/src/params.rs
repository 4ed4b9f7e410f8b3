//! The request's transfer parameters that concern the p2p tier, parsed once per request and
//! cached in the request context.
//!
//! - `remote_kv_source = {kv_request_id, host, port}`: probe that peer per chunk, pull the hits;
//! - `remote_prefiller = {kv_request_id, host, port}`: pull every chunk from that peer without
//!   probing (the prefill/decode split);
//! - `remote_decoder = {kv_request_id}`: park this request's stored chunks for whoever fetches
//!   that id.

use serde_json::Value;
use tiering_core::ReqContext;

/// Where a consumer pulls from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    pub(crate) kv_request_id: String,
    pub(crate) peer: String,
    /// No probing: every lookup is a hit (`remote_prefiller`).
    pub(crate) eager: bool,
}

/// The parsed parameters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct P2pParams {
    pub(crate) source: Option<Source>,
    /// `Some(None)`: a `remote_decoder` block without a usable id (stores then fail rather
    /// than silently staying local).
    pub(crate) decoder: Option<Option<String>>,
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn source(v: &Value, eager: bool) -> Option<Source> {
    let id = text(v.get("kv_request_id")?)?;
    let host = text(v.get("host").or_else(|| v.get("remote_host"))?)?;
    let port = text(v.get("port").or_else(|| v.get("remote_port"))?)?;
    port.parse::<u16>().ok()?;
    Some(Source {
        kv_request_id: id,
        peer: format!("{host}:{port}"),
        eager,
    })
}

fn parse(ctx: &ReqContext) -> P2pParams {
    let p = ctx.params();
    let source = p
        .get("remote_kv_source")
        .and_then(|v| source(v, false))
        .or_else(|| p.get("remote_prefiller").and_then(|v| source(v, true)));
    let decoder = p
        .get("remote_decoder")
        .map(|v| v.get("kv_request_id").and_then(text));
    P2pParams { source, decoder }
}

/// The request's parameters (parsed on first use, then cached in the context).
pub(crate) fn params(ctx: &ReqContext) -> P2pParams {
    ctx.with_state(|| parse(ctx), |p: &mut P2pParams| p.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tiering_core::RequestId;

    fn ctx(v: Value) -> ReqContext {
        let Value::Object(m) = v else { panic!() };
        ReqContext::builder(RequestId::local("r")).params(m).build()
    }

    #[test]
    fn sources_and_decoder_are_parsed() {
        let c = ctx(json!({"remote_kv_source": {"kv_request_id": "k", "host": "127.0.0.1", "port": 7}}));
        assert_eq!(
            params(&c).source,
            Some(Source {
                kv_request_id: "k".into(),
                peer: "127.0.0.1:7".into(),
                eager: false
            })
        );
        let c =
            ctx(json!({"remote_prefiller": {"kv_request_id": "k", "remote_host": "h", "remote_port": "9"}}));
        assert!(params(&c).source.unwrap().eager);
        let c = ctx(json!({"remote_decoder": {"kv_request_id": "d"}}));
        assert_eq!(params(&c).decoder, Some(Some("d".into())));
        let c = ctx(json!({"remote_decoder": {}}));
        assert_eq!(params(&c).decoder, Some(None));
    }

    #[test]
    fn incomplete_sources_are_ignored() {
        let c = ctx(json!({"remote_kv_source": {"kv_request_id": "k", "host": "h"}}));
        assert_eq!(params(&c).source, None);
        let c = ctx(json!({"remote_kv_source": {"kv_request_id": "k", "host": "h", "port": "x"}}));
        assert_eq!(params(&c).source, None);
        assert_eq!(params(&ReqContext::local("x")), P2pParams::default());
    }
}
