//! The Kubernetes manifests (`config/k8s`), checked without a cluster: the base and each
//! overlay are built the way kustomize builds them (the subset they use: resources,
//! configMapGenerator with replace, strategic-merge patches, namespace), every object is
//! parsed into its typed Kubernetes struct (`k8s-openapi`) and serialised back — a field the
//! type does not know (a typo) shows up as a difference — and the wiring between them is
//! checked: the gateway file finds the Services, probes and drains are where the gateway
//! serves them, the policy ConfigMap is config/policy.toml and is mounted so its updates
//! arrive, the PrometheusRule is config/alerts.yml. The behaviour the manifests rely on is
//! tested against real processes below: the ConfigMap's symlink swap is reloaded, a replica
//! leaving the fleet finishes its streams, `/ready` waits for the replicas' KV events.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{read_stream, start_gateway, start_replica, FakeMode, FakeReplica, Gateway};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

fn k8s_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/k8s")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{path:?}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// Strategic merge as kustomize applies it to the fields these manifests patch: maps merge,
/// lists of named items (containers, ports, env, volumes) merge by name, other lists and
/// scalars are replaced.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(b), Value::Array(p))
            if p.iter().all(|x| x.get("name").is_some())
                && b.iter().all(|x| x.get("name").is_some()) =>
        {
            for item in p {
                match b.iter_mut().find(|x| x["name"] == item["name"]) {
                    Some(slot) => merge(slot, item),
                    None => b.push(item.clone()),
                }
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// `kustomize build dir`, for the features the manifests use.
fn build(dir: &Path) -> Vec<Value> {
    let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
    assert_eq!(k["kind"], "Kustomization", "{dir:?}");
    let mut out: Vec<Value> = Vec::new();
    for r in k["resources"].as_array().into_iter().flatten() {
        let p = dir.join(r.as_str().unwrap());
        if p.is_dir() {
            out.extend(build(&p));
        } else {
            out.extend(yaml_docs(&p));
        }
    }
    for g in k["configMapGenerator"].as_array().into_iter().flatten() {
        let name = g["name"].as_str().unwrap();
        let mut data = serde_json::Map::new();
        for f in g["files"].as_array().unwrap() {
            let f = f.as_str().unwrap();
            let text = std::fs::read_to_string(dir.join(f)).unwrap();
            data.insert(f.to_string(), Value::String(text));
        }
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": name}, "data": data});
        let existing = out
            .iter()
            .position(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name);
        match (g["behavior"].as_str(), existing) {
            (Some("replace"), Some(i)) => out[i] = cm,
            (Some("replace"), None) => panic!("{dir:?}: replaces {name}, which the base lacks"),
            (_, Some(_)) => panic!("{dir:?}: {name} generated twice"),
            (_, None) => out.push(cm),
        }
    }
    for p in k["patches"].as_array().into_iter().flatten() {
        for patch in yaml_docs(&dir.join(p["path"].as_str().unwrap())) {
            let target = out
                .iter_mut()
                .find(|o| {
                    o["kind"] == patch["kind"] && o["metadata"]["name"] == patch["metadata"]["name"]
                })
                .unwrap_or_else(|| panic!("{dir:?}: the patch targets nothing: {patch}"));
            merge(target, &patch);
        }
    }
    if let Some(ns) = k["namespace"].as_str() {
        for o in &mut out {
            o["metadata"]["namespace"] = json!(ns);
        }
    }
    out
}

/// Removes nulls and empty maps (what a typed round trip leaves out) so two renderings of the
/// same object compare equal.
fn normalise(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k.clone(), normalise(x)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(normalise).collect()),
        x => x.clone(),
    }
}

/// Parses `v` as `T` and checks that nothing was dropped on the way.
fn typed<T: DeserializeOwned + Serialize>(v: &Value) -> T {
    let t: T = serde_json::from_value(v.clone())
        .unwrap_or_else(|e| panic!("{}: {e}", v["metadata"]["name"]));
    let back = serde_json::to_value(&t).unwrap();
    assert_eq!(
        normalise(&back),
        normalise(v),
        "{} {} has fields its type does not know",
        v["kind"],
        v["metadata"]["name"]
    );
    t
}

