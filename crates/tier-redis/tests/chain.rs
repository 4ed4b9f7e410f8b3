//! The `redis` tier type through chain files: registration, option errors located at
//! file:line:key, and a working chain.

mod common;

use common::{RedisServer, redis_installed};
use tiering_config::ChainConfig;
use tiering_core::registry::Registry;

// Link the primary tier type the chains use.
use tier_cpu as _;

fn build_error(text: &str) -> String {
    let chain = ChainConfig::parse("chain.toml", text).unwrap();
    match chain.build(Registry::global().unwrap(), 4096) {
        Ok(_) => panic!("the chain should not build"),
        Err(e) => e.to_string(),
    }
}

const HEAD: &str = "[primary]\ntype = \"cpu\"\ncapacity = \"1MiB\"\n\n[[secondary]]\ntype = \"redis\"\n";

#[test]
fn the_redis_type_is_registered() {
    let r = Registry::global().unwrap();
    let reg = r.get("redis").expect("tier-redis registers `redis`");
    assert_eq!(reg.factory.role(), "secondary");
}

#[test]
fn a_malformed_url_is_an_error_naming_file_line_and_key() {
    let text = format!("{HEAD}namespace = \"x\"\nurl = \"redis//127.0.0.1:6379\"\n");
    let e = build_error(&text);
    assert!(e.starts_with("chain.toml:8:"), "{e}");
    assert!(e.contains("key `url`"), "{e}");
    assert!(e.contains("invalid Redis URL"), "{e}");
}

#[test]
fn option_errors_name_their_key_and_line() {
    let e = build_error(&format!("{HEAD}url = \"redis://127.0.0.1:1\"\nworkers = 0\n"));
    assert!(
        e.starts_with("chain.toml:8:") && e.contains("key `workers`"),
        "{e}"
    );
    let e = build_error(&format!(
        "{HEAD}url = \"redis://127.0.0.1:1\"\npasword_env = \"X\"\n"
    ));
    assert!(e.starts_with("chain.toml:8:") && e.contains("pasword_env"), "{e}");
    let e = build_error(&format!(
        "{HEAD}url = \"redis://127.0.0.1:1\"\npassword_env = \"KVTIER_TEST_CHAIN_UNSET_PW\"\n"
    ));
    assert!(
        e.starts_with("chain.toml:8:") && e.contains("KVTIER_TEST_CHAIN_UNSET_PW"),
        "{e}"
    );
    let e = build_error(&format!(
        "{HEAD}namespace = \"a b\"\nurl = \"redis://127.0.0.1:1\"\n"
    ));
    assert!(
        e.starts_with("chain.toml:7:") && e.contains("key `namespace`"),
        "{e}"
    );
}

#[test]
fn a_chain_with_a_reachable_server_builds() {
    if !redis_installed() {
        return;
    }
    let server = RedisServer::start();
    let text = format!("{HEAD}url = \"{}\"\nnamespace = \"chain\"\n", server.url());
    let chain = ChainConfig::parse("chain.toml", &text).unwrap();
    let mut m = chain.build(Registry::global().unwrap(), 4096).unwrap();
    m.shutdown().unwrap();
}
