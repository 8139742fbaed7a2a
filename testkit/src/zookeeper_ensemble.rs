//! Three real ZooKeeper servers in one ensemble, every link between two of them through a
//! [`FaultProxy`], so that a test can cut one server off from its quorum while it goes on
//! serving its clients, as a follower behind a network partition does.
//!
//! Each server has its own `zoo.cfg`: it names itself with its real ports and the others with
//! the ports of its own proxies to them. The follower-to-leader link (the one that carries
//! `sync`s and the leader's pings) is always opened from the follower's side, to the address its
//! own file gives, so cutting a server's proxies, and the others' proxies to it, isolates it.
//! (Election connections may also be opened back to the address a peer announces, past the
//! proxies; they carry votes only, and a server cut off from the leader's quorum port cannot
//! follow whatever it learns from them.)

use std::time::Duration;

use super::fault_proxy::FaultProxy;
use super::server_process::ServerProcess;
use super::zookeeper_server::{
    ZOOKEEPER_JAR, four_letter, one_zookeeper_at_a_time, server_command, zookeeper_is_done,
};
use super::{free_port, require_binary};

const SERVERS: usize = 3;
const START_ATTEMPTS: usize = 3;

/// How long a follower goes on serving after it last heard from the leader, in ticks. Long
/// enough that a stale follower outlives a lease by far, as `syncLimit=5` at a 2 s tick (10 s)
/// outlives common leases in production.
pub const SYNC_LIMIT_TICKS: u32 = 50;

struct Member {
    process: ServerProcess,
    client_port: u16,
    quorum_port: u16,
    election_port: u16,
}

pub struct ZooKeeperEnsemble {
    members: Vec<Member>,
    /// `links[i][j]`: the proxies server `i` reaches server `j` through (quorum, election).
    links: Vec<Vec<Option<(FaultProxy, FaultProxy)>>>,
    /// Whether dropping this ensemble ends the process's one-ZooKeeper-at-a-time turn: a
    /// failed start that is retried does not.
    holds_turn: bool,
}

impl Drop for ZooKeeperEnsemble {
    fn drop(&mut self) {
        for member in &mut self.members {
            member.process.stop(None);
        }
        if self.holds_turn {
            zookeeper_is_done();
        }
    }
}

impl ZooKeeperEnsemble {
    /// The tick of every member, as [`super::ZooKeeperServer::TICK_TIME`].
    pub const TICK_TIME: Duration = super::ZooKeeperServer::TICK_TIME;

    /// Start three servers and wait until one leads and two follow.
    ///
    /// The ensemble's 21 ports are chosen free and then bound by other processes a moment
    /// later, so another test (or a proxy of this ensemble) can take one in between; a server
    /// that then cannot bind exits. Such a start is retried on fresh ports, and said so.
    pub fn start() -> Self {
        one_zookeeper_at_a_time();
        let java = require_binary("java", "zookeeper");
        assert!(
            std::path::Path::new(ZOOKEEPER_JAR).is_file(),
            "{ZOOKEEPER_JAR} was not found. Install it with `apt-get install -y zookeeper` \
             (scripts/test does this), then run the tests again."
        );
        let mut failures = Vec::new();
        for attempt in 1..=START_ATTEMPTS {
            match Self::try_start(&java) {
                Ok(ensemble) => return ensemble,
                Err(why) => {
                    eprintln!(
                        "zookeeper-ensemble: start {attempt} of {START_ATTEMPTS} failed, \
                         retrying on fresh ports: {why}"
                    );
                    failures.push(why);
                }
            }
        }
        zookeeper_is_done();
        panic!(
            "the ZooKeeper ensemble did not start in {START_ATTEMPTS} attempts:\n{}",
            failures.join("\n")
        );
    }

    fn try_start(java: &std::path::Path) -> Result<Self, String> {
        let members: Vec<Member> = (0..SERVERS)
            .map(|_| Member {
                process: ServerProcess::new("zookeeper-ensemble"),
                client_port: free_port(),
                quorum_port: free_port(),
                election_port: free_port(),
            })
            .collect();
        let links: Vec<Vec<Option<(FaultProxy, FaultProxy)>>> = (0..SERVERS)
            .map(|i| {
                (0..SERVERS)
                    .map(|j| {
                        (i != j).then(|| {
                            (
                                FaultProxy::start(members[j].quorum_port),
                                FaultProxy::start(members[j].election_port),
                            )
                        })
                    })
                    .collect()
            })
            .collect();
        let mut ensemble = Self {
            members,
            links,
            holds_turn: false,
        };
        ensemble.start_members(java)?;
        ensemble.holds_turn = true;
        Ok(ensemble)
    }

