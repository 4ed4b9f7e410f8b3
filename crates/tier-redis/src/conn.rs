//! Connections to the server: one standalone connection or a cluster connection, behind one
//! pipelined interface, with the options' timeouts and credentials.

use std::time::Duration;

use redis::cluster::{ClusterClientBuilder, ClusterConnection, ClusterPipeline};
use redis::io::tcp::TcpSettings;
use redis::{
    Cmd, ConnectionInfo, ConnectionLike, ErrorKind, IntoConnectionInfo, Pipeline, RedisError, RedisResult,
    Value,
};

use crate::error::RedisTierError;
use crate::options::RedisTierOptions;
use crate::packed::PackedPipeline;

/// Where and how to connect: parsed URLs, credentials, timeouts.
#[derive(Clone)]
pub(crate) struct Endpoint {
    infos: Vec<ConnectionInfo>,
    cluster: bool,
    password: Option<String>,
    username: Option<String>,
    connect_timeout: Duration,
    io_timeout: Duration,
    /// The URLs without passwords, for messages.
    display: String,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("servers", &self.display)
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

/// `url` with any password replaced, for logs and errors.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://***@{}", &url[..scheme], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

impl Endpoint {
    /// Parses the options' URLs and resolves the password.
    ///
    /// # Errors
    /// A malformed URL (naming `url` or `urls`), a URL scheme this build cannot use, or a missing
    /// password variable.
    pub(crate) fn new(opts: &RedisTierOptions) -> Result<Self, RedisTierError> {
        let urls = opts.server_urls()?;
        // rustls needs a process-wide crypto provider; another crate may have installed one
        // already, which is fine.
        #[cfg(feature = "tls")]
        let _ = rustls::crypto::ring::default_provider().install_default();
        let key = if opts.url.is_some() { "url" } else { "urls" };
        let mut infos = Vec::with_capacity(urls.len());
        for u in &urls {
            let shown = redact(u);
            let info = u.as_str().into_connection_info().map_err(|e| {
                RedisTierError::InvalidOptions(format!(
                    "`{key}`: invalid Redis URL `{shown}`: {e} (expected redis://host:port[/db]{})",
                    if cfg!(feature = "tls") {
                        " or rediss://…"
                    } else {
                        "; TLS needs the `tls` feature"
                    }
                ))
            })?;
            infos.push(info);
        }
        Ok(Self {
            infos,
            cluster: opts.cluster,
            password: opts.password()?,
            username: opts.username.clone(),
            connect_timeout: opts.connect_timeout.get(),
            io_timeout: opts.io_timeout.get(),
            display: urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(", "),
        })
    }

    /// The servers, for messages.
    pub(crate) fn display(&self) -> &str {
        &self.display
    }

    /// Whether this is a cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster
    }

    fn with_credentials(&self, info: ConnectionInfo) -> ConnectionInfo {
        let mut settings = info.redis_settings().clone();
        if let Some(p) = &self.password {
            settings = settings.set_password(p);
        }
        if let Some(u) = &self.username {
            settings = settings.set_username(u);
        }
        info.set_redis_settings(settings)
    }

    /// Opens a standalone connection to `info` with the timeouts set.
    pub(crate) fn connect_node(&self, info: &ConnectionInfo) -> RedisResult<redis::Connection> {
        let client = redis::Client::open(with_nodelay(self.with_credentials(info.clone())))?;
        let conn = client.get_connection_with_timeout(self.connect_timeout)?;
        conn.set_read_timeout(Some(self.io_timeout))?;
        conn.set_write_timeout(Some(self.io_timeout))?;
        Ok(conn)
    }

    /// Opens a connection (standalone or cluster).
    pub(crate) fn connect(&self) -> RedisResult<Conn> {
        if !self.cluster {
            return Ok(Conn::Single(self.connect_node(&self.infos[0])?));
        }
        let mut builder = ClusterClientBuilder::new(self.infos.clone())
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.io_timeout)
            .tcp_settings(TcpSettings::default().set_nodelay(true))
            .retries(1);
        if let Some(p) = &self.password {
            builder = builder.password(p);
        }
        if let Some(u) = &self.username {
            builder = builder.username(u);
        }
        let conn = builder.build()?.get_connection()?;
        conn.set_read_timeout(Some(self.io_timeout))?;
        conn.set_write_timeout(Some(self.io_timeout))?;
        Ok(Conn::Cluster(Box::new(conn)))
    }

    /// Connects and pings every master, turning refused credentials into a clear error (used
    /// when the tier starts).
    pub(crate) fn check(&self) -> Result<(), RedisTierError> {
        let wrap = |what, e: RedisError| {
            if is_auth_error(&e) {
                RedisTierError::Auth {
                    url: self.display.clone(),
                    source: e,
                }
            } else {
                RedisTierError::Server {
                    url: self.display.clone(),
                    what,
                    source: e,
                }
            }
        };
        let masters = self.masters().map_err(|e| wrap("connecting", e))?;
        for m in &masters {
            let mut c = self.connect_node(m).map_err(|e| wrap("connecting", e))?;
            redis::cmd("PING")
                .query::<()>(&mut c)
                .map_err(|e| wrap("PING", e))?;
        }
        Ok(())
    }

    /// The servers holding data: the one server, or every master of the cluster (from
    /// `CLUSTER NODES` of the first seed that answers).
    pub(crate) fn masters(&self) -> RedisResult<Vec<ConnectionInfo>> {
        if !self.cluster {
            return Ok(vec![self.infos[0].clone()]);
        }
        let mut last = None;
        for seed in &self.infos {
            let nodes = self
                .connect_node(seed)
                .and_then(|mut c| redis::cmd("CLUSTER").arg("NODES").query::<String>(&mut c));
            match nodes {
                Ok(text) => return master_infos(seed, &text),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| RedisError::from((ErrorKind::Client, "no seed URL"))))
    }
}

