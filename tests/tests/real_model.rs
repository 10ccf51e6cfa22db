//! The real engine behind the gateway: `cpu` replicas serving the default GGUF model, a
//! gateway that tokenises with the same file's tokenizer. The gateway's predicted matched
//! blocks must equal what the engine found cached (detector (d)), and `kvgate up --backend cpu`
//! must answer a question with a checkable answer, routing the second turn by prefix.

mod common;

use common::*;
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
        .to_string()
}

fn chat(system: &str, user: &str) -> Value {
    json!({"model": MODEL, "temperature": 0, "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_predictions_equal_the_real_engines_cache_hits() {
    let reps = [
        start_replica(|c| cpu_replica(c, 1)).await,
        start_replica(|c| cpu_replica(c, 1)).await,
    ];
    let gw = start_gateway(&reps.iter().collect::<Vec<_>>(), |c| {
        c.model.name = MODEL.into();
        c.model.tokenizer_dir = Some(model_file().display().to_string());
        exact_hit_signals(c);
    })
    .await;
    let sys = "You are the help desk of a small museum. Opening hours are 10:00 to 18:00, \
               closed on Mondays. Tickets cost 12 euros, 6 for students. Photography without \
               flash is allowed. The cafe is on the ground floor. Answer in one sentence."
        .repeat(2);
    let mut hits = 0;
    for q in [
        "When do you open?",
        "Can I take photos?",
        "When do you open?",
    ] {
        let r = gw.post("/v1/chat/completions", chat(&sys, q)).await;
        assert_eq!(r.status(), 200);
        let predicted: usize = header(&r, "x-kvgate-matched-blocks").parse().unwrap();
        let v: Value = r.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as usize;
        assert_eq!(predicted * 16, cached, "{q}: {v}");
        hits += usize::from(cached > 0);
        assert!(!v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty());
    }
    assert!(
        hits >= 2,
        "the shared system prompt was served from the cache"
    );
    // The OpenAI SDK's models.retrieve(id), through the gateway.
    let card: Value = gw
        .client
        .get(format!("{}/v1/models/{MODEL}", gw.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(card["id"], MODEL);
    let missing = gw
        .client
        .get(format!("{}/v1/models/gpt-4o", gw.base))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvgate_up_with_the_cpu_backend_answers_and_routes_the_second_turn_by_prefix() {
    model_file();
    let (mut child, url) = start_kvgate_up(&["--backend", "cpu"], &[]).await;
    let client = reqwest::Client::new();
    let mut messages = vec![
        json!({"role": "user", "content": "What is the capital of France? Answer in one word."}),
    ];
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(answer.contains("Paris"), "answer: {answer}");
    messages.push(json!({"role": "assistant", "content": answer}));
    messages.push(json!({"role": "user", "content": "And of Italy?"}));
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-kvgate-route-reason"), "prefix_match");
    let v: Value = r.json().await.unwrap();
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    // A prompt of several hundred tokens is served under the CPU fleet's promise (the GPU
    // policy's 1 s TTFT would shed it as undeliverable).
    let long = "Trains leave the central station for the harbour every twenty minutes. ".repeat(60);
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "system", "content": long}, {"role": "user", "content": "When?"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.headers());
    assert_eq!(header(&r, "x-kvgate-route"), "interactive");
    child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_engine_reports_logprobs_and_stops_at_end_of_turn() {
    let r = start_replica(|c| cpu_replica(c, 2)).await;
    let q = "What is the capital of France? Answer in one word.";
    let v: Value = r
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "temperature": 0, "max_tokens": 40, "logprobs": true,
                   "top_logprobs": 3, "messages": [{"role": "user", "content": q}]}),
        )
        .await
        .json()
        .await
        .unwrap();
    let choice = &v["choices"][0];
    // The model ends its turn with <|im_end|>, one of the file's end-of-generation ids.
    assert_eq!(choice["finish_reason"], "stop", "{v}");
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for t in content {
        let lp = t["logprob"].as_f64().unwrap();
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6,
            "{t}"
        );
        assert!(lp <= 0.0);
    }
    // Completions: the legacy shape, and streaming chunks carry their tokens' logprobs.
    let resp = r
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
                   "logprobs": 2, "stream": true, "ignore_eos": true}),
        )
        .await;
    let (events, done) = read_stream(resp).await;
    assert!(done);
    let tokens: usize = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["tokens"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(tokens, 5);
}

