//! A TCP proxy between one sidecar and one backend endpoint that can cut the link the way a
//! network partition does: bytes stop flowing in both directions, but nothing is closed, so the
//! sidecar learns of it only through its own timeouts. Restoring the link resets every connection
//! that lived through the cut (their streams lost bytes), and the sidecar reconnects. It can
//! also move to another server, as a virtual IP or a Service does in a failover, and strand the
//! connections open now, as a server whose node died silently does to them while a Service
//! already sends new connections to its replacement.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const ACCEPT_POLL: Duration = Duration::from_millis(5);
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

struct Shared {
    /// The loopback port forwarded to.
    upstream: AtomicU16,
    cut: AtomicBool,
    /// How many times the open connections were stranded: a connection accepted before the
    /// last time passes nothing any more.
    strandings: AtomicU64,
    stop: AtomicBool,
    /// Both ends of every proxied connection, to reset them on restore.
    streams: Mutex<Vec<TcpStream>>,
}

pub struct FaultProxy {
    pub port: u16,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listen on a free loopback port and forward to `127.0.0.1:upstream_port`.
    pub fn start(upstream_port: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let port = listener.local_addr().expect("addr").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let shared = Arc::new(Shared {
            upstream: AtomicU16::new(upstream_port),
            cut: AtomicBool::new(false),
            strandings: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            streams: Mutex::new(Vec::new()),
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::spawn(move || accept_loop(&listener, &shared))
        };
        Self {
            port,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// Partition: from now on nothing passes, in either direction, on old or new connections.
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
    }

    /// Heal: reset the connections that lived through the cut; new ones pass again.
    pub fn restore(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
        reset_all(&self.shared);
    }

    /// The connections open now fall silent for good, in both directions, and stay open; new
    /// ones pass.
    pub fn strand(&self) {
        self.shared.strandings.fetch_add(1, Ordering::SeqCst);
    }

    /// Fail over to the server on `upstream_port`: connections to the old one are reset, and
    /// new ones reach the new one, behind the same address.
    pub fn redirect(&self, upstream_port: u16) {
        self.shared.upstream.store(upstream_port, Ordering::SeqCst);
        reset_all(&self.shared);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        reset_all(&self.shared);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn reset_all(shared: &Shared) {
    let streams = std::mem::take(&mut *shared.streams.lock().unwrap());
    for stream in streams {
        let _ = stream.shutdown(Shutdown::Both);
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(_) => continue,
        };
        let _ = client.set_nonblocking(false);
        if shared.cut.load(Ordering::SeqCst) {
            // A connection attempt into the partition: it hangs, like a SYN nobody answers.
            if let Ok(clone) = client.try_clone() {
                shared.streams.lock().unwrap().push(clone);
            }
            continue;
        }
        let upstream = SocketAddr::from(([127, 0, 0, 1], shared.upstream.load(Ordering::SeqCst)));
        let Ok(upstream) = TcpStream::connect_timeout(&upstream, UPSTREAM_CONNECT_TIMEOUT) else {
            continue; // the backend is down: the client sees its connection closed
        };
        let _ = upstream.set_nodelay(true);
        let _ = client.set_nodelay(true);
        let (Ok(c2), Ok(u2), Ok(c3), Ok(u3)) = (
            client.try_clone(),
            upstream.try_clone(),
            client.try_clone(),
            upstream.try_clone(),
        ) else {
            continue;
        };
        shared.streams.lock().unwrap().extend([c3, u3]);
        let born = shared.strandings.load(Ordering::SeqCst);
        let (s1, s2) = (shared.clone(), shared.clone());
        std::thread::spawn(move || pump(client, upstream, &s1, born));
        std::thread::spawn(move || pump(u2, c2, &s2, born));
    }
}

/// Copy one direction of a connection accepted after `born` strandings; while the link is cut
/// or the connection stranded, read bytes are dropped on the floor, and so is a close: the
/// other side learns of it only once the link is restored (which resets the connection), as
/// across a partition.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared, born: u64) {
    let silent =
        || shared.cut.load(Ordering::SeqCst) || shared.strandings.load(Ordering::SeqCst) != born;
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if silent() {
            continue;
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    if !silent() {
        let _ = to.shutdown(Shutdown::Both);
    }
}
