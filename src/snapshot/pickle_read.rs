//! Pickle reader for snapshots (stub: being written).
