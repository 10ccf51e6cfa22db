//! A Llama model's hyper-parameters, from GGUF metadata (`llama.*`) or a Hugging Face
//! `config.json`.

use kernels::ops::Rope;
use kernels::AttentionShape;
use protocol::gguf::GgufHeader;
use serde_json::Value;

use super::error::LoadError;

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope: Rope,
    /// The context the model was trained for.
    pub max_position: usize,
}

impl LlamaConfig {
    /// The paged KV cache's shape for this model: `num_blocks` blocks of `block_size` tokens.
    pub fn attention_shape(&self, block_size: usize, num_blocks: usize) -> AttentionShape {
        AttentionShape {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size,
            num_blocks,
        }
    }

    /// Checks the shape is one the forward pass can run.
    pub fn validate(&self, source: &str) -> Result<(), LoadError> {
        let bad = |what: String| LoadError::Unsupported {
            path: source.into(),
            what,
        };
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} attention heads cannot share {} key/value heads",
                self.heads, self.kv_heads
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) || self.rope.dims > self.head_dim
        {
            return Err(bad(format!(
                "head dimension {} with {} rotary dimensions",
                self.head_dim, self.rope.dims
            )));
        }
        if self.hidden == 0 || self.layers == 0 || self.vocab_size == 0 || self.intermediate == 0 {
            return Err(bad("a zero-sized model".into()));
        }
        Ok(())
    }

    pub fn from_gguf(h: &GgufHeader, vocab_from_tokens: Option<usize>) -> Result<Self, LoadError> {
        let arch = h.str("general.architecture")?;
        if arch != "llama" {
            return Err(LoadError::Unsupported {
                path: h.path.display().to_string(),
                what: format!(
                    "architecture `{arch}` (general.architecture): the cpu backend runs `llama`"
                ),
            });
        }
        let key = |k: &str| format!("llama.{k}");
        let hidden = h.u64(&key("embedding_length"))? as usize;
        let heads = h.u64(&key("attention.head_count"))? as usize;
        let kv_heads = match h.get(&key("attention.head_count_kv")) {
            Some(_) => h.u64(&key("attention.head_count_kv"))? as usize,
            None => heads,
        };
        let head_dim = hidden.checked_div(heads).unwrap_or(0);
        let rope_dims = match h.get(&key("rope.dimension_count")) {
            Some(_) => h.u64(&key("rope.dimension_count"))? as usize,
            None => head_dim,
        };
        let base = match h.get(&key("rope.freq_base")) {
            Some(_) => h.f64(&key("rope.freq_base"))? as f32,
            None => 10_000.0,
        };
        let freq_scale = match h.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => 1.0,
            Some("linear") => 1.0 / h.f64(&key("rope.scaling.factor"))? as f32,
            Some(other) => {
                return Err(LoadError::Unsupported {
                    path: h.path.display().to_string(),
                    what: format!("RoPE scaling `{other}` (llama.rope.scaling.type)"),
                })
            }
        };
        let vocab_size = match h.get(&key("vocab_size")) {
            Some(_) => h.u64(&key("vocab_size"))? as usize,
            None => vocab_from_tokens.unwrap_or(0),
        };
        Ok(LlamaConfig {
            vocab_size,
            hidden,
            intermediate: h.u64(&key("feed_forward_length"))? as usize,
            layers: h.u64(&key("block_count"))? as usize,
            heads,
            kv_heads,
            head_dim,
            rms_eps: h.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            rope: Rope {
                dims: rope_dims,
                base,
                freq_scale,
                freq_factors: None,
            },
            max_position: match h.get(&key("context_length")) {
                Some(_) => h.u64(&key("context_length"))? as usize,
                None => 2048,
            },
        })
    }

    /// From a Hugging Face `config.json` (LlamaForCausalLM and relatives).
    pub fn from_hf(v: &Value, source: &str) -> Result<Self, LoadError> {
        let num = |k: &str| -> Result<f64, LoadError> {
            v.get(k)
                .and_then(Value::as_f64)
                .ok_or_else(|| LoadError::Key {
                    path: source.into(),
                    key: k.into(),
                    expected: "a number",
                })
        };
        let opt = |k: &str| v.get(k).and_then(Value::as_f64);
        let mt = v
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama");
        if mt != "llama" {
            return Err(LoadError::Unsupported {
                path: source.into(),
                what: format!("model_type `{mt}`: the cpu backend runs `llama`"),
            });
        }
        let hidden = num("hidden_size")? as usize;
        let heads = num("num_attention_heads")? as usize;
        let head_dim =
            opt("head_dim").map_or(hidden.checked_div(heads).unwrap_or(0), |d| d as usize);
        let max_position = opt("max_position_embeddings").unwrap_or(2048.0) as usize;
        let mut rope = Rope {
            dims: head_dim,
            base: opt("rope_theta").unwrap_or(10_000.0) as f32,
            freq_scale: 1.0,
            freq_factors: None,
        };
        if let Some(s) = v.get("rope_scaling").filter(|s| !s.is_null()) {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("");
            let f = |k: &str, d: f64| s.get(k).and_then(Value::as_f64).unwrap_or(d);
            match kind {
                "linear" => rope.freq_scale = 1.0 / f("factor", 1.0) as f32,
                "llama3" => {
                    rope.freq_factors = Some(llama3_freq_factors(
                        &rope,
                        f("factor", 8.0),
                        f("low_freq_factor", 1.0),
                        f("high_freq_factor", 4.0),
                        f("original_max_position_embeddings", 8192.0),
                    ))
                }
                "default" | "" => {}
                other => {
                    return Err(LoadError::Unsupported {
                        path: source.into(),
                        what: format!("rope_scaling type `{other}`"),
                    })
                }
            }
        }
        Ok(LlamaConfig {
            vocab_size: num("vocab_size")? as usize,
            hidden,
            intermediate: num("intermediate_size")? as usize,
            layers: num("num_hidden_layers")? as usize,
            heads,
            kv_heads: opt("num_key_value_heads").map_or(heads, |k| k as usize),
            head_dim,
            rms_eps: opt("rms_norm_eps").unwrap_or(1e-6) as f32,
            rope,
            max_position,
        })
    }
}

/// Llama 3.1's frequency-dependent RoPE scaling, as per-frequency divisors (what GGUF files
/// store as `rope_freqs.weight`).
fn llama3_freq_factors(rope: &Rope, factor: f64, low: f64, high: f64, original: f64) -> Vec<f32> {
    let low_wavelen = original / low;
    let high_wavelen = original / high;
    (0..rope.dims / 2)
        .map(|i| {
            let freq = (rope.base as f64).powf(-2.0 * i as f64 / rope.dims as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor as f32
            } else {
                let smooth = (original / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect()
}
