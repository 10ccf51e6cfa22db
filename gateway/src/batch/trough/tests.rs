use super::{line_cap, room};

#[test]
fn an_idle_replica_takes_the_whole_cap() {
    assert_eq!(line_cap(8, 0.0, 0.7), 8);
}

#[test]
fn the_cap_falls_with_the_room_used_and_closes_at_the_headroom() {
    let caps: Vec<usize> = [0.0, 0.175, 0.35, 0.525, 0.69, 0.7, 0.9]
        .iter()
        .map(|&room| line_cap(8, room, 0.7))
        .collect();
    assert_eq!(caps, vec![8, 6, 4, 2, 1, 0, 0]);
}

#[test]
fn a_signal_that_is_not_a_number_closes_the_replica() {
    assert_eq!(line_cap(8, f64::NAN, 0.7), 0);
    assert_eq!(line_cap(8, -0.1, 0.7), 8);
}

#[test]
fn the_peaks_stall_share_closes_the_replica_and_the_nights_does_not() {
    // The full-size day's trace (BENCHMARKS, issue 33): at night KV 0.15 of the high-water
    // mark and 0.4% of gaps over the inter-token promise; at the peak 0.44 and 2.2%.
    assert_eq!(line_cap(8, room(0.15, Some(0.004)), 0.7), 7);
    assert_eq!(line_cap(8, room(0.44, Some(0.022)), 0.7), 0);
    // Half the budget is batch work's: past 1.75% it closes at a 0.7 headroom, whatever the KV.
    assert_eq!(line_cap(8, room(0.1, Some(0.018)), 0.7), 0);
    // KV 0.44 alone leaves 3.
    assert_eq!(line_cap(8, room(0.44, None), 0.7), 3);
}
