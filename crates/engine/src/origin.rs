//! Which process a snapshot came from, as its file says: the numbers of memsnap's metadata
//! (`rank`, `pid`, `time_us`, ...) and a rank written in the file's name. Shared by `ranks`
//! and `explain`. Cold code.

use memsnap_format::model::{Meta, Snapshot};

/// An integer of memsnap's metadata, also from a numeric string (`rank` and `local_rank`
/// are written as strings).
pub fn meta_number(snap: &Snapshot, key: &str) -> Option<i64> {
    match snap.meta(key)? {
        Meta::Int(i) => Some(*i),
        Meta::Str(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// `…-r12-…`, `rank12`, `rank_12`, `_r3.`: the first such number in the file name.
pub fn rank_from_name(name: &str) -> Option<i64> {
    let b = name.as_bytes();
    for (i, _) in name.match_indices('r') {
        let boundary = i == 0 || !b[i - 1].is_ascii_alphanumeric();
        if !boundary {
            continue;
        }
        let mut j = i + 1;
        if name[j..].starts_with("ank") {
            j += 3;
            if name[j..].starts_with('_') || name[j..].starts_with('-') {
                j += 1;
            }
        }
        let digits: String = name[j..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        let after = name[j + digits.len()..].chars().next();
        if !digits.is_empty() && after.is_none_or(|c| !c.is_ascii_alphanumeric()) {
            return digits.parse().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::rank_from_name;

    #[test]
    fn rank_from_file_names() {
        assert_eq!(
            rank_from_name("memsnap-python-node1-r12-p4242-exit-0.pickle"),
            Some(12)
        );
        assert_eq!(rank_from_name("rank3_memory_snapshot.pickle"), Some(3));
        assert_eq!(rank_from_name("snap_rank_7.pickle"), Some(7));
        assert_eq!(rank_from_name("train-r0.pickle"), Some(0));
        assert_eq!(rank_from_name("torch-transformer.pickle"), None);
        assert_eq!(rank_from_name("run-r2d2.pickle"), None);
    }
}
