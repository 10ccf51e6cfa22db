use super::*;

fn replicas() -> Vec<String> {
    (1..=4).map(|i| format!("127.0.0.1:800{i}")).collect()
}

const FILE: &str = r#"
version = "t1"
[policy]
kind = "prefix_aware"

[[routes]]
name = "long"
min_prompt_tokens = 8192
pool = ["127.0.0.1:8004", 2]
max_concurrency = 2
slo = { ttft_ms = 10000, itl_ms = 80 }
[routes.policy]
kind = "least_load"

[[routes]]
name = "batch"
priority = "batch"

[[routes]]
name = "interactive"
slo = { ttft_ms = 1000, itl_ms = 50 }
"#;

#[test]
fn classifies_by_length_then_priority() {
    let f = PolicyFile::from_toml(FILE, &replicas()).unwrap();
    assert_eq!(f.classify(10_000, Priority::Batch), 0);
    assert_eq!(f.classify(100, Priority::Batch), 1);
    assert_eq!(f.classify(100, Priority::Interactive), 2);
    assert_eq!(f.pool(0, &replicas()), vec![2, 3]);
    assert_eq!(f.pool(2, &replicas()), vec![0, 1, 2, 3]);
    assert_eq!(f.routes[0].policy.as_ref().unwrap().kind(), "least_load");
    assert_eq!(f.routes[2].slo.itl_ms, Some(50));
    assert_eq!(f.routes[1].queue_size, 256);
}

#[test]
fn shipped_default_is_valid() {
    let f = PolicyFile::from_toml(DEFAULT_POLICY, &replicas()).unwrap();
    let names: Vec<&str> = f.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["long", "batch", "interactive"]);
    assert_eq!(f.classify(32_000, Priority::Interactive), 0);
    assert_eq!(f.classify(500, Priority::Batch), 1);
    assert_eq!(f.routes[2].slo.ttft_ms, Some(1000));
}

#[test]
fn shipped_cpu_policy_is_valid_and_looser() {
    let f = PolicyFile::from_toml(CPU_POLICY, &replicas()).unwrap();
    let names: Vec<&str> = f.routes.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["long", "batch", "interactive"]);
    assert_eq!(f.classify(3_000, Priority::Interactive), 0);
    assert!(f.routes[2].slo.ttft_ms.unwrap() > 1000);
}

#[test]
fn empty_or_routeless_file_is_refused() {
    for text in ["", "\n\n", "version = \"default-1\"\nkv_high_water = 0.9\n"] {
        let e = PolicyFile::from_toml(text, &replicas())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("must list its [[routes]] or name a [policy]"),
            "{e}"
        );
    }
    let f = PolicyFile::from_toml("[policy]\nkind = \"least_load\"", &replicas()).unwrap();
    assert_eq!(f.routes.len(), 1);
    assert_eq!(f.routes[0].name, "default");
    assert_eq!(f.classify(1 << 20, Priority::Batch), 0);
}

#[test]
fn cache_groups_map_tenants_to_one_owner() {
    let f = PolicyFile::from_toml(
        "cache_groups = [[\"a\", \"b\"]]\n[policy]\nkind = \"prefix_aware\"",
        &replicas(),
    )
    .unwrap();
    assert_eq!(f.cache_owner("b"), "a");
    assert_eq!(f.cache_owner("a"), "a");
    assert_eq!(f.cache_owner("c"), "c");
    assert!(PolicyFile::from_toml(
        "cache_groups = [[\"a\"]]\n[policy]\nkind = \"prefix_aware\"",
        &replicas()
    )
    .is_err());
}

#[test]
fn stream_idle_timeout_follows_the_itl_promise() {
    let mut r = RouteConfig::catch_all("x");
    assert_eq!(r.stream_idle_timeout().as_secs(), 60);
    r.slo.itl_ms = Some(50);
    assert_eq!(r.stream_idle_timeout().as_millis(), 2_000);
    r.slo.itl_ms = Some(150);
    assert_eq!(r.stream_idle_timeout().as_millis(), 6_000);
    r.stream_idle_timeout_ms = Some(500);
    assert_eq!(r.stream_idle_timeout().as_millis(), 500);
}

#[test]
fn reports_every_problem_with_field_value_reason() {
    let bad = r#"
kv_high_water = 1.5
[[routes]]
name = "long"
min_prompt_tokens = 8192
pool = ["10.0.0.9:8000", 7]
max_concurrency = 0
slo = { ttft_ms = 0 }
[routes.policy]
kind = "consistent_hash"
load_factor = 0.5

[[routes]]
name = "long"
priority = "batch"
"#;
    let e = PolicyFile::from_toml(bad, &replicas())
        .unwrap_err()
        .to_string();
    for needle in [
        "kv_high_water = 1.5: must be in (0, 1]",
        "routes[1] = \"long\": the last route must have no rules",
        "routes[0].pool[0] = \"10.0.0.9:8000\": not one of the gateway's replicas",
        "routes[0].pool[1] = 7",
        "routes[0].max_concurrency = 0",
        "routes[0].slo.ttft_ms = 0",
        "routes[0].policy.load_factor = 0.5",
        "routes[1].name = \"long\": route names must be unique",
    ] {
        assert!(e.contains(needle), "{needle} in {e}");
    }
    assert!(matches!(
        PolicyFile::from_toml("[[routes]]\nname = \"x\"\nbogus = 1", &replicas()),
        Err(ConfigError::Parse(_))
    ));
    assert!(PolicyFile::from_toml(
        "[[routes]]\nname = \"x\"\npriority = \"urgent\"",
        &replicas()
    )
    .is_err());
}

#[test]
fn routes_for_one_model_need_a_catch_all_for_it_and_name_served_models() {
    let f = PolicyFile::from_toml(
        r#"
[[routes]]
name = "interactive"
models = ["small"]
slo = { ttft_ms = 15000 }

[[routes]]
name = "interactive"
models = ["big"]
slo = { ttft_ms = 1000 }
"#,
        &replicas(),
    )
    .unwrap();
    // The same name twice is fine when no model has both; each model has its catch-all (and
    // a model the file names in no route has none).
    f.check_models(&["big", "small"]).unwrap();
    let e = f.check_models(&["big"]).unwrap_err().to_string();
    assert!(
        e.contains("routes[0].models") && e.contains("not a served model"),
        "{e}"
    );
    let e = f
        .check_models(&["big", "small", "third"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"third\""), "{e}");
    let only_small = PolicyFile::from_toml(
        "[[routes]]\nname = \"a\"\nmodels = [\"small\"]\n",
        &replicas(),
    )
    .unwrap();
    let e = only_small
        .check_models(&["big", "small"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"big\"") && e.contains("catch-all"), "{e}");
    let twice = PolicyFile::from_toml(
        "[[routes]]\nname = \"a\"\nmodels = [\"small\"]\n[[routes]]\nname = \"a\"\n",
        &replicas(),
    )
    .unwrap_err()
    .to_string();
    assert!(twice.contains("must be unique"), "{twice}");
}
