//! The gateway's routing decision for a 32k-token multi-turn chat: parse the body, render the
//! chat template, tokenise, hash ~2,000 blocks, match them in the prefix index and score 8
//! replicas. Cold: an empty segment cache (every message tokenised). Warm: the conversation was
//! seen before (every message segment cached), as when a client resends its history each turn.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use config::GatewayConfig;
use criterion::{criterion_group, criterion_main, Criterion};
use gateway::fleet::client::http_client;
use gateway::fleet::registry::Registry;
use gateway::metrics::GatewayMetrics;
use gateway::prefix::index::PrefixIndex;
use gateway::prefix::view::PrefixView;
use gateway::request::prepare::Preparer;
use gateway::request::prepared::{Caller, Endpoint, Prepared, PromptLimits};

const LIMITS: PromptLimits = PromptLimits {
    per_prompt: 131_072,
    per_request: 262_144,
};
use protocol::tokenizer::{default_tokenizer_dir, TextTokenizer};

const PARAGRAPH: &str = "Prefix caching keeps the attention keys and values of a shared prompt in \
paged blocks, so a second request that starts the same way skips most of its prefill. A router \
that knows which replica holds which prefix can send each conversation back to the cache that \
already knows it, while a load guard keeps any one replica from becoming a hot spot. ";

fn conversation(tok: &TextTokenizer) -> (Bytes, usize) {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a careful assistant."})];
    for turn in 0..40 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": format!("Turn {turn}. {}", PARAGRAPH.repeat(12))}));
    }
    let body = serde_json::json!({"model": "Qwen3-8B", "messages": messages, "max_tokens": 16});
    let msgs: Vec<protocol::openai::ChatMessage> =
        serde_json::from_value(body["messages"].clone()).unwrap();
    let n = tok.encode_chat(&msgs, true, None, None).unwrap().len();
    (Bytes::from(serde_json::to_vec(&body).unwrap()), n)
}

/// The prepare stage and what placement reads: 8 healthy replicas, an empty prefix index.
struct Gateway {
    preparer: Preparer,
    registry: Arc<Registry>,
    prefix: PrefixView,
}

fn router(tok: Arc<TextTokenizer>) -> Gateway {
    let names: Vec<String> = (0..8).map(|i| format!("127.0.0.1:{}", 9000 + i)).collect();
    let cfg = GatewayConfig::with_replicas(names);
    let index = Arc::new(PrefixIndex::new(100_000, 1 << 20));
    let metrics = Arc::new(GatewayMetrics::new());
    let registry = Arc::new(Registry::new(
        &cfg,
        index.clone(),
        http_client(Duration::from_millis(100)),
        None,
        metrics.clone(),
    ));
    for i in 0..8 {
        registry.set_healthy(i, true);
    }
    Gateway {
        preparer: Preparer::new(tok, "Qwen3-8B".into(), 16, metrics),
        registry,
        prefix: PrefixView::new(index),
    }
}

fn bench(c: &mut Criterion) {
    let dir = default_tokenizer_dir().expect("run scripts/fetch-models.sh");
    let tok = Arc::new(TextTokenizer::from_dir(&dir).unwrap());
    let (body, tokens) = conversation(&tok);
    println!(
        "conversation: {tokens} tokens, {} bytes of JSON",
        body.len()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let policy = policies::build(&config::PolicyConfig::default());
    let decide = |r: &Gateway, p: &Prepared| {
        // What placement does for a dispatch with admission off: one fleet snapshot, the
        // index's match counts, the policy.
        let matched = r.prefix.matched(p.blocks(), &r.registry.index_scope());
        let set = r.registry.snapshot(false);
        let req = policies::RouteRequest {
            block_hashes: &p.hashes,
            prompt_tokens: p.prompt_tokens,
            block_size: p.block_size,
            matched_blocks: &matched,
            offloaded_blocks: &[],
            session_id: p.session_id.as_deref(),
            itl_target_s: None,
            prefix_reuse: &[],
            dry_run: false,
        };
        policy.route(&req, &set).unwrap()
    };
    let mut g = c.benchmark_group("route_decision_32k_chat");
    g.sample_size(20);
    g.bench_function("cold_segment_cache", |b| {
        b.iter_batched(
            || router(tok.clone()),
            |r| {
                let p = r
                    .preparer
                    .prepare(Endpoint::ChatCompletions, &body, &Caller::default(), LIMITS)
                    .unwrap();
                decide(&r, &p)
            },
            criterion::BatchSize::PerIteration,
        )
    });
    let warm = router(tok.clone());
    let p = warm
        .preparer
        .prepare(Endpoint::ChatCompletions, &body, &Caller::default(), LIMITS)
        .unwrap();
    let d = decide(&warm, &p);
    warm.prefix
        .sent(d.replica, p.blocks(), None, warm.registry.now_s());
    g.bench_function("warm_segment_cache", |b| {
        b.iter(|| {
            let p = warm
                .preparer
                .prepare(Endpoint::ChatCompletions, &body, &Caller::default(), LIMITS)
                .unwrap();
            decide(&warm, &p)
        })
    });
    g.finish();

    // A completions prompt of ~3,600 tokens whose first ~3,000 a request of the same tenant
    // sent before (inference-perf's shared_prefix shape): prepared by a tenant that never sent
    // it (every piece tokenised) against the tenant that did (only the new question).
    let shared: String = (0..150)
        .map(|k| {
            format!("Clause {k} of the shared contract binds the supplier to deliver on time. ")
        })
        .collect();
    let prompt = |i: usize| {
        let q: String = (0..30)
            .map(|k| format!("Question {i} part {k} asks about the delivery terms here. "))
            .collect();
        let body = serde_json::json!({"model": "Qwen3-8B", "prompt": format!("{shared}{q}"), "max_tokens": 16});
        Bytes::from(serde_json::to_vec(&body).unwrap())
    };
    let n = warm
        .preparer
        .prepare(
            Endpoint::Completions,
            &prompt(0),
            &Caller::default(),
            LIMITS,
        )
        .unwrap()
        .prompt_tokens;
    println!("completions prompt: {n} tokens");
    let mut g = c.benchmark_group("prepare_completions_shared_prefix");
    g.sample_size(30);
    let mut i = 1;
    g.bench_function("prefix_unseen_by_this_tenant", |b| {
        b.iter(|| {
            i += 1;
            let caller = Caller {
                session_id: None,
                tenant_salt: Some(format!("kvgate-tenant:t{i}")),
            };
            warm.preparer
                .prepare(Endpoint::Completions, &prompt(i), &caller, LIMITS)
                .unwrap()
                .prompt_tokens
        })
    });
    g.bench_function("prefix_seen_by_this_tenant", |b| {
        b.iter(|| {
            i += 1;
            warm.preparer
                .prepare(
                    Endpoint::Completions,
                    &prompt(i),
                    &Caller::default(),
                    LIMITS,
                )
                .unwrap()
                .prompt_tokens
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
