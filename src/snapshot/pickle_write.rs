//! Pickle encoder for snapshots (stub: being written).
use super::model::Snapshot;

/// Encodes `snap` as a protocol-2 pickle that PyTorch's viewers load.
pub fn to_bytes(_snap: &Snapshot) -> Vec<u8> {
    unimplemented!("pickle encoder")
}
