//! Test hosts on one machine: each a network namespace of its own with one address on a shared
//! bridge, so that processes reach each other by the addresses they announce (as Redis and its
//! sentinels do, past any proxy), and a partition can be placed between any two groups of
//! hosts while the harness, on the bridge, still reaches every one of them.
//!
//! A cut drops, on each side, every packet that comes from the other (iptables' `INPUT` chain of
//! each host): connections stall and time out as over a real partition, new ones find no
//! answer, and both resume when healed. Needs root, `ip` (iproute2) and iptables.
//!
//! A network left by a test process that died (killed, so that no `Drop` ran) is taken down by
//! the next one that starts: its bridge names its owner's pid.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::require_binary;

/// The networks of one machine: 10.231.N.0/24 on bridge `lhbrN`, N claimed by creating it.
const SUBNETS: std::ops::Range<u8> = 0..250;
/// The harness's own address on each network (the bridge's).
const BRIDGE_HOST: u8 = 254;

pub struct TestNetwork {
    index: u8,
    /// (name, address): host `i` is `10.231.index.(i + 1)`.
    hosts: Vec<(String, Ipv4Addr)>,
    /// Pairs of hosts cut apart now, by position.
    cut: Mutex<BTreeSet<(usize, usize)>>,
}

impl TestNetwork {
    /// A network of the named hosts, each in a namespace of its own with its loopback up.
    pub fn start(names: &[String]) -> Self {
        assert!(
            nix::unistd::geteuid().is_root(),
            "test hosts are network namespaces, which need root; run the tests as root"
        );
        assert!(names.len() < usize::from(BRIDGE_HOST), "too many hosts");
        require_binary("ip", "iproute2");
        require_binary("iptables", "iptables");
        clear_abandoned_networks();
        let index = SUBNETS
            .into_iter()
            .find(|n| ip_ok(&["link", "add", &format!("lhbr{n}"), "type", "bridge"]))
            .expect("a free test network (bridges lhbr0 to lhbr249 all exist)");
        let owner = format!("leasehold-test pid={}", std::process::id());
        ip(&["link", "set", &format!("lhbr{index}"), "alias", &owner]);
        let network = Self {
            index,
            hosts: names
                .iter()
                .enumerate()
                .map(|(i, name)| (name.clone(), Ipv4Addr::new(10, 231, index, i as u8 + 1)))
                .collect(),
            cut: Mutex::new(BTreeSet::new()),
        };
        let bridge = network.bridge();
        ip(&["link", "set", &bridge, "up"]);
        ip(&[
            "addr",
            "add",
            &format!("10.231.{index}.{BRIDGE_HOST}/24"),
            "dev",
            &bridge,
        ]);
        for i in 0..network.hosts.len() {
            let netns = network.netns(i);
            let (outer, inner) = (format!("lh{index}v{i}"), format!("lh{index}p{i}"));
            // A namespace or link of these names not yet gone with an earlier network goes first
            // (a namespace's links outlive it until the kernel has destroyed it).
            let _ = ip_ok(&["netns", "del", &netns]);
            let _ = ip_ok(&["link", "del", &outer]);
            ip(&["netns", "add", &netns]);
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ]);
            ip(&["link", "set", &inner, "netns", &netns]);
            ip(&["link", "set", &outer, "master", &bridge, "up"]);
            let address = format!("{}/24", network.hosts[i].1);
            ip(&["-n", &netns, "addr", "add", &address, "dev", &inner]);
            ip(&["-n", &netns, "link", "set", &inner, "up"]);
            ip(&["-n", &netns, "link", "set", "lo", "up"]);
        }
        network
    }

    fn bridge(&self) -> String {
        format!("lhbr{}", self.index)
    }

    fn netns(&self, host: usize) -> String {
        format!("lh{}h{host}", self.index)
    }

    fn position(&self, host: &str) -> usize {
        self.hosts
            .iter()
            .position(|(name, _)| name == host)
            .unwrap_or_else(|| panic!("no test host named {host:?}"))
    }

    /// The address of `host` on the network.
    pub fn ip(&self, host: &str) -> Ipv4Addr {
        self.hosts[self.position(host)].1
    }

    /// The host with address `ip`.
    pub fn host_at(&self, ip: &str) -> Option<&str> {
        self.hosts
            .iter()
            .find(|(_, address)| address.to_string() == ip)
            .map(|(name, _)| name.as_str())
    }

    /// Whether the network has a host named `host`.
    pub fn has(&self, host: &str) -> bool {
        self.hosts.iter().any(|(name, _)| name == host)
    }

    /// Every host's name.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts.iter().map(|(name, _)| name.as_str())
    }

    /// `program` run on `host` (`ip netns exec`, which execs it: the child's pid is the
    /// program's, for signals).
    pub fn command(&self, host: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new(require_binary("ip", "iproute2"));
        command
            .args(["netns", "exec", &self.netns(self.position(host))])
            .arg(program);
        command
    }

    /// Cut every host of `one` off from every host of `other`, both ways: one batch of rules
    /// per host, so that the whole cut lands within a few milliseconds.
    pub fn cut(&self, one: &[&str], other: &[&str]) {
        let mut cut = self.cut.lock().unwrap();
        let mut drops: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for a in one.iter().map(|h| self.position(h)) {
            for b in other.iter().map(|h| self.position(h)) {
                let pair = (a.min(b), a.max(b));
                if a != b && cut.insert(pair) {
                    drops.entry(a).or_default().push(b);
                    drops.entry(b).or_default().push(a);
                }
            }
        }
        for (host, from) in drops {
            let mut rules = String::from("*filter\n");
            for peer in from {
                rules.push_str(&format!("-A INPUT -s {}/32 -j DROP\n", self.hosts[peer].1));
            }
            rules.push_str("COMMIT\n");
            self.in_host(host, &["iptables-restore", "--noflush"], &rules);
        }
    }

    /// Join every cut pair again.
    pub fn heal(&self) {
        let mut cut = self.cut.lock().unwrap();
        let hosts: BTreeSet<usize> = std::mem::take(&mut *cut)
            .into_iter()
            .flat_map(|(a, b)| [a, b])
            .collect();
        for host in hosts {
            self.in_host(host, &["iptables", "-F", "INPUT"], "");
        }
    }

    /// Run `command` on `host`, with `input` on its standard input.
    fn in_host(&self, host: usize, command: &[&str], input: &str) {
        use std::process::Stdio;
        let mut child = Command::new(require_binary("ip", "iproute2"))
            .args(["netns", "exec", &self.netns(host)])
            .args(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run a command on a test host");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write its input");
        let out = child.wait_with_output().expect("wait for it");
        assert!(
            out.status.success(),
            "{} on {}: {}",
            command.join(" "),
            self.hosts[host].0,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A loopback address here that forwards each connection to `127.0.0.1:port` on `host`:
    /// how the harness reaches a loopback-only listener (a sidecar's lock API) on a test host.
    pub fn forward(&self, host: &str, port: u16) -> Forward {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a forwarding port");
        let addr = listener.local_addr().expect("address");
        let netns = Arc::new(
            File::open(format!("/run/netns/{}", self.netns(self.position(host))))
                .expect("open the host's network namespace"),
        );
        let stopped = Arc::new(AtomicBool::new(false));
        let stop = stopped.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let netns = netns.clone();
                std::thread::spawn(move || relay(client, &netns, port));
            }
        });
        Forward { addr, stopped }
    }
}

