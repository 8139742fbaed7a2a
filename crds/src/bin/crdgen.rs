#![forbid(unsafe_code)]
//! Writes the DistributedLock CRD as YAML to stdout.

fn main() {
    print!("{}", leasehold_crds::crd_yaml());
}
