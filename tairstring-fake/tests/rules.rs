//! Each rule the TairString test double keeps (its crate documentation lists them), driven
//! through a plain Redis client against `redis-server` with the module loaded.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use leasehold_testkit::RedisServer;
use leasehold_testkit::redis_server::{field, info};
use redis::{Connection, Value};

fn connect(server: &RedisServer) -> Connection {
    redis::Client::open(server.plain_url())
        .expect("client")
        .get_connection()
        .expect("connect")
}

/// The server's answer to `args`, an error reply included (as `Err` with its text).
fn call(conn: &mut Connection, args: &[&str]) -> Result<Value, String> {
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    command.query::<Value>(conn).map_err(|e| {
        format!(
            "{} {}",
            e.code().unwrap_or("?"),
            e.detail().unwrap_or_default()
        )
    })
}

fn ok(conn: &mut Connection, args: &[&str]) -> Value {
    call(conn, args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn int(conn: &mut Connection, args: &[&str]) -> i64 {
    match ok(conn, args) {
        Value::Int(n) => n,
        other => panic!("{args:?} answered {other:?}, not an integer"),
    }
}

fn bulk(text: &str) -> Value {
    Value::BulkString(text.as_bytes().to_vec())
}

/// `EXGET`'s answer for `value` at `version`.
fn held(value: &str, version: i64) -> Value {
    Value::Array(vec![bulk(value), Value::Int(version)])
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

#[test]
fn a_new_key_starts_at_version_one_and_each_write_raises_it_by_one() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    assert_eq!(ok(&mut c, &["EXSET", "k", "a"]), Value::Okay);
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("a", 1));
    assert_eq!(int(&mut c, &["EXSET", "k", "b", "WITHVERSION"]), 2);
    assert_eq!(
        ok(&mut c, &["EXCAS", "k", "c", "2"]),
        Value::Array(vec![Value::Okay, bulk(""), Value::Int(3)])
    );
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("c", 3));
    // Deleted and written again: a new key, at version 1.
    assert_eq!(int(&mut c, &["EXCAD", "k", "3"]), 1);
    assert_eq!(int(&mut c, &["EXSET", "k", "d", "WITHVERSION"]), 1);
    assert_eq!(
        ok(&mut c, &["TYPE", "k"]),
        Value::SimpleString("exstrtype".into())
    );
}

#[test]
fn abs_sets_the_version() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    assert_eq!(
        int(
            &mut c,
            &["EXSET", "k", "a", "ABS", "4294967296", "WITHVERSION"]
        ),
        4294967296
    );
    assert_eq!(int(&mut c, &["EXSET", "k", "b", "WITHVERSION"]), 4294967297);
    // Lower than the key's version too.
    assert_eq!(
        int(&mut c, &["EXSET", "k", "c", "ABS", "7", "WITHVERSION"]),
        7
    );
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("c", 7));
    for bad in ["0", "-3", "x"] {
        assert_eq!(
            call(&mut c, &["EXSET", "k", "d", "ABS", bad]),
            Err("ERR value is not an integer".into()),
            "ABS {bad}"
        );
    }
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("c", 7));
}

#[test]
fn nx_writes_only_an_absent_key_and_xx_only_an_existing_one() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    assert_eq!(int(&mut c, &["EXSET", "k", "a", "NX", "WITHVERSION"]), 1);
    assert_eq!(
        ok(&mut c, &["EXSET", "k", "b", "NX", "WITHVERSION"]),
        Value::Nil
    );
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("a", 1));
    assert_eq!(ok(&mut c, &["EXSET", "absent", "b", "XX"]), Value::Nil);
    assert_eq!(ok(&mut c, &["EXGET", "absent"]), Value::Nil);
    assert_eq!(int(&mut c, &["EXSET", "k", "b", "XX", "WITHVERSION"]), 2);
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("b", 2));
}

