//! Tests of the rule cache (`super`: rules.rs).

use super::*;

fn empty_rules() -> Box<Rules> {
    Box::new(Rules {
        table: 0,
        keys: [[0; RULE_WAYS]; RULE_SETS],
        rules: [[Rule::default(); RULE_WAYS]; RULE_SETS],
    })
}

fn rule(offset: i32) -> Rule {
    Rule {
        form: Form::Step,
        cfa_offset: offset,
        ..Rule::default()
    }
}

/// `n` distinct keys that all fall in one set.
fn keys_of_one_set(n: usize) -> Vec<u64> {
    let want = rule_set(0x7f00_0000_1000);
    (0x7f00_0000_1000u64..)
        .filter(|&k| rule_set(k) == want)
        .take(n)
        .collect()
}

#[test]
fn a_set_keeps_its_eight_newest_rules_and_a_new_table_empties_the_cache() {
    let mut rules = empty_rules();
    rules.use_table(1);
    let keys = keys_of_one_set(RULE_WAYS + 1);
    for (i, &k) in keys[..RULE_WAYS].iter().enumerate() {
        rules.insert(k, rule(i as i32 * 16));
    }
    for (i, &k) in keys[..RULE_WAYS].iter().enumerate() {
        let got = rules.get(k).expect("eight keys of one set are all kept");
        assert_eq!(got.cfa_offset, i as i32 * 16, "key {k:#x} has its own rule");
    }
    rules.insert(keys[RULE_WAYS], rule(999));
    assert!(
        rules.get(keys[0]).is_none(),
        "a ninth key forgets the oldest"
    );
    assert_eq!(rules.get(keys[RULE_WAYS]).map(|r| r.cfa_offset), Some(999));
    assert_eq!(rules.get(keys[1]).map(|r| r.cfa_offset), Some(16));
    rules.use_table(1);
    assert!(
        rules.get(keys[1]).is_some(),
        "the same table keeps the rules"
    );
    rules.use_table(2);
    assert!(
        keys.iter().all(|&k| rules.get(k).is_none()),
        "rules found with another module table are not used"
    );
}
