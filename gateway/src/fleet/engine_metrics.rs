//! A vLLM engine's load, read from its Prometheus `/metrics` (vLLM has no `/get_load`): the
//! requests running and waiting, the KV cache usage and the preemptions counter. Names checked
//! against vLLM's `vllm/v1/metrics/loggers.py` (main branch): `vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction, 0–1; older releases
//! call it `vllm:gpu_cache_usage_perc`) and `vllm:num_preemptions_total`. Counts are summed
//! over their labels (one series per engine of a data-parallel server), as is
//! `vllm:generation_tokens_total` (the throughput the cost gauge is priced on); the cache usage is
//! the fullest engine's. SGLang serves `/get_load`
//! itself, which the gateway reads as it reads a kvgate replica's.

/// What an engine's metrics say about its load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
    pub preemptions: Option<u64>,
    /// The KV cache's size in blocks (`vllm:cache_config_info`'s `num_gpu_blocks` label).
    pub num_gpu_blocks: Option<u64>,
    /// Tokens generated since start (`vllm:generation_tokens_total`).
    pub generation_tokens: Option<u64>,
}

/// The value of `label` on the first sample of `name`.
fn label_of(text: &str, name: &str, label: &str) -> Option<String> {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))?;
    let labels = &line[name.len() + 1..line.rfind('}')?];
    let key = format!("{label}=\"");
    let at = labels.find(&key)? + key.len();
    let end = labels[at..].find('"')?;
    Some(labels[at..at + end].to_string())
}

/// The value of every sample of `name` (any labels), summed; `None` when there is none.
fn sum(text: &str, name: &str) -> Option<f64> {
    fold(text, name, |a, b| a + b)
}

/// The largest sample of `name` (the fullest engine's cache).
fn max(text: &str, name: &str) -> Option<f64> {
    fold(text, name, f64::max)
}

fn fold(text: &str, name: &str, f: impl Fn(f64, f64) -> f64) -> Option<f64> {
    let mut total: Option<f64> = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // The name must end here: `{labels} value` or ` value`.
        let value = match rest.as_bytes().first() {
            Some(b'{') => rest.rsplit_once('}').map(|(_, v)| v),
            Some(b' ') => Some(rest),
            _ => None,
        };
        let Some(v) = value
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        total = Some(total.map_or(v, |t| f(t, v)));
    }
    total
}

/// Reads a vLLM `/metrics` page; `None` when it has none of vLLM's scheduler gauges (not a
/// vLLM engine, or not yet serving).
pub fn parse_vllm(text: &str) -> Option<EngineLoad> {
    let running = sum(text, "vllm:num_requests_running");
    let waiting = sum(text, "vllm:num_requests_waiting");
    if running.is_none() && waiting.is_none() {
        return None;
    }
    let kv =
        max(text, "vllm:kv_cache_usage_perc").or_else(|| max(text, "vllm:gpu_cache_usage_perc"));
    Some(EngineLoad {
        running: running.unwrap_or(0.0) as u32,
        waiting: waiting.unwrap_or(0.0) as u32,
        kv_usage: kv.unwrap_or(0.0).clamp(0.0, 1.0),
        preemptions: sum(text, "vllm:num_preemptions_total").map(|p| p as u64),
        num_gpu_blocks: label_of(text, "vllm:cache_config_info", "num_gpu_blocks")
            .and_then(|v| v.parse().ok()),
        generation_tokens: sum(text, "vllm:generation_tokens_total").map(|t| t as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.2
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 1500.0
vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 500.0
"#;

    #[test]
    fn reads_vllm_scheduler_gauges_summed_over_engines() {
        let l = parse_vllm(PAGE).unwrap();
        assert_eq!(l.running, 12);
        assert_eq!(
            l.waiting, 3,
            "a longer name with the same prefix is not counted"
        );
        assert!((l.kv_usage - 0.41).abs() < 1e-9);
        assert_eq!(l.preemptions, Some(12));
        assert_eq!(l.generation_tokens, Some(2000));
    }

    #[test]
    fn older_names_and_pages_that_are_not_vllm() {
        let old = "vllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.5\n";
        let l = parse_vllm(old).unwrap();
        assert_eq!((l.running, l.waiting), (2, 0));
        assert!((l.kv_usage - 0.5).abs() < 1e-9);
        assert_eq!(l.preemptions, None);
        assert_eq!(parse_vllm("kvgate_replica_running 3\n"), None);
        assert_eq!(l.num_gpu_blocks, None);
    }

    #[test]
    fn reads_the_cache_size_from_the_cache_config_labels() {
        let page = format!(
            "{PAGE}# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"32\",cache_dtype=\"auto\",num_gpu_blocks=\"3519\",prefix_caching_hash_algo=\"sha256\"}} 1.0\n"
        );
        assert_eq!(parse_vllm(&page).unwrap().num_gpu_blocks, Some(3519));
    }
}
