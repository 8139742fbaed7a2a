//! A test double of Tair's TairString commands, as a Redis module: the `tair://` driver's tests
//! load it into Debian's `redis-server`, as the Kubernetes driver's tests talk to an in-memory
//! API server. It was written from Tair's public command reference, not from any TairString
//! source, and implements what the driver sends: `EXSET`, `EXGET`, `EXCAS` and `EXCAD`. Setting
//! `LEASEHOLD_TAIRSTRING_MODULE` runs the same suites against a real module instead.
//!
//! The rules it keeps, each tested through a plain Redis client in `tests/rules.rs`:
//!
//! 1. **Versions.** A key written where none was (or where one expired) starts at version 1;
//!    every write of an existing key raises its version by one; `ABS v` sets the version to
//!    `v` (at least 1) instead.
//! 2. **`EXSET key value [EX s|PX ms|EXAT s|PXAT ms|KEEPTTL] [NX|XX] [VER v|ABS v] [WITHVERSION]`**
//!    answers `OK`, or with `WITHVERSION` the new version. `NX` on an existing key and `XX` on
//!    an absent one write nothing and answer nil. `VER v` writes only where the key is absent,
//!    `v` is 0, or `v` is the key's version; otherwise it answers
//!    `ERR update version is stale` and writes nothing.
//! 3. **Expiry.** `EX`/`PX` count from the write, `EXAT`/`PXAT` are Unix times; 0, or a time
//!    already past, expires the key at once; `KEEPTTL` keeps the key's expiry; a write with
//!    none of them leaves the key without one. An expired key is absent to every command.
//! 4. **`EXGET key`** answers `[value, version]`, or nil where the key is absent.
//! 5. **`EXCAS key value version [EX s|PX ms|EXAT s|PXAT ms|KEEPTTL]`** compares the version
//!    alone (not the value): where it matches, it writes the value, raises the version and
//!    answers `["OK", "", new version]`; where it does not, it writes nothing and answers
//!    `["ERR update version is stale", value, version]`; an absent key answers -1. Expiry is
//!    as `EXSET`'s.
//! 6. **`EXCAD key version`** deletes the key where the version matches (1), answers 0 where it
//!    does not, and -1 where the key is absent.
//! 7. **Errors** are worded as Redis and Tair word them: `WRONGTYPE ...` for a key of another
//!    type (and plain commands answer it for these keys), `ERR syntax error` for unknown or
//!    conflicting options, `ERR value is not an integer` (a version or a time that is not one,
//!    or an `ABS` version below 1), and `ERR invalid expire time in 'exset' command` for a
//!    negative expiry.
//! 8. **Persistence and replication.** A key, its version and its expiry survive a restart from
//!    an RDB snapshot or from the append-only file, and reach replicas: every write goes to
//!    replicas and the append-only file as the state it produced (`EXSET key value ABS version`
//!    with `PXAT` or `KEEPTTL`), never as the relative command, so that a replica or a reload
//!    neither moves the version nor extends the expiry. A delete goes as `DEL`.

use std::ffi::{CString, c_int, c_void};
use std::time::Duration;

use redis_module::key::RedisKeyWritable;
use redis_module::native_types::RedisType;
use redis_module::{Context, RedisError, RedisResult, RedisString, RedisValue, raw, redis_module};

/// The value of a TairString key.
struct ExString {
    value: Vec<u8>,
    version: i64,
}

/// The type's name, as `TYPE` answers it (module type names have nine characters).
const TYPE_NAME: &str = "exstrtype";
/// The RDB encoding of [`ExString`]: the value, then the version.
const ENCODING: i32 = 0;

static EXSTRTYPE: RedisType = RedisType::new(
    TYPE_NAME,
    ENCODING,
    raw::RedisModuleTypeMethods {
        version: raw::REDISMODULE_TYPE_METHOD_VERSION as u64,
        rdb_load: Some(rdb_load),
        rdb_save: Some(rdb_save),
        aof_rewrite: Some(aof_rewrite),
        free: Some(free),
        mem_usage: None,
        digest: None,
        aux_load: None,
        aux_save: None,
        aux_save2: None,
        aux_save_triggers: 0,
        free_effort: None,
        unlink: None,
        copy: None,
        defrag: None,
        copy2: None,
        free_effort2: None,
        mem_usage2: None,
        unlink2: None,
    },
);

