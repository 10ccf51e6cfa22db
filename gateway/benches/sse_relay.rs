//! The relay's per-token work: a stream's token events through [`SseTap::feed`] (event cut,
//! JSON-object check, token count), and the JSON-object check alone three ways: the stream
//! checker (full check of the first event, then only the string that changed), a full check
//! of every event, and a serde_json pass over each (what issue 27 first shipped with). Run:
//! `cargo bench -p gateway --bench sse_relay`.

use bytes::Bytes;
use config::HitSignals;
use criterion::{criterion_group, criterion_main, Criterion};
use gateway::request::json_check::{is_json_object, EventChecker};
use gateway::request::sse::{HitPolicy, SseTap};
use std::hint::black_box;

/// What a replica sends per token (the shape of vLLM's and kvgate's chat chunks), for a few
/// token texts.
fn events() -> Vec<Bytes> {
    [" the", " token", "s", ",", " naïve", "\\n", " 42"]
        .iter()
        .map(|t| {
            Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-5f0c1a2b3c4d5e6f\",\"object\":\"chat.completion.chunk\",\"created\":1733220000,\"model\":\"Qwen/Qwen3-8B\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
            ))
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let hits = HitPolicy {
        mode: HitSignals::Exact,
        round_tokens: 256,
        block_size: 16,
    };
    let events = events();
    let payloads: Vec<&[u8]> = events.iter().map(|e| &e[6..e.len() - 2]).collect();
    let mut g = c.benchmark_group("sse_relay");
    g.bench_function("feed_token_event", |b| {
        let mut tap = SseTap::default();
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % events.len();
            black_box(tap.feed(black_box(&events[i]), &hits))
        })
    });
    g.bench_function("check_stream_checker", |b| {
        let mut checker = EventChecker::default();
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % payloads.len();
            black_box(checker.check(black_box(payloads[i])))
        })
    });
    g.bench_function("check_full", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % payloads.len();
            black_box(is_json_object(black_box(payloads[i])))
        })
    });
    g.bench_function("check_serde_ignored_any", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % payloads.len();
            black_box(
                serde_json::from_slice::<serde::de::IgnoredAny>(black_box(payloads[i])).is_ok(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