#[test]
fn ver_writes_only_at_the_keys_version() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    ok(&mut c, &["EXSET", "k", "a"]);
    assert_eq!(
        call(&mut c, &["EXSET", "k", "b", "VER", "2"]),
        Err("ERR update version is stale".into())
    );
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("a", 1));
    assert_eq!(
        int(&mut c, &["EXSET", "k", "b", "VER", "1", "WITHVERSION"]),
        2
    );
    // VER 0 skips the check; an absent key has nothing to check.
    assert_eq!(
        int(&mut c, &["EXSET", "k", "c", "VER", "0", "WITHVERSION"]),
        3
    );
    assert_eq!(
        int(&mut c, &["EXSET", "new", "a", "VER", "5", "WITHVERSION"]),
        1
    );
}

#[test]
fn excas_compares_the_version_alone() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    ok(&mut c, &["EXSET", "k", "a"]);
    let stale = |value: &str, version: i64| {
        Value::Array(vec![
            Value::SimpleString("ERR update version is stale".into()),
            bulk(value),
            Value::Int(version),
        ])
    };
    // The same value under another version: refused.
    assert_eq!(ok(&mut c, &["EXCAS", "k", "a", "2"]), stale("a", 1));
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("a", 1));
    // Another value under the key's version: written.
    assert_eq!(
        ok(&mut c, &["EXCAS", "k", "z", "1"]),
        Value::Array(vec![Value::Okay, bulk(""), Value::Int(2)])
    );
    assert_eq!(ok(&mut c, &["EXCAS", "k", "y", "1"]), stale("z", 2));
    assert_eq!(int(&mut c, &["EXCAS", "absent", "a", "1"]), -1);
    assert_eq!(ok(&mut c, &["EXGET", "absent"]), Value::Nil);
}

#[test]
fn excad_deletes_only_at_the_keys_version() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    ok(&mut c, &["EXSET", "k", "a"]);
    assert_eq!(int(&mut c, &["EXCAD", "k", "2"]), 0);
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("a", 1));
    assert_eq!(int(&mut c, &["EXCAD", "k", "1"]), 1);
    assert_eq!(int(&mut c, &["EXISTS", "k"]), 0);
    assert_eq!(int(&mut c, &["EXCAD", "k", "1"]), -1);
}

#[test]
fn an_expired_key_is_absent_to_every_command_and_starts_again_at_version_one() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    assert_eq!(
        int(
            &mut c,
            &["EXSET", "k", "a", "PX", "150", "ABS", "40", "WITHVERSION"]
        ),
        40
    );
    let pttl = int(&mut c, &["PTTL", "k"]);
    assert!((1..=150).contains(&pttl), "PTTL {pttl}");
    std::thread::sleep(Duration::from_millis(250));
    assert_eq!(ok(&mut c, &["EXGET", "k"]), Value::Nil);
    assert_eq!(int(&mut c, &["EXCAS", "k", "b", "40"]), -1);
    assert_eq!(int(&mut c, &["EXCAD", "k", "40"]), -1);
    assert_eq!(ok(&mut c, &["EXSET", "k", "b", "XX"]), Value::Nil);
    assert_eq!(int(&mut c, &["EXSET", "k", "b", "NX", "WITHVERSION"]), 1);
}