const STALE: &str = "ERR update version is stale";
const SYNTAX: &str = "ERR syntax error";
const NOT_AN_INTEGER: &str = "ERR value is not an integer";
const INVALID_EXPIRE: &str = "ERR invalid expire time in 'exset' command";

/// What a write does to the key's expiry.
#[derive(Clone, Copy, PartialEq)]
enum Expiry {
    /// No option: the key is left without one.
    Clear,
    /// `KEEPTTL`.
    Keep,
    /// `EX`, `PX`, `EXAT` or `PXAT`: until this Unix time in milliseconds.
    At(i64),
}

/// Which existing key a write applies to (`NX`, `XX`, or either).
#[derive(Clone, Copy, PartialEq)]
enum Presence {
    Any,
    Absent,
    Present,
}

/// How a write sets the version (`VER`, `ABS`, or one above the last).
#[derive(Clone, Copy, PartialEq)]
enum Versioning {
    Next,
    IfAt(i64),
    Absolute(i64),
}

/// The server's clock, in Unix milliseconds (the one its own expiry reads).
fn now_ms() -> i64 {
    // SAFETY: RedisModule_Milliseconds takes no arguments; the API is set up by the time a
    // command runs.
    unsafe { raw::RedisModule_Milliseconds.expect("RedisModule_Milliseconds")() }
}

fn integer(arg: &RedisString) -> Result<i64, RedisError> {
    std::str::from_utf8(arg.as_slice())
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(RedisError::Str(NOT_AN_INTEGER))
}

/// Reads an expiry option (`EX` and the rest) whose name is `option`, from the argument after
/// it; `None` when `option` is not one.
fn expiry_option(
    option: &str,
    args: &mut impl Iterator<Item = RedisString>,
) -> Result<Option<Expiry>, RedisError> {
    let (scale, absolute) = match option {
        "EX" => (1000, false),
        "PX" => (1, false),
        "EXAT" => (1000, true),
        "PXAT" => (1, true),
        "KEEPTTL" => return Ok(Some(Expiry::Keep)),
        _ => return Ok(None),
    };
    let amount = integer(&args.next().ok_or(RedisError::Str(SYNTAX))?)?;
    // 0 expires the key at once.
    if amount < 0 {
        return Err(RedisError::Str(INVALID_EXPIRE));
    }
    let ms = amount
        .checked_mul(scale)
        .ok_or(RedisError::Str(INVALID_EXPIRE))?;
    Ok(Some(Expiry::At(if absolute {
        ms
    } else {
        now_ms()
            .checked_add(ms)
            .ok_or(RedisError::Str(INVALID_EXPIRE))?
    })))
}

/// Sets `slot` once: a second option of the same group is a syntax error.
fn once<T>(slot: &mut Option<T>, value: T) -> Result<(), RedisError> {
    if slot.replace(value).is_some() {
        return Err(RedisError::Str(SYNTAX));
    }
    Ok(())
}

/// The key's value, or `None` where it is absent; a key of another type is `WRONGTYPE`.
fn existing(key: &RedisKeyWritable) -> Result<Option<&mut ExString>, RedisError> {
    key.get_value::<ExString>(&EXSTRTYPE)
        .map_err(|_| RedisError::WrongType)
}

/// Writes `value` at `version` with `expiry`, and sends the resulting state to replicas and the
/// append-only file.
fn store(
    ctx: &Context,
    key: &RedisKeyWritable,
    name: &RedisString,
    value: Vec<u8>,
    version: i64,
    expiry: Expiry,
) -> RedisResult<()> {
    if let Expiry::At(at) = expiry
        && at <= now_ms()
    {
        // Written and expired at once: nothing is left.
        if !key.is_empty() {
            key.delete()?;
        }
        ctx.replicate("DEL", &[name.as_slice()]);
        return Ok(());
    }
    match existing(key)? {
        // Changed in place, which keeps the key's expiry.
        Some(current) => {
            current.value.clone_from(&value);
            current.version = version;
        }
        None => key.set_value(
            &EXSTRTYPE,
            ExString {
                value: value.clone(),
                version,
            },
        )?,
    }
    match expiry {
        Expiry::At(at) => {
            key.set_expire(Duration::from_millis((at - now_ms()).max(1) as u64))?;
        }
        Expiry::Clear => {
            key.remove_expire()?;
        }
        Expiry::Keep => {}
    }
    let version_text = version.to_string();
    let mut propagated: Vec<&[u8]> = vec![
        name.as_slice(),
        &value,
        b"ABS".as_slice(),
        version_text.as_bytes(),
    ];
    let at_text;
    match expiry {
        Expiry::At(at) => {
            at_text = at.to_string();
            propagated.extend([b"PXAT".as_slice(), at_text.as_bytes()]);
        }
        Expiry::Keep => propagated.push(b"KEEPTTL"),
        Expiry::Clear => {}
    }
    ctx.replicate("EXSET", propagated.as_slice());
    Ok(())
}

