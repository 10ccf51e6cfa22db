use super::*;

const MS: Duration = Duration::from_millis(1);

/// `tokens` uncached behind `ahead`, nothing cached.
pub(crate) fn p(ahead: u64, tokens: u64) -> Prefill {
    Prefill {
        ahead,
        tokens,
        cached: 0,
        step_wait_s: 0.0,
        step_left_s: None,
        step_s: 0.0,
    }
}

/// A replica that prefills 10k tokens/s and whose gap grows from 10 ms at batch 1 to 40 ms
/// at 32 and 80 ms at 64: the knee for a 50 ms promise lies between 32 and 64. Shared with
/// `admission.rs`'s tests.
pub(crate) fn learnt() -> LatencyModel {
    let mut m = LatencyModel::default();
    for _ in 0..20 {
        m.observe_ttft(p(0, 200), 20 * MS);
        m.observe_ttft(p(0, 1000), 100 * MS);
        m.observe_ttft(p(3000, 1000), 400 * MS);
        m.observe_itl(1, 10 * MS);
        m.observe_itl(32, 40 * MS);
        m.observe_itl(64, 80 * MS);
    }
    m
}

#[test]
fn what_the_data_shows_beats_the_prior() {
    // The prior says 8k tokens/s; the replica really does 2k.
    let mut m = LatencyModel::default();
    for i in 0..200u64 {
        let n = 100 + (i % 20) * 200;
        m.observe_ttft(p(0, n), Duration::from_secs_f64(0.01 + n as f64 / 2_000.0));
    }
    let rate = m.prefill_rate().unwrap();
    assert!((rate - 2_000.0).abs() < 200.0, "{rate}");
}

#[test]
fn the_fit_learns_from_the_step_a_request_joins_not_the_one_it_waited_for() {
    // 100 ms steps; a 50-token request waits out the running step (sent at any phase),
    // then takes one step of its own. Told the wait, the fit learns the one step and the
    // prediction plus the wait is right at every phase; the fit alone is a step and a half.
    let (mut told, mut blind) = (LatencyModel::default(), LatencyModel::default());
    for i in 0..200u64 {
        let wait = (i * 37 % 100) as f64 / 1000.0;
        let ttft = Duration::from_secs_f64(wait + 0.1);
        told.observe_ttft(
            Prefill {
                step_wait_s: wait,
                ..p(0, 50)
            },
            ttft,
        );
        blind.observe_ttft(p(0, 50), ttft);
    }
    let own = told.predict_ttft(0, 50, 0).unwrap().as_secs_f64();
    assert!((own - 0.1).abs() < 0.005, "{own}");
    let mean = blind.predict_ttft(0, 50, 0).unwrap().as_secs_f64();
    assert!((mean - 0.15).abs() < 0.01, "{mean}");
}

#[test]
fn prefills_hidden_under_a_decode_step_do_not_bend_the_line() {
    // A busy replica with 100 ms decode steps that computes 4k prefill tokens/s: a step
    // takes the larger of the two. The line learns from the steps prefill lengthened only.
    let truth = |u: u64| (0.01 + u as f64 / 4_000.0).max(0.1);
    let mut m = LatencyModel::default();
    for i in 0..300u64 {
        let u = 100 + (i * 131) % 1900;
        let pf = Prefill {
            step_s: 0.1,
            ..p(0, u)
        };
        m.observe_ttft(pf, Duration::from_secs_f64(truth(u)));
    }
    for u in [800, 2000] {
        let t = m.predict_ttft(0, u, 0).unwrap().as_secs_f64();
        assert!((t - truth(u)).abs() < 0.03 * truth(u), "{u}: {t}");
    }
}