/// One forwarded connection, both ways until each side has finished. The thread enters the
/// host's namespace to connect; the sockets then work from any thread.
fn relay(mut client: TcpStream, netns: &File, port: u16) {
    if nix::sched::setns(netns, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
        return;
    }
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", port)) else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(mut client_in), Ok(mut server_out)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let upstream = std::thread::spawn(move || {
        copy(&mut client_in, &mut server_out);
        let _ = server_out.shutdown(Shutdown::Write);
    });
    copy(&mut server, &mut client);
    let _ = client.shutdown(Shutdown::Write);
    // A client that hung up ends the upstream copy; one that waits for more is not waited for.
    let _ = client.shutdown(Shutdown::Read);
    let _ = upstream.join();
}

fn copy(from: &mut TcpStream, to: &mut TcpStream) {
    let mut buffer = [0u8; 16 * 1024];
    while let Ok(n) = from.read(&mut buffer) {
        if n == 0 || to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
}

/// A forwarding listener of [`TestNetwork::forward`]; it stops accepting when dropped.
pub struct Forward {
    pub addr: SocketAddr,
    stopped: Arc<AtomicBool>,
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        // Wake the accepting thread so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

impl Drop for TestNetwork {
    /// The namespaces go with their last process (the servers on them are stopped first, being
    /// declared before the network in their owners); the bridge goes now.
    fn drop(&mut self) {
        for i in 0..self.hosts.len() {
            let _ = ip_ok(&["link", "del", &format!("lh{}v{i}", self.index)]);
            let _ = ip_ok(&["netns", "del", &self.netns(i)]);
        }
        let _ = ip_ok(&["link", "del", &self.bridge()]);
    }
}

/// Take down the test networks whose owner is gone: the processes on their hosts, the
/// namespaces, the bridge.
fn clear_abandoned_networks() {
    let Ok(out) = Command::new(require_binary("ip", "iproute2"))
        .args(["-d", "-o", "link", "show", "type", "bridge"])
        .output()
    else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(index) = line
            .split_once(": lhbr")
            .and_then(|(_, rest)| rest.split(':').next())
            .and_then(|n| n.parse::<u8>().ok())
        else {
            continue;
        };
        let Some(pid) = line
            .split_once("alias leasehold-test pid=")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
        if alive {
            continue;
        }
        for netns in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = netns.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&format!("lh{index}h")) {
                continue;
            }
            if let Ok(pids) = Command::new(require_binary("ip", "iproute2"))
                .args(["netns", "pids", &name])
                .output()
            {
                for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
            let _ = ip_ok(&["netns", "del", &name]);
        }
        let _ = ip_ok(&["link", "del", &format!("lhbr{index}")]);
    }
}

fn ip(args: &[&str]) {
    let out = Command::new(require_binary("ip", "iproute2"))
        .args(args)
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ip_ok(args: &[&str]) -> bool {
    Command::new(require_binary("ip", "iproute2"))
        .args(args)
        .output()
        .is_ok_and(|out| out.status.success())
}
