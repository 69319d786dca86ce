//! Fuzzes the pickle reader: any input must end in `Ok` or a typed error, never a panic,
//! a hang, or unbounded memory. Seed the corpus with tests/fixtures/torch/*.pickle.
#![no_main]

use memsnap_format as snapshot;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let whole = snapshot::pickle_read::read_snapshot(data);
    let _ = snapshot::pickle_read::parse(data);
    // Streaming hands out exactly the entries a full read keeps (entries appended to lists
    // that are not a device's trace are handed out too, and ignored), or asks for a full read.
    let mut lists: Vec<u32> = Vec::new();
    let mut sink = |list: u32, _| lists.push(list);
    let streamed = snapshot::pickle_read::stream_snapshot_from(&mut &data[..], &mut |_| {}, &mut sink);
    match (&streamed, &whole) {
        (Ok(s), Ok(w)) => {
            for (d, list) in s.trace_lists.iter().enumerate() {
                let n = lists.iter().filter(|l| *l == list).count();
                assert_eq!(n, w.device_traces[d].len(), "device {d}");
            }
        }
        (Ok(_), Err(e)) => panic!("streamed fine, full read failed: {e}"),
        _ => {}
    }
});