#[test]
fn the_knee_follows_decode_steps_and_the_p95_sees_stalls() {
    // Decode steps of 80 ms, and one step in ten also carries a 600 ms prefill chunk: the
    // mean is 132 ms, the decode step (median) 80 ms, the p95 a stall.
    let mut m = LatencyModel::default();
    for i in 0..4000 {
        let gap = if i % 10 == 0 { 600 * MS } else { 80 * MS };
        m.observe_itl(16, gap);
    }
    let p95 = m.predict_itl_p95(16).unwrap().as_secs_f64();
    assert!(p95 > 0.3, "{p95}");
    let step = m.predict_itl(16).unwrap().as_secs_f64();
    assert!((step - 0.08).abs() < 0.01, "{step}");
    // One stall in a hundred stays under the p95.
    let mut m = LatencyModel::default();
    for i in 0..4000 {
        let gap = if i % 100 == 0 { 600 * MS } else { 80 * MS };
        m.observe_itl(16, gap);
    }
    let p = m.predict_itl_p95(16).unwrap().as_secs_f64();
    assert!(p < 0.12, "{p}");
}

#[test]
fn the_current_step_follows_the_latest_gaps_whatever_the_batch() {
    let mut m = LatencyModel::default();
    assert_eq!(m.current_step(), None);
    // A first stall, then a busy batch's 100 ms steps, then the batch drains to 60 ms.
    m.observe_itl(1, 400 * MS);
    for _ in 0..200 {
        m.observe_itl(64, 100 * MS);
    }
    let busy = m.current_step().unwrap().as_secs_f64();
    assert!((busy - 0.1).abs() < 0.01, "{busy}");
    for _ in 0..200 {
        m.observe_itl(4, 60 * MS);
    }
    let now = m.current_step().unwrap().as_secs_f64();
    assert!((now - 0.06).abs() < 0.01, "{now}");
    // The batch bucket of the first gap still holds the stall.
    assert_eq!(m.predict_itl(1), Some(400 * MS));
}

#[test]
fn itl_prediction_interpolates_and_extrapolates() {
    let m = learnt();
    assert_eq!(m.predict_itl(1), Some(10 * MS));
    let mid = m.predict_itl(48).unwrap().as_secs_f64();
    assert!((mid - 0.060).abs() < 1e-9, "{mid}");
    let far = m.predict_itl(128).unwrap().as_secs_f64();
    assert!((far - 0.160).abs() < 1e-9, "{far}");
    assert_eq!(LatencyModel::default().predict_itl(4), None);
}

#[test]
fn the_step_ahead_moves_with_the_context_dispatched_since() {
    // 60 ms plus 0.5 µs per context token, seen as the context in flight rose from 0 to
    // 80k tokens: the current step is the last gaps' (~100 ms); 20k more tokens dispatched
    // since add ~10 ms, and as many finished take ~10 ms off.
    let mut m = LatencyModel::default();
    assert_eq!(m.step_at(1000), None);
    let mut t = Instant::now();
    for i in 0..4000u64 {
        let ctx = i * 20;
        let gap = Duration::from_secs_f64(0.060 + 0.5e-6 * ctx as f64);
        t += gap;
        m.observe_gap_at(t, 16, ctx, gap);
    }
    let now = m.current_step().unwrap().as_secs_f64();
    assert!((m.step_per_context_token() - 0.5e-6).abs() < 0.02e-6);
    let ahead = m.step_at(100_000).unwrap();
    assert!((ahead - now - 0.010).abs() < 0.002, "{ahead} vs {now}");
    let drained = m.step_at(60_000).unwrap();
    assert!((now - drained - 0.010).abs() < 0.002, "{drained} vs {now}");
    // Gaps seen without a context (`observe_itl`) move only the current step.
    let mut plain = LatencyModel::default();
    plain.observe_itl(16, 80 * MS);
    assert_eq!(plain.step_at(50_000), Some(0.08));
}

