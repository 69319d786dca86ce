//! The one-way path from the hook side to the writer thread: events, and the requests and
//! counters that go with them. With `process/` (process-wide state: the recording switch,
//! the module table, the interpreter), the only place the two sides meet.
//!
//! Hot. [`event`]: the fixed-size records a hook sends. [`queue`]: the queue and the stack
//! slots they travel in. [`sent`]: the stacks each thread has sent, so that a repeated one
//! travels as its hash. [`handshake`]: flags and counters that hooks and the writer both
//! touch (requests waiting for a dump, route counters, device totals). [`thread`]: each
//! thread's hook state (its lane, its sent stacks, the nesting depth), one cache line.
//! [`recording`]: the recording switch and the recorder the hooks send on. [`futex`]:
//! waiting on a word of memsnap's own memory. [`keep`]: code objects freed and libraries
//! unloaded only once the writer has read the events that may name them (cold).

pub mod event;
pub mod futex;
pub mod handshake;
pub mod keep;
pub mod lanes;
pub mod queue;
pub mod recording;
pub mod sent;
pub mod thread;