/// Parses `CLUSTER NODES` output into the masters' connection infos (scheme and settings taken
/// from `seed`).
fn master_infos(seed: &ConnectionInfo, text: &str) -> RedisResult<Vec<ConnectionInfo>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(addr), Some(flags)) = (fields.get(1), fields.get(2)) else {
            continue;
        };
        if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
            continue;
        }
        let hostport = addr.split(['@', ',']).next().unwrap_or_default();
        let Some((host, port)) = hostport.rsplit_once(':') else {
            continue;
        };
        let Ok(port) = port.parse::<u16>() else {
            continue;
        };
        let addr = match seed.addr() {
            #[cfg(feature = "tls")]
            redis::ConnectionAddr::TcpTls {
                insecure, tls_params, ..
            } => redis::ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
        };
        out.push(seed.clone().set_addr(addr));
    }
    if out.is_empty() {
        return Err(RedisError::from((
            ErrorKind::Client,
            "CLUSTER NODES listed no master",
        )));
    }
    Ok(out)
}

/// Whether the server refused the credentials (wrong password, or one is required).
pub(crate) fn is_auth_error(e: &RedisError) -> bool {
    e.kind() == ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
        || e.to_string().contains("NOAUTH")
        || e.to_string().contains("WRONGPASS")
}

/// An open connection.
pub(crate) enum Conn {
    /// One server.
    Single(redis::Connection),
    /// A cluster (boxed: much larger than a connection).
    Cluster(Box<ClusterConnection>),
}

impl Conn {
    /// Whether this connection takes encoded commands ([`Conn::pipeline_packed`],
    /// [`Conn::send_packed`], [`Conn::recv`]): a standalone server. A cluster routes each
    /// command to its slot's master, so it takes them as separate commands only.
    pub(crate) fn takes_packed(&self) -> bool {
        matches!(self, Self::Single(_))
    }

    fn single(&mut self) -> RedisResult<&mut redis::Connection> {
        match self {
            Self::Single(c) => Ok(c),
            Self::Cluster(_) => Err(RedisError::from((
                ErrorKind::Client,
                "encoded commands need a standalone connection",
            ))),
        }
    }

    /// Sends already encoded commands as one pipeline and returns one reply per command (a
    /// failing command is a `Value::ServerError` in its place). Standalone only.
    pub(crate) fn pipeline_packed(&mut self, packed: &PackedPipeline) -> RedisResult<Vec<Value>> {
        if packed.commands() == 0 {
            return Ok(Vec::new());
        }
        self.single()?
            .req_packed_commands(packed.bytes(), 0, packed.commands())
    }

    /// Sends encoded commands without reading their replies (which [`Conn::recv`] reads, one
    /// per command, in order). Standalone only. A caller that stops before reading every reply
    /// must drop the connection: the next reply read would be a stale one.
    pub(crate) fn send_packed(&mut self, bytes: &[u8]) -> RedisResult<()> {
        self.single()?.send_packed_command(bytes)
    }

    /// Reads the next reply of commands sent with [`Conn::send_packed`]. Standalone only.
    pub(crate) fn recv(&mut self) -> RedisResult<Value> {
        self.single()?.recv_response()
    }

    /// Sends `cmds` as one pipeline and returns one reply per command. On a standalone server a
    /// failing command is a `Value::ServerError` in its place; in a cluster any failure fails
    /// the whole pipeline.
    pub(crate) fn pipeline(&mut self, cmds: Vec<Cmd>) -> RedisResult<Vec<Value>> {
        if cmds.is_empty() {
            return Ok(Vec::new());
        }
        match self {
            Self::Single(c) => {
                let mut p = Pipeline::with_capacity(cmds.len());
                p.ignore_errors();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
            Self::Cluster(c) => {
                let mut p = ClusterPipeline::with_capacity(cmds.len());
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
        }
    }
}

/// `info` with Nagle's algorithm off, as the tier's connections use it. A pipeline is written
/// whole (or in large slices) and then waits for its replies, so holding back a short last
/// segment until the server acknowledges the one before only adds latency; Redis turns Nagle
/// off on its side for the same reason.
#[must_use]
pub fn with_nodelay(info: ConnectionInfo) -> ConnectionInfo {
    let tcp = info.tcp_settings().clone().set_nodelay(true);
    info.set_tcp_settings(tcp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://:secret@host:1/0"), "redis://***@host:1/0");
        assert_eq!(redact("redis://host:1"), "redis://host:1");
    }

    #[test]
    fn malformed_urls_are_refused_naming_the_key() {
        for bad in ["not a url", "http://127.0.0.1:6379", "redis://127.0.0.1:notaport"] {
            let e = Endpoint::new(&RedisTierOptions::new(bad))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("`url`: invalid Redis URL"), "{bad}: {e}");
        }
    }

    #[test]
    fn cluster_nodes_output_yields_the_masters() {
        let seed = "redis://127.0.0.1:7000".into_connection_info().unwrap();
        let text = "a 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n\
                    b 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922\n\
                    c 127.0.0.1:7003@17003 slave b 0 0 2 connected\n\
                    d 127.0.0.1:7002@17002,host master,fail - 0 0 3 connected\n";
        let m = master_infos(&seed, text).unwrap();
        let addrs: Vec<String> = m.iter().map(|i| i.addr().to_string()).collect();
        assert_eq!(addrs, ["127.0.0.1:7000", "127.0.0.1:7001"]);
        assert!(master_infos(&seed, "").is_err());
    }
}
