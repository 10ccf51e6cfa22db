use super::line_cap;

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
