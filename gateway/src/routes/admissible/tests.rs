use super::*;
use crate::fleet::latency_model::tests::learnt;

const MS: Duration = Duration::from_millis(1);

fn slo() -> Slo {
    Slo {
        ttft: Some(1000 * MS),
        itl: Some(50 * MS),
    }
}

#[test]
fn admits_under_the_slo() {
    let m = learnt();
    let rate = m.prefill_rate().unwrap();
    assert!((rate - 10_000.0).abs() < 500.0, "{rate}");
    let p = ReplicaPressure {
        running: 8,
        queued_prefill_tokens: 2_000,
        kv_usage: 0.5,
        preempting: false,
    };
    assert_eq!(admissible(&m, &p, 3_000, 0, &slo(), 0.9), Ok(()));
    // A model with nothing learnt predicts from its prior (8k tokens/s): a busy replica
    // holds a prompt that would take minutes, an idle one takes anything.
    assert_eq!(
        admissible(&LatencyModel::default(), &p, 1_000_000, 0, &slo(), 0.9)
            .unwrap_err()
            .label(),
        "ttft"
    );
    assert_eq!(
        admissible(
            &LatencyModel::default(),
            &ReplicaPressure::default(),
            1_000_000,
            0,
            &slo(),
            0.9
        ),
        Ok(())
    );
}

#[test]
fn a_long_prompt_after_many_short_ones_is_priced_from_the_prior() {
    // A replica that says it prefills 20k tokens/s; 100 short prompts, each mostly fixed
    // overhead (50 tokens in 25 ms: "2,000 tokens/s" if read as a rate).
    let mut m = LatencyModel::default();
    m.set_prior(20_000.0, 0.02);
    for _ in 0..100 {
        m.observe_ttft(crate::fleet::latency_model::tests::p(0, 50), 25 * MS);
    }
    let six_k = m.predict_ttft(0, 6_000, 0).unwrap();
    assert!(
        six_k > 250 * MS && six_k < 450 * MS,
        "a 6k prompt is ~0.3 s of prefill, not 3 s: {six_k:?}"
    );
    let short = m.predict_ttft(0, 50, 0).unwrap();
    assert!((short.as_secs_f64() - 0.025).abs() < 0.005, "{short:?}");
    // Busy, with 0.4 s of work queued: a 6k prompt still fits a 1 s promise.
    let busy = ReplicaPressure {
        running: 4,
        queued_prefill_tokens: 4_000,
        ..ReplicaPressure::default()
    };
    assert_eq!(admissible(&m, &busy, 6_000, 0, &slo(), 0.9), Ok(()));
}

#[test]
fn a_cache_miss_waits_while_the_replicas_streams_stall_too_often() {
    // Decode steps of 30 ms; one step in twelve carries a 250 ms prefill chunk (8%).
    let mut m = LatencyModel::default();
    m.set_prior(4_000.0, 0.02);
    for i in 0..2000 {
        let gap = if i % 12 == 0 { 250 * MS } else { 30 * MS };
        m.observe_itl(16, gap);
    }
    let busy = ReplicaPressure {
        running: 16,
        ..ReplicaPressure::default()
    };
    let slo = Slo {
        ttft: Some(1000 * MS),
        itl: Some(150 * MS),
    };
    // The decode step (30 ms) is far from the knee, but 8% of gaps stall: a 2,000-token
    // miss (0.5 s of prefill, one more stall) waits; a mostly cached turn (100 tokens,
    // 25 ms) goes.
    match admissible(&m, &busy, 2_000, 0, &slo, 0.9) {
        Err(Hold::Stalls { share }) => assert!((share - 1.0 / 12.0).abs() < 0.01),
        other => panic!("{other:?}"),
    }
    assert_eq!(admissible(&m, &busy, 100, 0, &slo, 0.9), Ok(()));
    // Having waited until its TTFT budget covers its prediction (~0.52 s) by less than the
    // margin, the miss goes rather than wait on into a TTFT hold and a shed.
    let late = Slo {
        ttft: Some(600 * MS),
        ..slo
    };
    assert_eq!(admissible(&m, &busy, 2_000, 0, &late, 0.9), Ok(()));
    let earlier = Slo {
        ttft: Some(700 * MS),
        ..slo
    };
    assert!(matches!(
        admissible(&m, &busy, 2_000, 0, &earlier, 0.9),
        Err(Hold::Stalls { .. })
    ));
    // At 3% stalls the same miss goes.
    let mut calm = LatencyModel::default();
    calm.set_prior(4_000.0, 0.02);
    for i in 0..2000 {
        let gap = if i % 33 == 0 { 250 * MS } else { 30 * MS };
        calm.observe_itl(16, gap);
    }
    assert_eq!(admissible(&calm, &busy, 2_000, 0, &slo, 0.9), Ok(()));
}

#[test]
fn holds_when_the_replica_is_at_its_predicted_knee() {
    let m = learnt();
    // 40 running: one more sequence is predicted at 40 + (41-32)/32 * 40 = 51.25 ms > 50 ms.
    let at_knee = ReplicaPressure {
        running: 40,
        ..ReplicaPressure::default()
    };
    match admissible(&m, &at_knee, 100, 0, &slo(), 0.9) {
        Err(Hold::Itl { predicted }) => {
            assert!((predicted.as_secs_f64() - 0.05125).abs() < 1e-6)
        }
        other => panic!("{other:?}"),
    }
    let below = ReplicaPressure {
        running: 30,
        ..ReplicaPressure::default()
    };
    assert_eq!(admissible(&m, &below, 100, 0, &slo(), 0.9), Ok(()));
    // Too much prefill queued ahead breaks the TTFT promise instead: (8k + 3k) / 10k = 1.1 s.
    let backed_up = ReplicaPressure {
        queued_prefill_tokens: 8_000,
        ..ReplicaPressure::default()
    };
    assert_eq!(
        admissible(&m, &backed_up, 3_000, 0, &slo(), 0.9)
            .unwrap_err()
            .label(),
        "ttft"
    );
}

#[test]
fn leading_indicators_cut_admission_off() {
    let m = learnt();
    let preempting = ReplicaPressure {
        running: 1,
        preempting: true,
        ..ReplicaPressure::default()
    };
    assert_eq!(
        admissible(&m, &preempting, 10, 0, &slo(), 0.9),
        Err(Hold::Preempting)
    );
    let full = ReplicaPressure {
        running: 4,
        kv_usage: 0.95,
        ..ReplicaPressure::default()
    };
    assert_eq!(
        admissible(&m, &full, 10, 0, &slo(), 0.9),
        Err(Hold::KvHighWater { usage: 0.95 })
    );
    // An idle replica takes a prompt that fills most of its cache.
    let idle = ReplicaPressure {
        kv_usage: 0.95,
        ..ReplicaPressure::default()
    };
    assert_eq!(admissible(&m, &idle, 10, 0, &slo(), 0.9), Ok(()));
}
