//! The clock that self-fence deadlines are kept on. tokio's `Instant` is `CLOCK_MONOTONIC`, which
//! stops while a VM or its host is suspended: a holder resumed after a suspend longer than its
//! lease would go on answering "you are the holder" until its next renewal failed, while the
//! backend, whose clock kept going, has long handed the lock on. `CLOCK_BOOTTIME` is the same
//! clock but counts the time suspended, so a deadline on it has passed the instant the process
//! runs again. Timers still sleep on tokio's clock; whoever answers compares with this one.

use std::ops::{Add, Sub};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::time::{ClockId, clock_gettime};

/// An instant on `CLOCK_BOOTTIME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BootInstant(Duration);

/// Time added by [`simulate_suspend`]: a suspend cannot be caused from a test.
static SUSPENDED_NANOS: AtomicU64 = AtomicU64::new(0);

impl BootInstant {
    pub fn now() -> Self {
        // Linux has had CLOCK_BOOTTIME since 2.6.39; reading a clock that exists cannot fail.
        let now = clock_gettime(ClockId::CLOCK_BOOTTIME).expect("CLOCK_BOOTTIME");
        let since_boot = Duration::new(
            u64::try_from(now.tv_sec()).unwrap_or(0),
            u32::try_from(now.tv_nsec()).unwrap_or(0),
        );
        Self(since_boot + Duration::from_nanos(SUSPENDED_NANOS.load(Ordering::SeqCst)))
    }

    pub fn saturating_duration_since(self, earlier: Self) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// How long from now until `self`; zero once it has passed.
    pub fn remaining(self) -> Duration {
        self.saturating_duration_since(Self::now())
    }

    /// Nanoseconds since boot: the same instant in any process on this machine.
    pub fn as_nanos(self) -> u64 {
        u64::try_from(self.0.as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant [`Self::as_nanos`] gave.
    pub fn from_nanos(nanos: u64) -> Self {
        Self(Duration::from_nanos(nanos))
    }

    /// Milliseconds since boot, rounded down: never later than the instant.
    pub fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }

    /// The instant [`Self::as_millis`] gave.
    pub fn from_millis(millis: u64) -> Self {
        Self(Duration::from_millis(millis))
    }

    /// The tokio instant to wake at for `self`, as far as anyone can tell now.
    pub fn to_tokio(self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.remaining()
    }
}

impl Add<Duration> for BootInstant {
    type Output = Self;
    fn add(self, d: Duration) -> Self {
        Self(self.0 + d)
    }
}

impl Sub<Duration> for BootInstant {
    type Output = Self;
    fn sub(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(d))
    }
}

/// This boot of this machine's kernel (`/proc/sys/kernel/random/boot_id`), which every process
/// on the machine reads alike and another machine or boot never does: two processes read one
/// `CLOCK_BOOTTIME` only if they read one boot id. `None` where it cannot be read.
pub fn boot_id() -> Option<&'static str> {
    static BOOT_ID: OnceLock<Option<String>> = OnceLock::new();
    BOOT_ID
        .get_or_init(|| {
            std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .ok()
                .map(|id| id.trim().to_owned())
                .filter(|id| !id.is_empty())
        })
        .as_deref()
}

/// Make this process's boot clock jump `by` ahead while tokio's clock does not, as a suspend of
/// the machine does. For tests only: a real suspend cannot be caused from one.
#[cfg(feature = "test-hooks")]
pub fn simulate_suspend(by: Duration) {
    let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
    SUSPENDED_NANOS.fetch_add(nanos, Ordering::SeqCst);
}