#[test]
fn expiry_options_set_keep_or_clear_the_keys_expiry() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    let pttl = |c: &mut Connection| int(c, &["PTTL", "k"]);

    ok(&mut c, &["EXSET", "k", "a", "EX", "100"]);
    assert!((99_000..=100_000).contains(&pttl(&mut c)));
    let at = (unix_ms() + 50_000).to_string();
    ok(&mut c, &["EXSET", "k", "a", "PXAT", &at]);
    assert!((48_000..=50_000).contains(&pttl(&mut c)));
    let at_s = (unix_ms() / 1000 + 70).to_string();
    ok(&mut c, &["EXSET", "k", "a", "EXAT", &at_s]);
    assert!((68_000..=70_000).contains(&pttl(&mut c)));
    ok(&mut c, &["EXSET", "k", "b", "KEEPTTL"]);
    assert!((60_000..=70_000).contains(&pttl(&mut c)));
    ok(&mut c, &["EXSET", "k", "c"]);
    assert_eq!(pttl(&mut c), -1, "a write without an expiry clears it");

    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("c", 5));
    ok(&mut c, &["EXCAS", "k", "d", "5", "PX", "30000"]);
    assert!((28_000..=30_000).contains(&pttl(&mut c)));
    ok(&mut c, &["EXCAS", "k", "e", "6", "KEEPTTL"]);
    assert!((28_000..=30_000).contains(&pttl(&mut c)));
    ok(&mut c, &["EXCAS", "k", "f", "7"]);
    assert_eq!(pttl(&mut c), -1);
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("f", 8));

    // 0, or a Unix time already past: written and gone at once.
    let past = (unix_ms() - 1000).to_string();
    for expired in [
        &["PXAT", past.as_str()][..],
        &["PX", "0"],
        &["EX", "0"],
        &["EXAT", "0"],
    ] {
        let mut args = vec!["EXSET", "k", "g"];
        args.extend(expired);
        assert_eq!(ok(&mut c, &args), Value::Okay, "{args:?}");
        assert_eq!(int(&mut c, &["EXISTS", "k"]), 0, "{args:?}");
        ok(&mut c, &["EXSET", "k", "h"]);
    }
}

#[test]
fn errors_are_worded_as_redis_and_tair_word_them() {
    let server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    ok(&mut c, &["SET", "plain", "x"]);
    ok(&mut c, &["EXSET", "k", "a"]);
    let wrongtype = Err("WRONGTYPE Operation against a key holding the wrong kind of value".into());
    assert_eq!(call(&mut c, &["EXSET", "plain", "a"]), wrongtype);
    assert_eq!(call(&mut c, &["EXGET", "plain"]), wrongtype);
    assert_eq!(call(&mut c, &["EXCAS", "plain", "a", "1"]), wrongtype);
    assert_eq!(call(&mut c, &["EXCAD", "plain", "1"]), wrongtype);
    assert_eq!(call(&mut c, &["GET", "k"]), wrongtype);
    assert_eq!(ok(&mut c, &["GET", "plain"]), bulk("x"));

    let syntax = Err("ERR syntax error".into());
    for args in [
        &["EXSET", "k", "a", "NX", "XX"][..],
        &["EXSET", "k", "a", "PX", "10", "EX", "10"],
        &["EXSET", "k", "a", "PX", "10", "KEEPTTL"],
        &["EXSET", "k", "a", "VER", "1", "ABS", "2"],
        &["EXSET", "k", "a", "SOMETIMES"],
        &["EXSET", "k", "a", "PX"],
        &["EXCAS", "k", "a", "1", "NX"],
    ] {
        assert_eq!(call(&mut c, args), syntax, "{args:?}");
    }
    let expire = Err("ERR invalid expire time in 'exset' command".into());
    assert_eq!(call(&mut c, &["EXSET", "k", "a", "PX", "-1"]), expire);
    assert_eq!(call(&mut c, &["EXSET", "k", "a", "EX", "-1"]), expire);
    let integer = Err("ERR value is not an integer".into());
    assert_eq!(call(&mut c, &["EXSET", "k", "a", "PX", "soon"]), integer);
    assert_eq!(call(&mut c, &["EXCAD", "k", "one"]), integer);
    for args in [
        &["EXSET", "k"][..],
        &["EXGET"],
        &["EXCAS", "k", "a"],
        &["EXCAD", "k"],
    ] {
        let refused = call(&mut c, args).expect_err("wrong arity");
        assert!(
            refused.starts_with("ERR wrong number of arguments"),
            "{args:?}: {refused}"
        );
    }
    // Nothing refused was written.
    assert_eq!(ok(&mut c, &["EXGET", "k"]), held("a", 1));
    assert_eq!(int(&mut c, &["PTTL", "k"]), -1);
}

