//! The README's run command, `kvgate up`, as a user meets it: the real binary starts a gateway
//! and sim replicas on free ports, and the official openai Python SDK streams a chat completion
//! through it. Needs the built binary (`scripts/test.sh` builds it first) and the `openai`
//! Python package (`scripts/test.sh` installs it when missing).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

fn kvgate_binary() -> PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let bin = target.join("debug/kvgate");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build`; scripts/test.sh does)",
        bin.display()
    );
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_streams_through_kvgate_up() {
    let mut child = tokio::process::Command::new(kvgate_binary())
        .args(["up", "--replicas", "2", "--port", "0", "--admin-port", "0"])
        .env(
            "KVGATE_TOKENIZER_DIR",
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3"),
        )
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start kvgate up");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .expect("kvgate up prints its URL")
            .unwrap()
            .expect("kvgate up exited early");
        if let Some(rest) = line.strip_prefix("kvgate gateway ready at ") {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openai_stream.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .arg(format!("{url}/v1"))
        .arg("Qwen3-8B")
        .output()
        .await
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai SDK run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("completion_tokens=24"), "{stdout}");
    child.kill().await.unwrap();
}
