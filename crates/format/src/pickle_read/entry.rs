//! One trace-entry dict to a [`TraceEntry`], through the [`Interner`]: what the machine
//! runs on each entry as it is appended to a list, and the conversion on any it did not.

use super::arena::{Node, Pickle, Val};
use super::intern::{EntryKey, Interner};
use crate::model::{Action, TraceEntry};

pub(super) fn int_of(v: Option<Val>) -> Option<i64> {
    match v? {
        Val::Int(i) => Some(i),
        Val::Bool(b) => Some(b as i64),
        _ => None,
    }
}

/// Converts one trace-entry dict. Tolerates missing keys (PyTorch omits `addr` on `oom`).
pub(super) fn event_from_dict(
    p: &Pickle,
    interner: &mut Interner,
    v: Val,
) -> std::result::Result<TraceEntry, String> {
    let d = p.dict(v).ok_or("not a dict")?;
    let mut e = TraceEntry::new(Action::Other(String::new()));
    let mut frames = None;
    let mut has_action = false;
    for &(k, val) in d {
        match interner.key(p, k) {
            EntryKey::Action => {
                e.action = interner.action(p, val).ok_or("`action` is not a string")?;
                has_action = true;
            }
            EntryKey::Addr => e.addr = int_of(Some(val)).ok_or("`addr` is not an integer")?,
            EntryKey::Size => e.size = int_of(Some(val)).ok_or("`size` is not an integer")?,
            EntryKey::Stream => e.stream = int_of(Some(val)).unwrap_or(0),
            EntryKey::TimeUs => e.time_us = int_of(Some(val)).unwrap_or(0),
            EntryKey::DeviceFree => e.device_free = int_of(Some(val)),
            EntryKey::Frames => frames = Some(val),
            EntryKey::UserMetadata => {
                e.user_metadata = match p.node(val) {
                    Some(Node::Str(_)) => interner.meta_str(p, val),
                    // "k: v, ..." of a dict whose keys and values may all be one long
                    // string shared through the memo: counted before it is built.
                    Some(Node::Dict(kv))
                        if !kv.is_empty()
                            && interner.spend(
                                kv.iter()
                                    .map(|(k, v)| {
                                        p.str(*k).map_or(1, str::len)
                                            + p.str(*v).map_or(20, str::len)
                                            + 4
                                    })
                                    .sum(),
                                "user_metadata",
                            ) =>
                    {
                        Some(
                            interner.meta(
                                &kv.iter()
                                    .map(|(k, v)| {
                                        format!(
                                            "{}: {}",
                                            p.str(*k).unwrap_or("?"),
                                            p.str(*v)
                                                .map(str::to_string)
                                                .or_else(|| int_of(Some(*v)).map(|i| i.to_string()))
                                                .unwrap_or_else(|| "?".into())
                                        )
                                    })
                                    .collect::<Vec<_>>()
                                    .join(", "),
                            ),
                        )
                    }
                    _ => None,
                }
            }
            _ => {}
        }
    }
    if !has_action {
        return Err("no `action`".into());
    }
    e.stack = interner.stack(p, frames);
    Ok(e)
}
