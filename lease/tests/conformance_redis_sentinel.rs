//! The conformance suite on Redis behind Sentinel (`redis+sentinel://`): a master, a replica
//! that confirms every acquisition and renewal (`WAIT 1`), and a sentinel, with a dead sentinel
//! listed first in the URL.
leasehold_lease::conformance_suite!(leasehold_lease::testkit::RedisSentinelHarness::new());
