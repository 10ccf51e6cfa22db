//! `kvgate up --backend vllm`: real vLLM engines behind the gateway, the one-command demo of
//! kvgate in front of an engine people already run. Each engine is started by
//! `scripts/vllm-cpu.sh start` (CPU only, from the cached venv `scripts/vllm-cpu.sh install`
//! makes, on the SmolLM2 folder `scripts/vllm-cpu.sh model` makes) with its KV events on ZMQ
//! and a replay socket, and the gateway follows them as it would in production. Without the
//! venv or the model folder, `up` says in one line how to make them: the install is a 4.5 GB
//! download, not something to start unasked.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use config::gateway::{Backend, EngineSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The name the script's engines serve (what clients send as `model`).
pub(crate) const SERVED_MODEL: &str = "SmolLM2-135M-Instruct";
/// vLLM's CPU attention needs a block size that is a multiple of 32; the script starts engines
/// with 32, and the gateway must hash with the same.
pub(crate) const BLOCK_SIZE: usize = 32;

/// The venv the script installs into (`KVGATE_VLLM_VENV`, as the script reads it).
fn venv() -> PathBuf {
    std::env::var("KVGATE_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/kvgate/vllm-venv")
        })
}

/// The model folder the script serves (`KVGATE_VLLM_MODEL_DIR`), relative to the checkout.
fn model_dir(root: &Path) -> PathBuf {
    let dir = std::env::var("KVGATE_VLLM_MODEL_DIR").unwrap_or_else(|_| "models/smollm2-hf".into());
    root.join(dir)
}

/// Checks that the script, its venv and the model folder are there; returns the model folder
/// (the gateway's tokenizer too: vLLM and kvgate then tokenise with the same files).
pub(crate) fn check_installed(root: &Path) -> Result<PathBuf> {
    let script = root.join("scripts/vllm-cpu.sh");
    if !script.exists() {
        bail!(
            "--backend vllm: {} is missing (run kvgate up from the checkout)",
            script.display()
        );
    }
    if !venv().join("bin/python").exists() {
        bail!(
            "--backend vllm: no vLLM install at {}; make it with `scripts/vllm-cpu.sh install && scripts/vllm-cpu.sh model` (about 3 minutes, 4.5 GB downloaded)",
            venv().display()
        );
    }
    let model = model_dir(root);
    if !model.join("config.json").exists() || !model.join("tokenizer.json").exists() {
        bail!(
            "--backend vllm: no model folder at {}; make it with `scripts/vllm-cpu.sh model`",
            model.display()
        );
    }
    Ok(model)
}

/// A port nothing listens on now.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(l.local_addr()?.port())
}

/// Whether `GET /health` at `port` answers 200.
async fn healthy(port: u16) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.is_ok()
        && (head.starts_with(b"HTTP/1.1 200") || head.starts_with(b"HTTP/1.0 200"))
}

/// One engine starting: its process, what the gateway follows, its HTTP port and its log.
struct Starting {
    child: tokio::process::Child,
    spec: EngineSpec,
    port: u16,
    log: PathBuf,
}

/// Starts engine `i` on three ports free now, bound to core `core`.
fn spawn_engine(root: &Path, i: usize, core: usize) -> Result<Starting> {
    let (port, events, replay) = (free_port()?, free_port()?, free_port()?);
    let log = std::env::temp_dir().join(format!("kvgate-up-vllm-{i}.log"));
    let file =
        std::fs::File::create(&log).with_context(|| format!("cannot write {}", log.display()))?;
    let mut cmd = tokio::process::Command::new(root.join("scripts/vllm-cpu.sh"));
    cmd.args([
        "start",
        &port.to_string(),
        &events.to_string(),
        &replay.to_string(),
    ])
    .arg(core.to_string())
    .current_dir(root)
    .stdin(std::process::Stdio::null())
    .stdout(file.try_clone()?)
    .stderr(file)
    .kill_on_drop(true);
    // Their own process group: Ctrl-C reaches only `kvgate up`, which drains the gateway first
    // and then stops the engines.
    #[cfg(unix)]
    cmd.process_group(0);
    let child = cmd.spawn().context("cannot start scripts/vllm-cpu.sh")?;
    println!(
        "vllm-{i}: starting at http://127.0.0.1:{port} (log {})",
        log.display()
    );
    Ok(Starting {
        child,
        spec: EngineSpec {
            addr: format!("127.0.0.1:{port}"),
            backend: Backend::Vllm,
            kv_events: Some(format!("tcp://127.0.0.1:{events}")),
            kv_replay: Some(format!("tcp://127.0.0.1:{replay}")),
        },
        port,
        log,
    })
}

/// Starts for one engine, before giving up: a port found free can be taken before vLLM binds
/// it (vLLM picks ports of its own for its internal queues while starting; seen once in three
/// starts of two engines), and then the engine exits at once.
const ATTEMPTS: usize = 3;

/// Starts `n` engines (all at once; each bound to one core, round the machine's cores) and
/// waits until every one answers `/health`; returns them with what the gateway needs to follow
/// them. They are killed if this process drops them.
pub(crate) async fn start(
    root: &Path,
    n: usize,
) -> Result<Vec<(tokio::process::Child, EngineSpec)>> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let mut starting = Vec::new();
    for i in 0..n {
        starting.push(spawn_engine(root, i, i % cores)?);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let mut ready = Vec::new();
    for (i, mut e) in starting.into_iter().enumerate() {
        let mut attempt = 1;
        while !healthy(e.port).await {
            if let Some(status) = e.child.try_wait()? {
                if attempt == ATTEMPTS {
                    return Err(anyhow!(
                        "vllm-{i} exited ({status}) before it was ready, {ATTEMPTS} times; see {}",
                        e.log.display()
                    ));
                }
                println!("vllm-{i} exited ({status}) before it was ready; starting it again on other ports");
                attempt += 1;
                e = spawn_engine(root, i, i % cores)?;
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "vllm-{i} was not ready within 600 s; see {}",
                    e.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        println!("vllm-{i} ready at http://{}", e.spec.addr);
        ready.push((e.child, e.spec));
    }
    Ok(ready)
}

/// Stops the engines: SIGTERM (the script execs python, so vLLM itself gets it), then a kill
/// for any still running after 10 s.
pub(crate) async fn stop(children: &mut [tokio::process::Child]) {
    for child in children.iter() {
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .arg(pid.to_string())
                .status();
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for child in children.iter_mut() {
        if tokio::time::timeout_at(deadline, child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}
