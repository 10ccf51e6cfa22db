//! The README's run command, `kvgate up`, as a user meets it: the real binary starts a gateway
//! and sim replicas on free ports, and the official openai Python SDK streams a chat completion
//! through it. Needs the built binary (`scripts/test.sh` builds it first) and the `openai`
//! Python package (`scripts/test.sh` installs it when missing).

mod common;

use std::path::PathBuf;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_streams_through_kvgate_up() {
    let tokenizer = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3");
    let (mut child, url) =
        common::start_kvgate_up(&["--replicas", "2"], &[("KVGATE_TOKENIZER_DIR", tokenizer)]).await;
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
