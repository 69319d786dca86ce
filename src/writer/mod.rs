//! The writer thread: owns all recorded state, builds and writes snapshots.
//!
//! Cold. May allocate, take locks, do I/O; never takes the host down.

pub mod stacks;