/// The version after `current`, as a write of an existing key sets it.
fn next_version(current: i64) -> Result<i64, RedisError> {
    current
        .checked_add(1)
        .ok_or(RedisError::Str("ERR the version would overflow"))
}

/// `EXSET key value [EX s|PX ms|EXAT s|PXAT ms|KEEPTTL] [NX|XX] [VER v|ABS v] [WITHVERSION]`
fn exset(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    if args.len() < 3 {
        return Err(RedisError::WrongArity);
    }
    let mut args = args.into_iter().skip(1);
    let name = args.next().ok_or(RedisError::WrongArity)?;
    let value = args.next().ok_or(RedisError::WrongArity)?;
    let (mut expiry, mut presence, mut versioning) = (None, None, None);
    let mut with_version = false;
    while let Some(option) = args.next() {
        let option = option.to_string_lossy().to_ascii_uppercase();
        if let Some(chosen) = expiry_option(&option, &mut args)? {
            once(&mut expiry, chosen)?;
            continue;
        }
        match option.as_str() {
            "NX" => once(&mut presence, Presence::Absent)?,
            "XX" => once(&mut presence, Presence::Present)?,
            "VER" | "ABS" => {
                let v = integer(&args.next().ok_or(RedisError::Str(SYNTAX))?)?;
                let chosen = if option == "VER" {
                    if v < 0 {
                        return Err(RedisError::Str(NOT_AN_INTEGER));
                    }
                    Versioning::IfAt(v)
                } else {
                    if v < 1 {
                        return Err(RedisError::Str(NOT_AN_INTEGER));
                    }
                    Versioning::Absolute(v)
                };
                once(&mut versioning, chosen)?;
            }
            "WITHVERSION" => with_version = true,
            _ => return Err(RedisError::Str(SYNTAX)),
        }
    }
    let key = ctx.open_key_writable(&name);
    let current = existing(&key)?.map(|c| c.version);
    match (presence.unwrap_or(Presence::Any), current) {
        (Presence::Absent, Some(_)) | (Presence::Present, None) => return Ok(RedisValue::Null),
        _ => {}
    }
    let version = match (versioning.unwrap_or(Versioning::Next), current) {
        (Versioning::Absolute(v), _) => v,
        (Versioning::IfAt(v), Some(at)) if v != 0 && v != at => {
            return Err(RedisError::Str(STALE));
        }
        (_, Some(at)) => next_version(at)?,
        (_, None) => 1,
    };
    store(
        ctx,
        &key,
        &name,
        value.as_slice().to_vec(),
        version,
        expiry.unwrap_or(Expiry::Clear),
    )?;
    Ok(if with_version {
        RedisValue::Integer(version)
    } else {
        RedisValue::SimpleStringStatic("OK")
    })
}

/// `EXGET key`
fn exget(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let [_, name] = args.as_slice() else {
        return Err(RedisError::WrongArity);
    };
    let key = ctx.open_key(name);
    Ok(
        match key
            .get_value::<ExString>(&EXSTRTYPE)
            .map_err(|_| RedisError::WrongType)?
        {
            Some(current) => RedisValue::Array(vec![
                RedisValue::StringBuffer(current.value.clone()),
                RedisValue::Integer(current.version),
            ]),
            None => RedisValue::Null,
        },
    )
}