/// A key with no expiry at `version`, and one that expires in a minute, written through both
/// commands that write.
fn write_state(c: &mut Connection) {
    ok(c, &["EXSET", "kept", "a", "ABS", "8589934592"]);
    ok(c, &["EXCAS", "kept", "b", "8589934592"]);
    ok(c, &["EXSET", "expiring", "c", "PX", "60000"]);
}

fn assert_state(c: &mut Connection, after: &str) {
    assert_eq!(ok(c, &["EXGET", "kept"]), held("b", 8589934593), "{after}");
    assert_eq!(int(c, &["PTTL", "kept"]), -1, "{after}");
    assert_eq!(ok(c, &["EXGET", "expiring"]), held("c", 1), "{after}");
    let pttl = int(c, &["PTTL", "expiring"]);
    assert!((1..=60_000).contains(&pttl), "{after}: PTTL {pttl}");
}

#[test]
fn keys_versions_and_expiry_survive_a_restart_from_a_snapshot() {
    let mut server = RedisServer::start_tair_with(false);
    let mut c = connect(&server);
    write_state(&mut c);
    ok(&mut c, &["SAVE"]);
    server.restart();
    assert_state(&mut connect(&server), "a restart from dump.rdb");
}

#[test]
fn keys_versions_and_expiry_survive_a_restart_from_the_append_only_file() {
    let mut server = RedisServer::start_tair();
    let mut c = connect(&server);
    write_state(&mut c);
    // Relative expiries are written to the file as Unix times: a key that expired while the
    // server was down is not given its lease again by the reload.
    ok(&mut c, &["EXSET", "lapsed", "d", "PX", "300"]);
    ok(&mut c, &["EXCAS", "lapsed", "e", "1", "PX", "300"]);
    server.kill();
    std::thread::sleep(Duration::from_millis(500));
    server.restart();
    let mut c = connect(&server);
    assert_state(&mut c, "a restart from the append-only file's commands");
    assert_eq!(ok(&mut c, &["EXGET", "lapsed"]), Value::Nil);

    // The file rewritten as commands (not an RDB preamble): the module writes each key.
    ok(&mut c, &["CONFIG", "SET", "aof-use-rdb-preamble", "no"]);
    ok(&mut c, &["BGREWRITEAOF"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while field(
        &info(server.port(), "persistence"),
        "aof_rewrite_in_progress",
    ) != Some("0")
        || field(&info(server.port(), "persistence"), "aof_rewrite_scheduled") != Some("0")
    {
        assert!(Instant::now() < deadline, "the rewrite did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        field(
            &info(server.port(), "persistence"),
            "aof_last_bgrewrite_status"
        ),
        Some("ok")
    );
    server.restart();
    assert_state(&mut connect(&server), "a restart from the rewritten file");
}

#[test]
fn writes_reach_replicas_as_the_state_they_produced() {
    let master = RedisServer::start_tair();
    let replica = RedisServer::start_tair_replica_of(master.port());
    replica.wait_until_synced();
    let mut m = connect(&master);
    let mut r = connect(&replica);
    write_state(&mut m);
    ok(&mut m, &["EXSET", "gone", "x"]);
    ok(&mut m, &["EXCAD", "gone", "1"]);
    assert_eq!(int(&mut m, &["WAIT", "1", "10000"]), 1);
    assert_state(&mut r, "replication");
    assert_eq!(int(&mut r, &["EXISTS", "gone"]), 0);
    // A replica takes no writes of its own.
    assert_eq!(
        call(&mut r, &["EXSET", "kept", "z"]),
        Err("READONLY You can't write against a read only replica.".into())
    );
}
