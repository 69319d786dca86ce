//! Snapshot validity checker (stub: being written).
