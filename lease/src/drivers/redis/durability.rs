//! Whether a Redis master loses no acknowledged write in a crash: what decides if a restarted
//! or promoted server must wait out one lease before it grants a free lock.

use std::time::Duration;

use redis::Value;

use crate::drivers::redis::passing;

/// How long a master's durability (as CONFIG tells it) is trusted before it is read again.
const DURABILITY_RECHECK: Duration = Duration::from_secs(60);

/// Whether a master loses no acknowledged write in a crash (`appendonly yes` with `appendfsync
/// always`), read through CONFIG at most once a [`DURABILITY_RECHECK`] per master. Where CONFIG
/// is renamed or forbidden (managed services), a master counts as not durable. Where it cannot
/// be asked yet (the connection failed, the server is still loading its data), nothing is
/// concluded or remembered: the caller's call fails and is retried (on one master, as the
/// acquisition itself would; a cluster's masters are another matter: [`Durability::of_cluster`]). Counting such a master as
/// not durable would make its first acquisition record a new epoch, and a durable server that
/// was only starting would then grant no free lock for a whole lease.
#[derive(Default)]
pub(crate) struct Durability {
    checked: std::sync::Mutex<Option<(std::time::Instant, String, bool)>>,
}

impl Durability {
    pub(crate) async fn of(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        master: &str,
    ) -> redis::RedisResult<bool> {
        if let Some(durable) = self.cached(master) {
            return Ok(durable);
        }
        self.read(conn, master).await
    }

    /// [`Durability::of`] read now, whatever is cached: for a server met for the first time
    /// (a new incarnation), which the answer cached for the one before says nothing of.
    pub(crate) async fn read(
        &self,
        conn: &mut (impl redis::aio::ConnectionLike + Send),
        master: &str,
    ) -> redis::RedisResult<bool> {
        let mut setting = async |name: &str| {
            config_value(
                redis::cmd("CONFIG")
                    .arg("GET")
                    .arg(name)
                    .query_async(conn)
                    .await,
            )
        };
        let durable = setting("appendonly").await?.as_deref() == Some("yes")
            && setting("appendfsync").await?.as_deref() == Some("always");
        Ok(self.remember(master, durable))
    }

    /// Whether every master of a Redis Cluster is durable (a lock's slot may move to any; see
    /// [`crate::drivers::redis::cluster::every_master_durable`] for a master that cannot answer).
    pub(crate) async fn of_cluster(
        &self,
        conn: &mut redis::cluster_async::ClusterConnection,
    ) -> bool {
        const CLUSTER: &str = "every master of the cluster";
        if let Some(durable) = self.cached(CLUSTER) {
            return durable;
        }
        let durable = crate::drivers::redis::cluster::every_master_durable(conn).await;
        self.remember(CLUSTER, durable)
    }

    fn cached(&self, master: &str) -> Option<bool> {
        match &*self.checked.lock().expect("durability") {
            Some((at, of, durable)) if of == master && at.elapsed() < DURABILITY_RECHECK => {
                Some(*durable)
            }
            _ => None,
        }
    }

    fn remember(&self, master: &str, durable: bool) -> bool {
        *self.checked.lock().expect("durability") =
            Some((std::time::Instant::now(), master.to_owned(), durable));
        durable
    }
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
