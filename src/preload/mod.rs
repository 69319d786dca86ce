//! Everything that runs inside the host process's CUDA calls.
//!
//! Hot. No allocation, lock, panic or extra syscall on the path of a recorded call; the
//! one-time initialisation on the first CUDA event is the only exception.

pub mod event;
pub mod stack;
