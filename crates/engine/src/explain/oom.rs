//! Why it ran out of memory: the verdict on one OOM from the request, the driver's free
//! bytes, what memsnap recorded as reserved and live then, what the file knows of the
//! caching allocator's free space, and the device's capacity where the file has it.
//!
//! The rules (docs/EXPLAIN.md, "Verdicts"), tried in this order:
//! - *fragmentation*: the file has the caching allocator's blocks, the bytes reserved but
//!   unallocated inside its segments plus the driver's free bytes reach the request, and no
//!   free block is as large as the request (or the largest free block cannot be told).
//! - *outside*: the capacity and the free bytes are known, and the memory in use that
//!   memsnap did not record (capacity − recorded reserved − free: CUDA contexts, other
//!   processes) is larger than everything it recorded on the device.
//! - *live*: otherwise; the recorded live allocations hold the memory.
//!
//! Cold code.

use super::owners::Knowledge;
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Live,
    Fragmentation,
    Outside,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Live => "live",
            Verdict::Fragmentation => "fragmentation",
            Verdict::Outside => "outside",
        }
    }
}

/// What is known at the OOM.
#[derive(Clone, Debug)]
pub struct Inputs {
    pub request: i64,
    pub device_free: Option<i64>,
    /// Recorded reserved bytes (segments) and live bytes then.
    pub reserved: i64,
    pub live: i64,
    pub capacity: Option<i64>,
    pub knowledge: Knowledge,
    /// Reserved but unallocated inside the caching allocator's segments, and the largest
    /// free block, where the file can tell.
    pub cache_free: Option<i64>,
    pub largest_free_block: Option<i64>,
    pub expandable: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Judged {
    pub verdict: Verdict,
    /// Capacity − recorded reserved − free, where both are known.
    pub outside: Option<i64>,
    /// The setting or change that would help (fragmentation).
    pub advice: Option<String>,
}

pub fn judge(i: &Inputs) -> Judged {
    let outside = match (i.capacity, i.device_free) {
        (Some(c), Some(f)) => Some((c - i.reserved - f).max(0)),
        _ => None,
    };
    let free = i.device_free.unwrap_or(0).max(0);
    if i.knowledge == Knowledge::Blocks
        && let Some(u) = i.cache_free
        && u > 0
        && u + free >= i.request
        && i.largest_free_block.is_none_or(|l| l < i.request)
    {
        let advice = if i.expandable {
            "expandable segments are already on: allocate the large long-lived tensors first, \
             or set max_split_size_mb in PYTORCH_CUDA_ALLOC_CONF so large cached blocks are not \
             split for small requests"
                .to_string()
        } else {
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator grow segments \
             instead of leaving free space stranded between live blocks"
                .to_string()
        };
        return Judged {
            verdict: Verdict::Fragmentation,
            outside,
            advice: Some(advice),
        };
    }
    if let Some(o) = outside
        && o > i.reserved
    {
        return Judged {
            verdict: Verdict::Outside,
            outside,
            advice: None,
        };
    }
    Judged {
        verdict: Verdict::Live,
        outside,
        advice: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: i64 = 1 << 20;

    fn base() -> Inputs {
        Inputs {
            request: 512 * MIB,
            device_free: Some(100 * MIB),
            reserved: 7000 * MIB,
            live: 6900 * MIB,
            capacity: Some(8192 * MIB),
            knowledge: Knowledge::Blocks,
            cache_free: Some(100 * MIB),
            largest_free_block: Some(20 * MIB),
            expandable: false,
        }
    }

    #[test]
    fn live_when_the_live_allocations_hold_it() {
        let j = judge(&base());
        assert_eq!(j.verdict, Verdict::Live);
        // 8192 - 7000 - 100 = 1092 MiB outside: less than the 7000 recorded.
        assert_eq!(j.outside, Some(1092 * MIB));
    }

    #[test]
    fn fragmentation_when_the_cache_has_the_bytes_but_no_block_fits() {
        let i = Inputs {
            cache_free: Some(1500 * MIB),
            live: 5500 * MIB,
            ..base()
        };
        let j = judge(&i);
        assert_eq!(j.verdict, Verdict::Fragmentation);
        assert!(j.advice.unwrap().contains("expandable_segments:True"));
        let j = judge(&Inputs {
            expandable: true,
            ..i.clone()
        });
        assert!(j.advice.unwrap().contains("already on"));
        // A block large enough existed: not fragmentation.
        let j = judge(&Inputs {
            largest_free_block: Some(600 * MIB),
            ..i.clone()
        });
        assert_eq!(j.verdict, Verdict::Live);
        // Segments without blocks: never called fragmentation.
        let j = judge(&Inputs {
            knowledge: Knowledge::Segments,
            cache_free: None,
            ..i
        });
        assert_eq!(j.verdict, Verdict::Live);
    }

    #[test]
    fn outside_when_unrecorded_memory_is_the_larger_part() {
        let j = judge(&Inputs {
            reserved: 2000 * MIB,
            live: 2000 * MIB,
            cache_free: Some(0),
            ..base()
        });
        assert_eq!(j.verdict, Verdict::Outside);
        assert_eq!(j.outside, Some(6092 * MIB));
        // Without the capacity it cannot be told: live.
        let j = judge(&Inputs {
            reserved: 2000 * MIB,
            capacity: None,
            cache_free: Some(0),
            ..base()
        });
        assert_eq!((j.verdict, j.outside), (Verdict::Live, None));
    }
}