#[test]
fn the_current_step_learns_one_gap_per_step_end_not_one_per_stream() {
    let mut m = LatencyModel::default();
    let mut t = Instant::now();
    // Forty streams, 80 ms decode steps for four seconds: each step end reported forty
    // times, a millisecond apart at most.
    for _ in 0..50 {
        t += 80 * MS;
        for k in 0..40u32 {
            m.observe_gap_at(t + Duration::from_micros(u64::from(k) * 25), 40, 0, 80 * MS);
        }
    }
    let before = m.current_step().unwrap().as_secs_f64();
    assert!((before - 0.08).abs() < 0.005, "{before}");
    // One 300 ms step (a prefill chunk), reported by all forty: the median moves once.
    t += 300 * MS;
    for k in 0..40u32 {
        m.observe_gap_at(
            t + Duration::from_micros(u64::from(k) * 25),
            40,
            0,
            300 * MS,
        );
    }
    let after = m.current_step().unwrap().as_secs_f64();
    assert!(after < 0.09, "one step moved the median to {after}");
}

#[test]
fn a_burst_of_context_prices_the_step_at_the_new_context() {
    // 60 ms plus 2 µs per context token, forty streams reporting every step end. The slope is
    // learnt as the context wanders between 5k and 25k tokens; then a hot prefix brings 40k
    // more within five steps. The step a new stream would see is the new context's, although
    // the median has moved only a few steps towards it.
    let truth = |ctx: u64| 0.060 + 2e-6 * ctx as f64;
    let mut m = LatencyModel::default();
    let mut t = Instant::now();
    let mut step_end = |m: &mut LatencyModel, ctx: u64| {
        let gap = Duration::from_secs_f64(truth(ctx));
        t += gap;
        for k in 0..40u32 {
            m.observe_gap_at(t + Duration::from_micros(u64::from(k) * 25), 40, ctx, gap);
        }
    };
    for i in 0..400u64 {
        step_end(&mut m, 5_000 + (i * 997) % 20_000);
    }
    for i in 0..200u64 {
        step_end(&mut m, 15_000 + (i % 3) * 100);
    }
    for i in 1..=5u64 {
        step_end(&mut m, 15_000 + i * 8_000);
    }
    let now = m.current_step().unwrap().as_secs_f64();
    assert!(
        now < 0.85 * truth(55_000),
        "the median has not caught up: {now}"
    );
    let predicted = m.step_at(55_000).unwrap();
    assert!(
        (predicted - truth(55_000)).abs() < 0.1 * truth(55_000),
        "{predicted} vs {}",
        truth(55_000)
    );
}

#[test]
fn a_request_sent_too_late_for_the_next_step_teaches_the_lag_not_the_fit() {
    // 100 ms decode steps; a 50-token prefill hides under one. Requests reach the engine 8 ms
    // after they are sent: sent with less than that of the running step left, they miss the
    // next step and their first token comes a step later.
    let mut m = LatencyModel::default();
    for i in 0..400u64 {
        let left = (i % 20) as f64 / 1000.0;
        let missed = left < 0.008;
        let ttft = left + if missed { 0.2 } else { 0.1 };
        m.observe_ttft(
            Prefill {
                step_wait_s: left,
                step_left_s: Some(left),
                step_s: 0.1,
                ..p(0, 50)
            },
            Duration::from_secs_f64(ttft),
        );
    }
    assert!((m.step_lag() - 0.008).abs() <= 0.001, "{}", m.step_lag());
    // The fit was not taught the missed steps as prefill: a 2k-token prompt is priced by the
    // prior, not by a hundred milliseconds of phantom overhead.
    let t = m.predict_ttft(0, 2_000, 0).unwrap().as_secs_f64();
    let prior = GENERIC_OVERHEAD_S + 2_000.0 / GENERIC_PREFILL_RATE;
    assert!((t - prior).abs() < 0.03, "{t} vs {prior}");
}

#[test]
fn only_a_foreground_answer_mostly_prefill_teaches_the_fit() {
    let ms = Duration::from_millis;
    assert_eq!(taught_prefill(ms(1_000), ms(200), false), Some(ms(800)));
    assert_eq!(
        taught_prefill(ms(1_000), ms(300), false),
        None,
        "decode over a quarter"
    );
    // A batch line the step model underpriced: 3.35 s with 0.5 s of predicted decode.
    assert_eq!(taught_prefill(ms(3_350), ms(500), true), None);
    assert_eq!(taught_prefill(ms(3_350), ms(500), false), Some(ms(2_850)));
}
