//! The server's `INFO` figures the tier reports: memory in use, the memory limit, keys evicted
//! by the server, and keys stored — summed over every master of a cluster.

use crate::conn::Endpoint;

/// Figures from `INFO`, summed over the masters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerFigures {
    /// `used_memory`, bytes.
    pub used_memory: u64,
    /// `maxmemory`, bytes (0: no limit).
    pub maxmemory: u64,
    /// `evicted_keys`: keys the server evicted to stay under `maxmemory`.
    pub evicted_keys: u64,
    /// Keys in every database (`keys=` of the keyspace section).
    pub keys: u64,
}

/// Asks every master for `INFO` (short-lived connections: this runs every few seconds).
///
/// # Errors
/// A master could not be reached or answered with an error.
pub(crate) fn fetch(endpoint: &Endpoint) -> redis::RedisResult<ServerFigures> {
    let mut total = ServerFigures::default();
    for m in endpoint.masters()? {
        let mut c = endpoint.connect_node(&m)?;
        let text: String = redis::cmd("INFO").query(&mut c)?;
        let f = parse(&text);
        total.used_memory += f.used_memory;
        total.maxmemory += f.maxmemory;
        total.evicted_keys += f.evicted_keys;
        total.keys += f.keys;
    }
    Ok(total)
}

/// Reads the figures out of one server's `INFO` text; absent fields are 0.
pub(crate) fn parse(text: &str) -> ServerFigures {
    let mut f = ServerFigures::default();
    for line in text.lines() {
        let Some((name, value)) = line.trim().split_once(':') else {
            continue;
        };
        let number = || value.trim().parse::<u64>().unwrap_or(0);
        match name {
            "used_memory" => f.used_memory = number(),
            "maxmemory" => f.maxmemory = number(),
            "evicted_keys" => f.evicted_keys = number(),
            db if db.starts_with("db") => {
                let keys = value
                    .split(',')
                    .find_map(|kv| kv.strip_prefix("keys="))
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
                f.keys += keys;
            }
            _ => {}
        }
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_text_is_parsed() {
        let text = "# Memory\r\nused_memory:1024\r\nused_memory_human:1K\r\nmaxmemory:4096\r\n\
                    # Stats\r\nevicted_keys:7\r\n# Keyspace\r\ndb0:keys=3,expires=0,avg_ttl=0\r\n\
                    db1:keys=2,expires=0,avg_ttl=0\r\n";
        assert_eq!(
            parse(text),
            ServerFigures {
                used_memory: 1024,
                maxmemory: 4096,
                evicted_keys: 7,
                keys: 5
            }
        );
        assert_eq!(parse("garbage"), ServerFigures::default());
    }
}
