//! A Tair primary and its durable standby behind one address that a failover moves, as a
//! virtual IP, a proxy or a Service does. The standby is promoted while the old primary still
//! serves for a moment, so the writes it takes meanwhile (a lease among them) are lost when it
//! follows the new primary; the next failover is the failback.

use std::time::Duration;

use super::{FaultProxy, RedisServer};

pub struct TairPair {
    servers: [RedisServer; 2],
    /// Which of `servers` is the primary.
    primary: usize,
    /// The address clients use.
    endpoint: FaultProxy,
}

impl TairPair {
    /// A durable primary with the TairString module and a synced durable standby.
    pub fn start() -> Self {
        let primary = RedisServer::start_tair();
        let standby = RedisServer::start_tair_replica_of(primary.port());
        standby.wait_until_synced();
        let endpoint = FaultProxy::start(primary.port());
        Self {
            servers: [primary, standby],
            primary: 0,
            endpoint,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.endpoint.port
    }

    /// `tair://` at the address clients use.
    pub fn url(&self) -> String {
        format!("tair://127.0.0.1:{}", self.endpoint.port)
    }

    pub fn primary(&self) -> &RedisServer {
        &self.servers[self.primary]
    }

    pub fn standby(&self) -> &RedisServer {
        &self.servers[1 - self.primary]
    }

    /// Promote the standby, let the old primary serve `overlap` longer behind the address,
    /// then move the address and make the old primary the new one's standby, synced, which
    /// throws away what it took during `overlap`.
    pub fn fail_over(&mut self, overlap: Duration) {
        let (old, new) = (self.primary, 1 - self.primary);
        self.servers[new].replicate_from(None);
        std::thread::sleep(overlap);
        self.endpoint.redirect(self.servers[new].port());
        let new_port = self.servers[new].port();
        self.servers[old].replicate_from(Some(new_port));
        self.servers[old].wait_until_synced();
        self.primary = new;
    }

    /// `kill -9` the primary and start it again on its data; the standby syncs again.
    pub fn restart_primary(&mut self) {
        self.servers[self.primary].restart();
    }
}