/// `EXCAS key value version [EX s|PX ms|EXAT s|PXAT ms|KEEPTTL]`
fn excas(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    if args.len() < 4 {
        return Err(RedisError::WrongArity);
    }
    let mut args = args.into_iter().skip(1);
    let name = args.next().ok_or(RedisError::WrongArity)?;
    let value = args.next().ok_or(RedisError::WrongArity)?;
    let expected = integer(&args.next().ok_or(RedisError::WrongArity)?)?;
    let mut expiry = None;
    while let Some(option) = args.next() {
        let option = option.to_string_lossy().to_ascii_uppercase();
        match expiry_option(&option, &mut args)? {
            Some(chosen) => once(&mut expiry, chosen)?,
            None => return Err(RedisError::Str(SYNTAX)),
        }
    }
    let key = ctx.open_key_writable(&name);
    let Some(current) = existing(&key)? else {
        return Ok(RedisValue::Integer(-1));
    };
    if current.version != expected {
        return Ok(RedisValue::Array(vec![
            RedisValue::SimpleStringStatic(STALE),
            RedisValue::StringBuffer(current.value.clone()),
            RedisValue::Integer(current.version),
        ]));
    }
    let version = next_version(current.version)?;
    store(
        ctx,
        &key,
        &name,
        value.as_slice().to_vec(),
        version,
        expiry.unwrap_or(Expiry::Clear),
    )?;
    Ok(RedisValue::Array(vec![
        RedisValue::SimpleStringStatic("OK"),
        RedisValue::StringBuffer(Vec::new()),
        RedisValue::Integer(version),
    ]))
}

/// `EXCAD key version`
fn excad(ctx: &Context, args: Vec<RedisString>) -> RedisResult {
    let [_, name, expected] = args.as_slice() else {
        return Err(RedisError::WrongArity);
    };
    let expected = integer(expected)?;
    let key = ctx.open_key_writable(name);
    let Some(current) = existing(&key)? else {
        return Ok(RedisValue::Integer(-1));
    };
    if current.version != expected {
        return Ok(RedisValue::Integer(0));
    }
    key.delete()?;
    ctx.replicate("DEL", &[name.as_slice()]);
    Ok(RedisValue::Integer(1))
}

unsafe extern "C" fn rdb_save(rdb: *mut raw::RedisModuleIO, value: *mut c_void) {
    // SAFETY: Redis hands back the pointer this module stored, an ExString.
    let value = unsafe { &*value.cast::<ExString>() };
    raw::save_slice(rdb, &value.value);
    raw::save_signed(rdb, value.version);
}

unsafe extern "C" fn rdb_load(rdb: *mut raw::RedisModuleIO, encver: c_int) -> *mut c_void {
    if encver != ENCODING {
        return std::ptr::null_mut();
    }
    let loaded = raw::load_string_buffer(rdb).and_then(|value| {
        Ok(ExString {
            value: value.as_ref().to_vec(),
            version: raw::load_signed(rdb)?,
        })
    });
    match loaded {
        Ok(value) => Box::into_raw(Box::new(value)).cast(),
        // A null value fails the load, as Redis expects of a short read.
        Err(_) => std::ptr::null_mut(),
    }
}

unsafe extern "C" fn aof_rewrite(
    aof: *mut raw::RedisModuleIO,
    key: *mut raw::RedisModuleString,
    value: *mut c_void,
) {
    // SAFETY: as in rdb_save; the key's expiry is written after this by Redis itself.
    let value = unsafe { &*value.cast::<ExString>() };
    let command = CString::new("EXSET").expect("no NUL");
    // s: the key, b: the value's bytes and length, c: a C string, l: a long long.
    let format = CString::new("sbcl").expect("no NUL");
    let abs = CString::new("ABS").expect("no NUL");
    // SAFETY: the arguments match the format string, as RedisModule_EmitAOF reads them.
    unsafe {
        raw::RedisModule_EmitAOF.expect("RedisModule_EmitAOF")(
            aof,
            command.as_ptr(),
            format.as_ptr(),
            key,
            value.value.as_ptr(),
            value.value.len(),
            abs.as_ptr(),
            value.version as std::ffi::c_longlong,
        );
    }
}

unsafe extern "C" fn free(value: *mut c_void) {
    // SAFETY: the pointer came from Box::into_raw of an ExString, and Redis frees it once.
    drop(unsafe { Box::from_raw(value.cast::<ExString>()) });
}

redis_module! {
    name: "tairstring-fake",
    version: 1,
    allocator: (redis_module::alloc::RedisAlloc, redis_module::alloc::RedisAlloc),
    data_types: [EXSTRTYPE],
    commands: [
        ["exset", exset, "write deny-oom", 1, 1, 1, ""],
        ["exget", exget, "readonly fast", 1, 1, 1, ""],
        ["excas", excas, "write deny-oom", 1, 1, 1, ""],
        ["excad", excad, "write fast", 1, 1, 1, ""],
    ],
}
