//! Whether a Redis master loses no acknowledged write in a crash: what decides if a restarted
//! or promoted server must wait out one lease before it grants a free lock.

use std::time::Duration;

use redis::Value;

use crate::drivers::redis::{info_field, passing};

/// The name a cluster's reading is cached under.
const CLUSTER: &str = "every master of the cluster";

/// How long a master's durability (as CONFIG tells it) is trusted before it is read again.
const DURABILITY_RECHECK: Duration = Duration::from_secs(60);

/// Whether a master loses no acknowledged write in a crash (`appendonly yes` with `appendfsync
/// always`, and `no-appendfsync-on-rewrite no`: [`durable_settings`]), read through CONFIG at most once a [`DURABILITY_RECHECK`] per master, together with
/// the incarnations it was read on ([`Reading::on`]): a setting made by `CONFIG SET` alone is
/// gone after a restart, so a reading says nothing of the server's next incarnation, and the
/// epoch check refuses to count a new incarnation as durable on it
/// ([`crate::drivers::redis::DURABILITY_UNREAD`]); the caller then reads again
/// ([`Durability::read`]). Where CONFIG is renamed or forbidden (managed services), a master
/// counts as not durable. Where it cannot be asked yet (the connection failed, the server is
/// still loading its data), nothing is concluded or remembered: the caller's call fails and is
/// retried (on one master, as the acquisition itself would; a cluster's masters are another
/// matter: [`Durability::of_cluster`]). Counting such a master as not durable would make its
/// first acquisition record a new epoch, and a durable server that was only starting would
/// then grant no free lock for a whole lease.
#[derive(Default)]
pub(crate) struct Durability {
    checked: std::sync::Mutex<Option<(std::time::Instant, String, Reading)>>,
}

/// A master's durability, and the incarnations it holds for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Reading {
    pub(crate) durable: bool,
    /// The replication IDs (`master_replid`, new at every start and promotion) of the servers
    /// read, comma-separated, each read before their settings: a server restarted between the
    /// two is named by its earlier incarnation, so its reading is not taken for the new one's.
    /// Empty where `INFO` is refused (the epoch check then guards nothing either). A leading
    /// `!` marks a reading made for a retry ([`Reading::settled`]).
    pub(crate) on: String,
}

impl Reading {
    /// This reading, made just now because the epoch check met an incarnation the one before
    /// did not list, as the last word: an incarnation it does not list either (restarted again
    /// meanwhile, or down when read) counts as not durable, rather than asking for yet another
    /// reading.
    pub(crate) fn settled(self) -> Reading {
        Reading {
            on: format!("!{}", self.on.trim_start_matches('!')),
            ..self
        }
    }
}

impl Durability {
    pub(crate) async fn of(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        master: &str,
    ) -> redis::RedisResult<Reading> {
        if let Some(reading) = self.cached(master) {
            return Ok(reading);
        }
        self.read(conn, master).await
    }

    /// [`Durability::of`], or where `fresh` a reading made now and settled
    /// ([`Reading::settled`]): the retry after the epoch check met an incarnation the cached
    /// reading does not list.
    pub(crate) async fn of_or_fresh(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        master: &str,
        fresh: bool,
    ) -> redis::RedisResult<Reading> {
        match fresh {
            true => self.read(conn, master).await.map(Reading::settled),
            false => self.of(conn, master).await,
        }
    }

    /// [`Durability::of_cluster`], or where `fresh` a reading made now and settled.
    pub(crate) async fn of_cluster_or_fresh(
        &self,
        conn: &mut redis::cluster_async::ClusterConnection,
        fresh: bool,
    ) -> Reading {
        match fresh {
            true => self.read_cluster(conn).await.settled(),
            false => self.of_cluster(conn).await,
        }
    }

    /// [`Durability::of_cluster`] read now, whatever is cached.
    pub(crate) async fn read_cluster(
        &self,
        conn: &mut redis::cluster_async::ClusterConnection,
    ) -> Reading {
        let reading = crate::drivers::redis::cluster::durable_masters(conn).await;
        self.remember(CLUSTER, reading)
    }

    /// [`Durability::of`] read now, whatever is cached: for a server met for the first time
    /// (a new incarnation), which the answer cached for the one before says nothing of. A read
    /// now, not a cache forgotten: a reading under way since before the restart, remembered
    /// after, would be taken again.
    pub(crate) async fn read(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        master: &str,
    ) -> redis::RedisResult<Reading> {
        let replication = redis::cmd("INFO")
            .arg("replication")
            .query_async::<Value>(conn)
            .await
            .and_then(Value::extract_error);
        let on = match replication {
            Ok(info) => redis::from_redis_value::<String>(info)
                .ok()
                .and_then(|info| info_field(&info, "master_replid").map(str::to_owned))
                .unwrap_or_default(),
            Err(e) if passing(&e) => return Err(e),
            Err(_) => String::new(),
        };
        let mut setting = async |name: &str| {
            config_value(
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async(conn)
                    .await,
            )
        };
        let durable = durable_settings(
            setting("appendonly").await?.as_deref(),
            setting("appendfsync").await?.as_deref(),
            setting("no-appendfsync-on-rewrite").await?.as_deref(),
        );
        Ok(self.remember(master, Reading { durable, on }))
    }

    /// Which masters of a Redis Cluster are durable (a lock's slot may move to any; see
    /// [`crate::drivers::redis::cluster::durable_masters`]).
    pub(crate) async fn of_cluster(
        &self,
        conn: &mut redis::cluster_async::ClusterConnection,
    ) -> Reading {
        match self.cached(CLUSTER) {
            Some(reading) => reading,
            None => self.read_cluster(conn).await,
        }
    }

    fn cached(&self, master: &str) -> Option<Reading> {
        match &*self.checked.lock().expect("durability") {
            Some((at, of, reading)) if of == master && at.elapsed() < DURABILITY_RECHECK => {
                Some(reading.clone())
            }
            _ => None,
        }
    }

    fn remember(&self, master: &str, reading: Reading) -> Reading {
        *self.checked.lock().expect("durability") = Some((
            std::time::Instant::now(),
            master.to_owned(),
            reading.clone(),
        ));
        reading
    }
}

/// Whether settings read off one server lose no acknowledged write in a crash: every write
/// appended to the AOF and synced before it is answered, also while a child rewrites the AOF or
/// saves a snapshot (`no-appendfsync-on-rewrite yes` skips the sync meanwhile, as
/// `appendfsync no` would). A setting not told counts against.
pub(crate) fn durable_settings(
    appendonly: Option<&str>,
    appendfsync: Option<&str>,
    no_appendfsync_on_rewrite: Option<&str>,
) -> bool {
    appendonly == Some("yes")
        && appendfsync == Some("always")
        && no_appendfsync_on_rewrite == Some("no")
}

/// A setting's value from one server's answer to `CONFIG GET`: `None` where the command is
/// refused for good (renamed, unknown, or not permitted to this user), and the error itself where
/// the answer is only not to be had yet (see [`passing`]).
fn config_value(answer: redis::RedisResult<Value>) -> redis::RedisResult<Option<String>> {
    match answer.and_then(Value::extract_error) {
        Ok(pair) => Ok(redis::from_redis_value::<Vec<String>>(pair)
            .ok()
            .and_then(|pair| pair.into_iter().nth(1))),
        Err(e) if passing(&e) => Err(e),
        Err(_) => Ok(None),
    }
}
