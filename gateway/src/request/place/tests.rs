use std::sync::Arc;

use config::{GatewayConfig, PolicyConfig, PolicyFile};

use super::*;
use crate::fleet::client::http_client;
use crate::fleet::guards::{InFlight, PendingPrefill};
use crate::metrics::GatewayMetrics;
use crate::prefix::index::PrefixIndex;
use crate::prefix::zmq::EventSink;
use crate::request::prepared::Endpoint;
use crate::routes::model_scope::ModelScope;
use crate::routes::store::PolicyStore;

/// Two healthy replicas with live KV events and the same learnt speed (1,000 tokens/s, 10 ms
/// overhead), a `prefix_aware` catch-all route without a promise, and a 64-block prompt.
struct Fleet {
    registry: Arc<Registry>,
    prefix: PrefixView,
    policies: PolicyStore,
    prompt: Prepared,
}

fn fleet() -> Fleet {
    let mut file = PolicyFile::single(PolicyConfig::default());
    file.prefix_in_flight_wait_ms = 60_000;
    fleet_with(file)
}

impl Fleet {
    fn placer(&self) -> Placer<'_> {
        Placer {
            fleet: &self.registry,
            prefix: &self.prefix,
        }
    }

    /// Where `p` goes now on the first route, as a first dispatch that has not waited.
    fn dispatch(&self, p: &Prepared) -> Outcome {
        let placer = self.placer();
        let active = self.policies.load();
        let matched = placer.matched(p);
        let waited = Duration::ZERO;
        placer
            .place(
                &active,
                &active.routes[0],
                p,
                &matched,
                Purpose::Dispatch { waited },
            )
            .outcome
    }
}

/// The same two replicas under `file`'s routes.
fn fleet_with(file: PolicyFile) -> Fleet {
    let names: Vec<String> = vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()];
    let cfg = GatewayConfig::with_replicas(names.clone());
    let index = Arc::new(PrefixIndex::new(10_000, 1 << 20));
    let metrics = Arc::new(GatewayMetrics::new());
    let registry = Arc::new(Registry::new(
        &cfg,
        index.clone(),
        http_client(Duration::from_millis(100)),
        None,
        metrics.clone(),
    ));
    for r in registry.replicas().iter() {
        registry.set_healthy(r.slot, true);
        r.set_live(true);
        r.model.lock().set_prior(1_000.0, 0.01);
    }
    let policies = PolicyStore::new(
        file,
        None,
        None,
        names.into_iter().enumerate().collect(),
        vec![ModelScope::every_replica("Qwen3-8B")],
        metrics,
    );
    let hashes: Vec<u64> = (1..=64).collect();
    let prompt = Prepared {
        model: 0,
        block_size: 16,
        endpoint: Endpoint::Completions,
        stream: false,
        prompt_tokens: 64 * 16 + 8,
        largest_prompt_tokens: 64 * 16 + 8,
        hashes: hashes.into(),
        cacheable: 64,
        session_id: None,
        max_token_events: None,
        tokenize_seconds: 0.0,
        id_probe: None,
        doc: Arc::new(serde_json::Map::new()),
        scope: None,
    };
    Fleet {
        registry,
        prefix: PrefixView::new(index),
        policies,
        prompt,
    }
}

/// A request whose prefix replica 0 is still prefilling for an earlier one waits for it only
/// while waiting is predicted to beat going to replica 1 now — never longer than that gain,
/// on a route without a promise — and the wait's predicted gain is what explain and the access
/// log show.
#[test]
fn a_prefix_in_flight_is_waited_for_no_longer_than_its_predicted_gain() {
    let f = fleet();
    let placer = f.placer();
    let p = &f.prompt;
    // The earlier request carrying the prefix, sent to replica 0 and not answered yet: 300 of
    // its tokens still to prefill there (the speculative record says replica 0 holds it all).
    let holder = f.registry.replica(0).unwrap();
    let (_carrier, _) = PendingPrefill::new(holder, 300, p.hashes.clone(), false);
    f.prefix.sent(0, p.blocks(), None, f.registry.now_s());
    let active = f.policies.load();
    let route = &active.routes[0];
    assert!(route.slo.ttft.is_none(), "a route without a promise");
    let matched = placer.matched(p);
    assert_eq!(matched, vec![64, 0]);

    let at = |waited_ms: u64| {
        placer.place(
            &active,
            route,
            p,
            &matched,
            Purpose::Dispatch {
                waited: Duration::from_millis(waited_ms),
            },
        )
    };
    let first = at(0);
    assert!(
        matches!(
            first.outcome,
            Outcome::Hold {
                reason: "prefix_in_flight",
                blocking: false
            }
        ),
        "{:?}",
        first.outcome
    );
    // Replica 1 would prefill all 1,032 tokens cold (~1.04 s); replica 0 has ~0.3 s of the
    // carrier's prefill left and then 8 tokens of its own: waiting is worth ~0.7 s.
    let gain = first
        .hold_gain_s()
        .expect("prefix_aware predicts in seconds");
    assert!((0.5..0.9).contains(&gain), "gain {gain}");
    let gain_ms = (gain * 1e3) as u64;
    assert!(matches!(at(gain_ms / 2).outcome, Outcome::Hold { .. }));
    // Past its predicted gain it waits no more (the configured cap is a minute).
    match at(gain_ms + 1).outcome {
        Outcome::Go(d) => assert_eq!(d.replica, 0, "it still goes where the prefix is"),
        o => panic!("held past its predicted gain: {o:?}"),
    }
}

