//! The one-way path from the hook side to the writer thread, and the only state the two
//! share.
//!
//! Hot. [`event`]: the fixed-size records a hook sends. [`queue`]: the queue and the stack
//! slots they travel in. [`sent`]: the stacks each thread has sent, so that a repeated one
//! travels as its hash. [`handshake`]: flags and counters that hooks and the writer both
//! touch (requests waiting for a dump, route counters, device totals, the recording switch).

pub mod allocator_route;
pub mod event;
pub mod handshake;
pub mod queue;
pub mod sent;
