//! The idle replica `kvgate bench` prices its TTFT floor on: the sim's roofline of a named GPU
//! and model, prefilling a prompt's uncached tokens in full chunks with nothing else in the
//! batch — the fastest any replica of that fleet can reach a first token.

use anyhow::{anyhow, bail, Context, Result};
use replica::profiles::{self, ModelProfile};
use replica::roofline::{KvDtype, Roofline, WorkItem};

pub struct IdleReplica {
    roofline: Roofline,
    time_scale: f64,
    chunk: u64,
}

impl IdleReplica {
    /// `gpu=NAME[,model=NAME][,time_scale=X][,chunk=N][,kv_cache_dtype=D]` (the replica's
    /// flags of the same names; model defaults to the sim's qwen3-8b).
    pub fn parse(spec: &str) -> Result<Self> {
        let (mut gpu, mut model, mut scale, mut chunk, mut kv) =
            (None, "qwen3-8b".to_string(), 1.0, 2048u64, KvDtype::Auto);
        for kv_pair in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = kv_pair
                .split_once('=')
                .ok_or_else(|| anyhow!("--floor: `{kv_pair}` is not KEY=VALUE"))?;
            match k {
                "gpu" => gpu = Some(v.to_string()),
                "model" => model = v.to_string(),
                "time_scale" => scale = v.parse().context("--floor time_scale")?,
                "chunk" => chunk = v.parse().context("--floor chunk")?,
                "kv_cache_dtype" => {
                    kv = KvDtype::parse(v).ok_or_else(|| anyhow!("--floor: kv_cache_dtype {v}"))?
                }
                _ => bail!(
                    "--floor: unknown key `{k}` (gpu, model, time_scale, chunk, kv_cache_dtype)"
                ),
            }
        }
        let gpu = gpu.ok_or_else(|| anyhow!("--floor needs gpu=NAME"))?;
        Self::build(&gpu, &model, kv, None, scale, chunk)
    }

    /// From a replica's `/server_info`; `None` unless it is a sim replica (only the sim's
    /// speed is a model the bench can evaluate).
    pub fn from_server_info(info: &serde_json::Value) -> Result<Option<Self>> {
        if info["backend"] != "sim" || info["roofline"].is_null() {
            return Ok(None);
        }
        let s = |k: &str| {
            info[k]
                .as_str()
                .ok_or_else(|| anyhow!("/server_info has no {k}"))
        };
        let f = |k: &str| {
            info["roofline"][k]
                .as_f64()
                .ok_or_else(|| anyhow!("/server_info roofline has no {k}"))
        };
        let kv = KvDtype::parse(s("kv_cache_dtype")?).unwrap_or(KvDtype::Auto);
        let chunk = info["chunked_prefill_size"].as_u64().unwrap_or(2048);
        Self::build(
            s("gpu")?,
            s("model_profile")?,
            kv,
            Some((f("compute_efficiency")?, f("bandwidth_efficiency")?)),
            f("time_scale")?,
            chunk,
        )
        .map(Some)
    }

    fn build(
        gpu: &str,
        model: &str,
        kv: KvDtype,
        efficiency: Option<(f64, f64)>,
        time_scale: f64,
        chunk: u64,
    ) -> Result<Self> {
        if !(time_scale > 0.0 && time_scale.is_finite()) || chunk == 0 {
            bail!("--floor: time_scale and chunk must be positive");
        }
        let gpu = profiles::gpu(gpu)?;
        let model = ModelProfile::resolve(model)?;
        let mut roofline = Roofline::new(gpu, model, kv);
        if let Some((c, b)) = efficiency {
            roofline.compute_efficiency = c;
            roofline.bandwidth_efficiency = b;
        }
        Ok(IdleReplica {
            roofline,
            time_scale,
            chunk: chunk.min(2048),
        })
    }

    /// Seconds from arrival to the first token for a prompt of `prompt` tokens whose first
    /// `cached` are in the cache: its chunks one step each, alone in the batch.
    pub fn ttft_s(&self, prompt: u64, cached: u64) -> f64 {
        let mut context = cached.min(prompt.saturating_sub(1));
        let mut left = prompt - context;
        let mut seconds = 0.0;
        while left > 0 {
            let n = left.min(self.chunk);
            left -= n;
            seconds += self
                .roofline
                .step_cost(&[WorkItem {
                    context,
                    new_tokens: n,
                    samples: left == 0,
                }])
                .seconds;
            context += n;
        }
        seconds * self.time_scale
    }

    pub fn describe(&self) -> String {
        format!(
            "{} on {}, chunks of {} tokens, time scale {}",
            self.roofline.model.name, self.roofline.gpu.name, self.chunk, self.time_scale
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_grows_with_uncached_tokens_and_time_scale() {
        let l4 = IdleReplica::parse("gpu=l4").unwrap();
        let cold = l4.ttft_s(3000, 0);
        let warm = l4.ttft_s(3000, 2900);
        assert!(cold > 4.0 * warm, "cold {cold} warm {warm}");
        // A fully cached prompt still computes its last token: one step, at least the weights.
        assert!(l4.ttft_s(3000, 3000) > 0.0);
        let slow = IdleReplica::parse("gpu=l4,time_scale=4").unwrap();
        assert!((slow.ttft_s(3000, 0) / cold - 4.0).abs() < 1e-9);
        assert!(IdleReplica::parse("model=qwen3-8b").is_err());
        assert!(IdleReplica::parse("gpu=l4,speed=2").is_err());
    }
}