/// A batch line scoped to the replicas the trough found spare goes only to one of them, to
/// one with no batch prompt of this gateway's still prefilling there (so the lines of one
/// look spread), and is refused at once — never held — when none is left.
#[test]
fn a_scoped_request_goes_only_to_a_free_replica_of_its_scope_and_never_waits() {
    let mut f = fleet();
    f.prompt.scope = Some(vec![1].into());
    match f.dispatch(&f.prompt) {
        Outcome::Go(d) => assert_eq!(d.replica, 1),
        o => panic!("{o:?}"),
    }
    // An earlier line's prompt still prefilling on replica 1 (background work): the next
    // line of the same look goes to the other replica of its scope, or nowhere.
    let busy = f.registry.replica(1).unwrap();
    let (_line, _) = PendingPrefill::new(busy, 300, vec![99u64].into(), true);
    f.prompt.scope = Some(vec![0, 1].into());
    match f.dispatch(&f.prompt) {
        Outcome::Go(d) => assert_eq!(d.replica, 0),
        o => panic!("{o:?}"),
    }
    f.prompt.scope = Some(vec![1].into());
    match f.dispatch(&f.prompt) {
        Outcome::Fail(e) => {
            assert_eq!(e.status, 503);
            assert_eq!(e.body.error.code.as_deref(), Some(NO_SPARE_REPLICA));
        }
        o => panic!("a scoped request was not refused: {o:?}"),
    }
    // Unscoped, the same request may go to either.
    f.prompt.scope = None;
    assert!(matches!(f.dispatch(&f.prompt), Outcome::Go(_)));
}

/// A foreground request weighs only foreground load: replica 0 running three batch lines
/// (background) and replica 1 one interactive stream, a new interactive request with no
/// prefix anywhere goes to replica 0, while the fleet as batch work sees it counts all four.
#[test]
fn a_foreground_request_does_not_count_background_lines_as_load() {
    let f = fleet();
    let lines = f.registry.replica(0).unwrap();
    let _lines: Vec<_> = (0..3)
        .map(|_| InFlight::new(lines.clone(), 400, true))
        .collect();
    let _stream = InFlight::new(f.registry.replica(1).unwrap(), 400, false);
    let loads = |background| -> Vec<u32> {
        f.registry
            .snapshot(background)
            .replicas
            .iter()
            .map(|r| r.load.requests())
            .collect()
    };
    assert_eq!(loads(false), vec![0, 1]);
    assert_eq!(loads(true), vec![3, 1]);

    assert!(!f.policies.load().routes[0].background());
    assert_eq!(f.placer().matched(&f.prompt), vec![0, 0]);
    match f.dispatch(&f.prompt) {
        Outcome::Go(d) => assert_eq!(d.replica, 0, "the replica without foreground work"),
        o => panic!("{o:?}"),
    }
}

/// A cold prompt held on every replica only because its prefill would stall streams already
/// over the stall budget does not block the queue (a mostly cached request behind it stalls
/// nobody and may go); held for its predicted TTFT as well, it does.
#[test]
fn a_hold_for_stalls_alone_does_not_block_the_queue() {
    let names = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
    let policy = |ttft_ms: u64| {
        let text = format!(
            "[policy]\nkind = \"prefix_aware\"\n[[routes]]\nname = \"chat\"\n\
             slo = {{ ttft_ms = {ttft_ms}, itl_ms = 150 }}\n"
        );
        PolicyFile::from_toml(&text, &names).unwrap()
    };
    for (ttft_ms, blocking) in [(20_000, false), (1_000, true)] {
        let f = fleet_with(policy(ttft_ms));
        // Both replicas stream (30 ms steps), and one gap in twelve carries a 250 ms prefill
        // chunk: 8% of gaps stall, over the 5% budget.
        let _streams: Vec<_> = (0..2)
            .map(|i| InFlight::new(f.registry.replica(i).unwrap(), 400, false))
            .collect();
        for r in f.registry.replicas().iter() {
            let mut m = r.model.lock();
            for i in 0..2000 {
                m.observe_itl(2, Duration::from_millis(if i % 12 == 0 { 250 } else { 30 }));
            }
        }
        // 1,032 cold tokens at 1,000 tokens/s: a ~1 s prefill, one more stall everywhere.
        match f.dispatch(&f.prompt) {
            Outcome::Hold { blocking: b, .. } => {
                assert_eq!(b, blocking, "ttft target {ttft_ms} ms")
            }
            o => panic!("a cold prompt went: {o:?}"),
        }
        // The same conversation's next turn, all but 8 tokens cached on replica 0, goes there.
        f.prefix
            .sent(0, f.prompt.blocks(), None, f.registry.now_s());
        match f.dispatch(&f.prompt) {
            Outcome::Go(d) => assert_eq!(d.replica, 0),
            o => panic!("a cached turn was held: {o:?}"),
        }
    }
}