/// The custom resources (not in k8s-openapi): the fields the manifests use, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Custom<S> {
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    spec: S,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceMonitorSpec {
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    endpoints: Vec<MonitorEndpoint>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MonitorEndpoint {
    port: String,
    path: String,
    interval: String,
    #[serde(default)]
    authorization: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ScaledObjectSpec {
    scale_target_ref: BTreeMap<String, String>,
    min_replica_count: u32,
    max_replica_count: u32,
    polling_interval: u32,
    cooldown_period: u32,
    advanced: Advanced,
    triggers: Vec<Trigger>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Advanced {
    horizontal_pod_autoscaler_config: HpaConfig,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HpaConfig {
    behavior: HorizontalPodAutoscalerBehavior,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Trigger {
    #[serde(rename = "type")]
    kind: String,
    metric_type: String,
    metadata: BTreeMap<String, String>,
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn container<'a>(
    spec: &'a Option<k8s_openapi::api::core::v1::PodSpec>,
    name: &str,
) -> &'a Container {
    spec.as_ref()
        .unwrap()
        .containers
        .iter()
        .find(|c| c.name == name)
        .unwrap()
}

fn http_path(p: &Option<k8s_openapi::api::core::v1::Probe>) -> String {
    p.as_ref()
        .and_then(|p| p.http_get.as_ref())
        .and_then(|h| h.path.clone())
        .unwrap_or_default()
}

/// One built variant of the manifests, checked whole. `engine`: the backend behind the
/// headless Service (`None`: the base's kvgate sim replicas).
fn check_variant(dir: &Path, engine: Option<&str>) {
    let objs = build(dir);
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for o in &objs {
        *kinds
            .entry(o["kind"].as_str().unwrap().to_string())
            .or_default() += 1;
        assert_eq!(o["metadata"]["namespace"], "kvgate");
        match o["kind"].as_str().unwrap() {
            "Service" => drop(typed::<Service>(o)),
            "StatefulSet" => drop(typed::<StatefulSet>(o)),
            "Deployment" => drop(typed::<Deployment>(o)),
            "PodDisruptionBudget" => drop(typed::<PodDisruptionBudget>(o)),
            "ConfigMap" => drop(typed::<ConfigMap>(o)),
            "ServiceMonitor" => {
                let m: Custom<ServiceMonitorSpec> = serde_json::from_value(o.clone()).unwrap();
                assert_eq!(m.api_version, "monitoring.coreos.com/v1");
                assert!(m.spec.selector.match_labels.is_some());
                for e in &m.spec.endpoints {
                    assert_eq!((e.path.as_str(), e.interval.as_str()), ("/metrics", "15s"));
                    assert!(e.port == "admin" || e.port == "http");
                    assert_eq!(e.authorization.is_some(), e.port == "admin");
                }
            }
            "PrometheusRule" => {}
            "ScaledObject" => {}
            k => panic!("{dir:?}: unexpected kind {k}"),
        }
    }
    let want: BTreeMap<String, usize> = [
        ("ConfigMap", 2),
        ("Deployment", 1),
        ("PodDisruptionBudget", 1),
        ("PrometheusRule", 1),
        ("ScaledObject", 1),
        ("Service", 3),
        ("ServiceMonitor", 2),
        ("StatefulSet", 1),
    ]
    .map(|(k, n)| (k.to_string(), n))
    .into();
    assert_eq!(kinds, want, "{dir:?}");

    // The gateway file parses and validates, and names the Services that exist.
    let gw_cm: ConfigMap = typed(find(&objs, "ConfigMap", "kvgate-gateway"));
    let gw_text = &gw_cm.data.as_ref().unwrap()["gateway.toml"];
    let gw = config::GatewayConfig::from_toml(gw_text).unwrap();
    let headless: Service = typed(find(&objs, "Service", "kvgate-replicas"));
    let hs = headless.spec.unwrap();
    assert_eq!(hs.cluster_ip.as_deref(), Some("None"));
    assert_eq!(hs.publish_not_ready_addresses, Some(false));
    let port = hs.ports.unwrap()[0].port;
    assert_eq!(gw.discovery.dns, [format!("kvgate-replicas:{port}")]);
    let peers: Service = typed(find(&objs, "Service", "kvgate-gateway-peers"));
    let ps = peers.spec.unwrap();
    assert_eq!(ps.cluster_ip.as_deref(), Some("None"));
    assert_eq!(
        ps.publish_not_ready_addresses,
        Some(true),
        "draining peers still count"
    );
    assert_eq!(
        gw.peers.dns,
        [format!(
            "kvgate-gateway-peers:{}",
            ps.ports.unwrap()[0].port
        )]
    );
    assert!(gw.admin_listen.ends_with(":9090") && gw.listen.ends_with(":8080"));
    assert!(gw.cost.gpu_hour_usd.is_some());

    // The engines: a StatefulSet on the headless Service, drained after DNS lets go.
    let sts: StatefulSet = typed(find(&objs, "StatefulSet", "kvgate-replica"));
    let spec = sts.spec;
    assert_eq!(spec.service_name.as_deref(), Some("kvgate-replicas"));
    assert_eq!(
        spec.selector.match_labels,
        hs.selector.map(|s| s.into_iter().collect())
    );
    let pod = spec.template.spec.clone();
    let engine_c = container(&pod, "engine");
    let pre_stop = engine_c
        .lifecycle
        .as_ref()
        .unwrap()
        .pre_stop
        .as_ref()
        .unwrap();
    assert!(pre_stop.exec.as_ref().unwrap().command.as_ref().unwrap()[0] == "sleep");
    assert_eq!(http_path(&engine_c.readiness_probe), "/health");
    let args = engine_c.args.clone().unwrap_or_default().join(" ");
    match engine {
        None => {
            assert!(args.starts_with("replica --backend=sim"), "{args}");
            assert_eq!(gw.discovery.backend, config::gateway::Backend::Kvgate);
        }
        Some(e) => {
            let backend = serde_json::to_value(gw.discovery.backend).unwrap();
            assert_eq!(backend, e);
            // The engine publishes where the gateway listens, with the gateway's block size.
            for p in [gw.discovery.kv_events_port, gw.discovery.kv_replay_port] {
                let p = p.expect("both event ports");
                assert!(args.contains(&format!("tcp://*:{p}")), "{args}");
                assert!(engine_c
                    .ports
                    .as_ref()
                    .unwrap()
                    .iter()
                    .any(|x| x.container_port == i32::from(p)));
            }
            assert!(
                args.contains(&format!("size={}", gw.model.block_size)),
                "{args}"
            );
            assert!(args.contains(&format!("--served-model-name={}", gw.model.name)));
            let gpus = &engine_c
                .resources
                .as_ref()
                .unwrap()
                .limits
                .as_ref()
                .unwrap()["nvidia.com/gpu"];
            assert_eq!(gpus.0, "1");
        }
    }
    let grace = pod
        .as_ref()
        .unwrap()
        .termination_grace_period_seconds
        .unwrap();
    assert!(
        grace >= 15 + 30,
        "preStop + drain must fit the grace period ({grace} s)"
    );

    // The gateways: at least two, probes on /ready and /live, a drain that fits its grace.
    let dep: Deployment = typed(find(&objs, "Deployment", "kvgate-gateway"));
    let dspec = dep.spec;
    assert!(dspec.replicas.unwrap() >= 2);
    let gpod = dspec.template.spec.clone();
    let g = container(&gpod, "gateway");
    assert_eq!(http_path(&g.readiness_probe), "/ready");
    assert_eq!(http_path(&g.liveness_probe), "/live");
    assert!(g.resources.as_ref().unwrap().requests.is_some());
    assert!(g.lifecycle.as_ref().unwrap().pre_stop.is_some());
    let ggrace = gpod
        .as_ref()
        .unwrap()
        .termination_grace_period_seconds
        .unwrap();
    assert!(ggrace as u64 >= 5 + gw.downstream.drain_timeout_s);
    // The policy ConfigMap is the shipped policy, mounted as a folder (a subPath mount never
    // sees an update) where the gateway file looks for it.
    let policy: ConfigMap = typed(find(&objs, "ConfigMap", "kvgate-policy"));
    let shipped = std::fs::read_to_string(k8s_dir().join("../policy.toml")).unwrap();
    assert_eq!(
        policy.data.unwrap()["policy.toml"],
        shipped,
        "config/k8s/base/policy.toml differs from config/policy.toml"
    );
    let vol = gpod
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| {
            v.config_map
                .as_ref()
                .is_some_and(|c| c.name == "kvgate-policy")
        })
        .unwrap();
    let mount = g
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == vol.name)
        .unwrap();
    assert!(mount.sub_path.is_none());
    assert_eq!(
        gw.policy_file.as_deref(),
        Some(format!("{}/policy.toml", mount.mount_path).as_str())
    );
    let pdb: PodDisruptionBudget = typed(find(&objs, "PodDisruptionBudget", "kvgate-gateway"));
    assert_eq!(
        pdb.spec.unwrap().selector.unwrap().match_labels,
        dspec.selector.match_labels
    );

    // One source of alert rules: the PrometheusRule's spec is config/alerts.yml.
    let rule = find(&objs, "PrometheusRule", "kvgate");
    let alerts = &yaml_docs(&k8s_dir().join("../alerts.yml"))[0];
    assert_eq!(&rule["spec"], alerts, "run scripts/k8s-prometheus-rule.sh");

    // The autoscaler scales the engines on the signal the gateways export.
    let so: Custom<ScaledObjectSpec> =
        serde_json::from_value(find(&objs, "ScaledObject", "kvgate-replica").clone()).unwrap();
    assert_eq!(so.api_version, "keda.sh/v1alpha1");
    assert_eq!(so.spec.scale_target_ref["kind"], "StatefulSet");
    assert_eq!(so.spec.scale_target_ref["name"], "kvgate-replica");
    assert!(
        so.spec.min_replica_count >= 1 && so.spec.max_replica_count > so.spec.min_replica_count
    );
    assert!(so.spec.polling_interval > 0 && so.spec.cooldown_period > 0);
    assert!(so
        .spec
        .advanced
        .horizontal_pod_autoscaler_config
        .behavior
        .scale_down
        .is_some());
    let t = &so.spec.triggers[0];
    assert_eq!(
        (t.kind.as_str(), t.metric_type.as_str()),
        ("prometheus", "Value")
    );
    assert!(t.metadata["query"].contains("kvgate_gateway_scale_signal"));
    assert_eq!(t.metadata["threshold"], "1");
    assert!(so.metadata.name.is_some());
}

#[test]
fn the_manifests_build_parse_and_fit_together() {
    check_variant(&k8s_dir().join("base"), None);
    check_variant(&k8s_dir().join("overlays/vllm"), Some("vllm"));
    check_variant(&k8s_dir().join("overlays/sglang"), Some("sglang"));
}

/// A folder laid out as the kubelet mounts a ConfigMap: `policy.toml → ..data/policy.toml`,
/// `..data → ..<timestamp>`; an update writes a new timestamped folder and swaps `..data` in
/// one rename.
struct ConfigMapVolume {
    dir: PathBuf,
    generation: u32,
}

impl ConfigMapVolume {
    fn new(text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvgate-cm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut v = ConfigMapVolume { dir, generation: 0 };
        v.update(text);
        std::os::unix::fs::symlink("..data/policy.toml", v.dir.join("policy.toml")).unwrap();
        v
    }

    fn update(&mut self, text: &str) {
        self.generation += 1;
        let old = self
            .dir
            .join(format!("..2026_12_03_{}", self.generation - 1));
        let new = format!("..2026_12_03_{}", self.generation);
        std::fs::create_dir_all(self.dir.join(&new)).unwrap();
        std::fs::write(self.dir.join(&new).join("policy.toml"), text).unwrap();
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&new, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
        let _ = std::fs::remove_dir_all(old);
    }
}

impl Drop for ConfigMapVolume {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_by_symlink_swap_is_reloaded() {
    let rep = start_replica(|_| {}).await;
    let v1 = "version = \"cm-1\"\n[[routes]]\nname = \"all\"\nmax_concurrency = 4\n";
    let mut volume = ConfigMapVolume::new(v1);
    let path = volume.dir.join("policy.toml").display().to_string();
    let g = start_gateway(&[&rep], |c| c.policy_file = Some(path)).await;
    assert_eq!(g.admin_json("/admin/policy").await["version"], "cm-1");
    // The kubelet's update: the file the gateway names is never written, only the symlink
    // two levels down swapped.
    volume.update(&v1.replace("cm-1", "cm-2").replace("= 4", "= 8"));
    let p = g
        .wait_admin("/admin/policy", "the reload", |p| p["version"] == "cm-2")
        .await;
    assert_eq!(p["generation"], 2);
    assert_eq!(p["routes"][0]["max_concurrency"], 8);
    // And again: the old folder is gone, the gateway follows the new one.
    volume.update(&v1.replace("cm-1", "cm-3"));
    g.wait_admin("/admin/policy", "the reload", |p| p["version"] == "cm-3")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_leaving_the_fleet_finishes_its_streams_and_gets_no_new_work() {
    let stay = start_replica(|c| c.replica_id = "stay".into()).await;
    let leave = start_replica(|c| {
        c.replica_id = "leave".into();
        c.time_scale = 4.0;
    })
    .await;
    let g = start_gateway(&[&stay, &leave], |c| {
        c.policy = config::PolicyConfig::RoundRobin;
    })
    .await;
    // A long stream on the replica that will leave.
    let mut long = None;
    for i in 0..4 {
        let r = g
            .post(
                "/v1/completions",
                json!({"model": "Qwen3-8B", "prompt": format!("story {i}"), "max_tokens": 150,
                       "stream": true, "ignore_eos": true}),
            )
            .await;
        if r.headers()["x-kvgate-replica"] == "leave" {
            long = Some(r);
            break;
        }
        let _ = r.text().await;
    }
    let long = long.expect("round robin reaches both replicas");
    // It leaves the fleet, as a pod leaving the headless Service does (discovery and the
    // admin API apply a new list the same way, membership.rs).
    let r = g
        .client
        .put(format!("{}/admin/replicas", g.admin))
        .json(&json!({"replicas": [stay.host_port()]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // New work goes only to the replicas that stay, while the stream goes on ...
    for i in 0..6 {
        let r = g
            .post(
                "/v1/completions",
                json!({"model": "Qwen3-8B", "prompt": format!("after {i}"), "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-kvgate-replica"], "stay");
    }
    // ... to its end.
    let (events, done) = read_stream(long).await;
    assert!(
        done,
        "the leaving replica's stream was cut: {} events, last {:?}",
        events.len(),
        events.last()
    );
    let text: usize = events
        .iter()
        .filter(|e| e["choices"][0]["text"].is_string())
        .count();
    assert!(text >= 150, "{text} token events of 150");
}

async fn ready(g: &Gateway) -> (u16, Value) {
    let r = g
        .client
        .get(format!("{}/ready", g.base))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_waits_for_every_replicas_kv_events() {
    // A replica whose events never come (no /kv_events): the gateway stays out of its
    // Service, saying why, for as long as index.ready_wait_s allows ...
    let fake = FakeReplica::start(FakeMode::Stream { tokens: 2 }).await;
    let g = common::start_gateway_at(std::slice::from_ref(&fake.addr), |c| {
        c.index.kv_events = true;
        c.index.ready_wait_s = 3600;
    })
    .await;
    let (code, body) = ready(&g).await;
    assert_eq!(
        (code, body["status"].as_str()),
        (503, Some("warming")),
        "{body}"
    );
    assert_eq!(body["kv_events_expected"], 1);
    let live = g
        .client
        .get(format!("{}/live", g.base))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200);
    // ... and becomes ready when it is over.
    let g = common::start_gateway_at(std::slice::from_ref(&fake.addr), |c| {
        c.index.kv_events = true;
        c.index.ready_wait_s = 0;
    })
    .await;
    assert_eq!(ready(&g).await.0, 200);
    // A real replica replays its cache on connect: ready once that stream is followed.
    let rep = start_replica(|_| {}).await;
    let g = start_gateway(&[&rep], |c| c.index.ready_wait_s = 3600).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, body) = ready(&g).await;
        if code == 200 {
            assert_eq!(body["kv_events_followed"], 1);
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
