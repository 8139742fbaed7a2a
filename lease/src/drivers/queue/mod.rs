//! The fair-queue lock, first come first served, on its two transports: each contender puts a
//! place in line (an etcd key under the lock's prefix, a sequential ZooKeeper node) and holds
//! the lock once its place is first; each waiter watches the place just ahead. [`slot`] is
//! one contender's place and the tasks that serve it, and [`places`] this process's table of
//! them, the same for both; [`etcd`] and [`zookeeper`] are the backend operations.

pub mod etcd;
pub mod etcd_rpc;
pub(crate) mod places;
pub(crate) mod slot;
mod urls;
pub mod zookeeper;