    fn start_members(&mut self, java: &std::path::Path) -> Result<(), String> {
        for i in 0..SERVERS {
            self.write_config(i);
        }
        for i in 0..SERVERS {
            let config = self.members[i].process.dir().join("zoo.cfg");
            // A member serves only once a quorum has formed, so only the first start is waited
            // for here, and only until its JVM is up.
            let port = self.members[i].client_port;
            self.members[i]
                .process
                .try_spawn(server_command(java, "192m", &config), move || {
                    four_letter(port, "ruok") == "imok"
                })?;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while self.leader().is_none() || self.followers().len() != SERVERS - 1 {
            let exited: Vec<usize> = (0..SERVERS)
                .filter(|&i| self.members[i].process.exited().is_some())
                .collect();
            if !exited.is_empty() || std::time::Instant::now() >= deadline {
                return Err(format!(
                    "no quorum formed (modes: {:?}; exited: {exited:?}); logs:\n{}",
                    self.modes(),
                    self.logs()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn write_config(&self, i: usize) {
        let data = self.members[i].process.dir().join("data");
        std::fs::create_dir_all(&data).expect("zookeeper data dir");
        std::fs::write(data.join("myid"), format!("{}\n", i + 1)).expect("myid");
        let mut config = format!(
            "tickTime={}\n\
             initLimit={SYNC_LIMIT_TICKS}\n\
             syncLimit={SYNC_LIMIT_TICKS}\n\
             dataDir={}\n\
             clientPort={}\n\
             clientPortAddress=127.0.0.1\n\
             maxSessionTimeout=60000\n\
             maxClientCnxns=0\n\
             admin.enableServer=false\n\
             reconfigEnabled=false\n\
             4lw.commands.whitelist=ruok,mntr,srvr\n",
            Self::TICK_TIME.as_millis(),
            data.display(),
            self.members[i].client_port,
        );
        for j in 0..SERVERS {
            let (quorum, election) = match &self.links[i][j] {
                None => (self.members[j].quorum_port, self.members[j].election_port),
                Some((quorum, election)) => (quorum.port, election.port),
            };
            config.push_str(&format!("server.{}=127.0.0.1:{quorum}:{election}\n", j + 1));
        }
        std::fs::write(self.members[i].process.dir().join("zoo.cfg"), config).expect("zoo.cfg");
    }

    /// Each member's `Mode:` as `srvr` reports it ("leader", "follower"; empty when it is not
    /// serving).
    pub fn modes(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| {
                four_letter(m.client_port, "srvr")
                    .lines()
                    .find_map(|l| l.strip_prefix("Mode: "))
                    .unwrap_or_default()
                    .trim()
                    .to_owned()
            })
            .collect()
    }

    /// The index of the member that leads, if one does.
    pub fn leader(&self) -> Option<usize> {
        self.modes().iter().position(|m| m == "leader")
    }

    pub fn followers(&self) -> Vec<usize> {
        let modes = self.modes();
        (0..SERVERS).filter(|&i| modes[i] == "follower").collect()
    }

    /// `host:port` of the client ports of `members`, comma-separated, as a driver takes them.
    pub fn servers(&self, members: &[usize]) -> String {
        members
            .iter()
            .map(|&i| format!("127.0.0.1:{}", self.members[i].client_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A `zk://` URL on `members` only.
    pub fn url(&self, members: &[usize]) -> String {
        format!(
            "zk://{}/leasehold?tick-time={}ms",
            self.servers(members),
            Self::TICK_TIME.as_millis()
        )
    }

    /// Cut every link between `member` and the others, both ways; its clients still reach it.
    pub fn isolate(&self, member: usize) {
        for (quorum, election) in self.links_of(member) {
            quorum.cut();
            election.cut();
        }
    }

    /// The proxies of every link between `member` and the others, both ways.
    fn links_of(&self, member: usize) -> impl Iterator<Item = &(FaultProxy, FaultProxy)> {
        (0..SERVERS)
            .flat_map(|i| (0..SERVERS).map(move |j| (i, j)))
            .filter(move |&(i, j)| i == member || j == member)
            .filter_map(|(i, j)| self.links[i][j].as_ref())
    }

    /// Heal what [`Self::isolate`] cut (the proxies reset the links that lived through the
    /// cut, so the member rejoins as a fresh follower) and wait until it follows again, so
    /// that a later isolation of another member still leaves a quorum. `false` if it did not
    /// rejoin within `within`.
    pub fn rejoin(&self, member: usize, within: Duration) -> bool {
        for (quorum, election) in self.links_of(member) {
            quorum.restore();
            election.restore();
        }
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if self.leader().is_some() && self.followers().len() == SERVERS - 1 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The client port of `member`.
    pub fn client_port(&self, member: usize) -> u16 {
        self.members[member].client_port
    }

    pub fn logs(&self) -> String {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| format!("--- server {} ---\n{}", i + 1, m.process.log()))
            .collect()
    }
}