/// Where no GPU is (CI), `--backend cuda` is refused in one line, by a replica and by
/// `kvgate up` alike; where one is, the replica starts (and is stopped here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cuda_backend_without_a_gpu_is_refused_in_one_line() {
    for args in [
        &["replica", "--backend", "cuda", "--port", "0"][..],
        &[
            "up",
            "--backend",
            "cuda",
            "--port",
            "0",
            "--admin-port",
            "0",
        ][..],
    ] {
        let out = tokio::time::timeout(
            std::time::Duration::from_secs(120),
            tokio::process::Command::new(kvgate_binary())
                .args(args)
                .env("RUST_BACKTRACE", "0")
                .env("KVGATE_FLEET_TOKEN", "test-token")
                .kill_on_drop(true)
                .output(),
        )
        .await;
        let Ok(out) = out else {
            // Still running: it found a GPU and is serving.
            eprintln!("{args:?}: a GPU is here, the refusal does not apply");
            continue;
        };
        let out = out.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
        assert!(
            lines[0].starts_with("Error: --backend cuda: ")
                && (lines[0].contains("no NVIDIA driver")
                    || lines[0].contains("without CUDA support")),
            "{args:?}: {stderr}"
        );
    }
}

/// `--kv-dtype fp8` on the real engine: the same MiB hold about 1.9× the blocks, /server_info
/// says so, and greedy answers still come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fp8_kv_cache_holds_about_twice_the_tokens_and_still_answers() {
    let f16 = start_replica(|c| cpu_replica(c, 1)).await;
    let fp8 = start_replica(|c| {
        cpu_replica(c, 1);
        c.kv_cache_dtype = replica::roofline::KvDtype::Fp8;
    })
    .await;
    let a = f16.get_json("/server_info").await;
    let b = fp8.get_json("/server_info").await;
    assert_eq!(a["kv_cache_dtype"], "f16");
    assert_eq!(b["kv_cache_dtype"], "fp8_e4m3");
    let ratio = b["num_gpu_blocks"].as_f64().unwrap() / a["num_gpu_blocks"].as_f64().unwrap();
    // SmolLM2's heads are 64 wide: 64 + 4 bytes against 128.
    assert!((ratio - 128.0 / 68.0).abs() < 0.02, "{ratio}: {a} {b}");
    let q = json!({"model": MODEL, "temperature": 0, "max_tokens": 24,
                   "messages": [{"role": "user", "content": "Name three colours."}]});
    let v: Value = fp8
        .post("/v1/chat/completions", q)
        .await
        .json()
        .await
        .unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.trim().is_empty(), "{v}");
}

/// The long-generation quality check: an fp8 cache passes against f16, and a cache whose
/// kernel forgets its scales on read fails with a non-zero exit. (96 generated tokens, not the
/// default 2,048, so the agreement floor is the looser 0.9: five misses are 5%.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_quality_check_passes_fp8_and_fails_a_cache_that_drops_its_scales() {
    let run = |dtype: &'static str| async move {
        tokio::process::Command::new(kvgate_binary())
            .args([
                "kv-check",
                "--kv-dtype",
                dtype,
                "--tokens",
                "48",
                "--prompts",
                "2",
            ])
            .args(["--threads", "2", "--min-agreement", "0.9", "--model"])
            .arg(model_file())
            .env("RUST_BACKTRACE", "0")
            .output()
            .await
            .unwrap()
    };
    let good = run("fp8").await;
    let out = String::from_utf8_lossy(&good.stdout);
    assert!(
        good.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&good.stderr)
    );
    assert!(
        out.contains("| KV bytes per token | 23040 | 12240 | 0.531 |"),
        "{out}"
    );
    let bad = run("fp8-scales-dropped").await;
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        stderr.contains("fails the quality check"),
        "{stderr}{}",
        String::from_utf8_lossy(&bad.stdout)
    );
}
