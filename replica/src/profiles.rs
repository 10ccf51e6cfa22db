//! Hardware and model profiles for the roofline model. GPU figures are the vendors' dense
//! (non-sparse) bf16 tensor throughput, HBM bandwidth and the memory `nvidia-smi` reports. Model
//! profiles come from a HF `config.json` or from the built-ins, which are those files' values.

use std::path::Path;

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct GpuProfile {
    pub name: &'static str,
    /// Device memory in bytes.
    pub memory_bytes: f64,
    /// HBM bandwidth in bytes/s.
    pub bandwidth: f64,
    /// Dense bf16 tensor throughput in FLOP/s.
    pub bf16_flops: f64,
}

const MIB: f64 = 1024.0 * 1024.0;

pub const GPUS: [GpuProfile; 4] = [
    GpuProfile {
        name: "h100",
        memory_bytes: 81_559.0 * MIB,
        bandwidth: 3.35e12,
        bf16_flops: 989.4e12,
    },
    GpuProfile {
        name: "h200",
        memory_bytes: 143_771.0 * MIB,
        bandwidth: 4.8e12,
        bf16_flops: 989.4e12,
    },
    GpuProfile {
        name: "a100",
        memory_bytes: 81_920.0 * MIB,
        bandwidth: 2.039e12,
        bf16_flops: 312e12,
    },
    GpuProfile {
        name: "l4",
        memory_bytes: 23_034.0 * MIB,
        bandwidth: 0.3e12,
        bf16_flops: 121e12,
    },
];

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("unknown GPU `{0}`; known: h100, h200, a100, l4")]
    UnknownGpu(String),
    #[error("unknown model `{0}`; built-in profiles: {1}, or pass a path to a HF config.json")]
    UnknownModel(String, String),
    #[error("cannot read {0}: {1}")]
    Read(String, String),
    #[error("{path}: field `{field}` {reason}")]
    Field {
        path: String,
        field: &'static str,
        reason: String,
    },
}

pub fn gpu(name: &str) -> Result<GpuProfile, ProfileError> {
    let key = name.to_ascii_lowercase();
    let key = match key.as_str() {
        "h100-sxm" | "h100sxm" => "h100",
        "a100-80g" | "a100-80gb" => "a100",
        k => k,
    };
    GPUS.iter()
        .find(|g| g.name == key)
        .cloned()
        .ok_or_else(|| ProfileError::UnknownGpu(name.to_string()))
}

/// The shape of a decoder-only transformer, as far as its cost is concerned.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelProfile {
    pub name: String,
    pub num_layers: u64,
    pub hidden_size: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub intermediate_size: u64,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    /// Bytes per weight (2 for bf16/fp16, 1 for fp8).
    pub weight_bytes: f64,
    pub max_position_embeddings: u64,
    /// Tensor-parallel degree: the replica spans this many GPUs.
    pub tensor_parallel: u64,
}

struct Builtin {
    key: &'static str,
    name: &'static str,
    layers: u64,
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    intermediate: u64,
    vocab: u64,
    tied: bool,
    max_pos: u64,
    tp: u64,
}

const BUILTINS: [Builtin; 4] = [
    Builtin {
        key: "llama-3.1-8b",
        name: "Llama-3.1-8B-Instruct",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 128_256,
        tied: false,
        max_pos: 131_072,
        tp: 1,
    },
    Builtin {
        key: "qwen3-8b",
        name: "Qwen3-8B",
        layers: 36,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 12288,
        vocab: 151_936,
        tied: false,
        max_pos: 40_960,
        tp: 1,
    },
    Builtin {
        key: "mistral-7b",
        name: "Mistral-7B-Instruct-v0.3",
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 32_768,
        tied: false,
        max_pos: 32_768,
        tp: 1,
    },
    Builtin {
        key: "llama-3.1-70b-tp4",
        name: "Llama-3.1-70B-Instruct",
        layers: 80,
        hidden: 8192,
        heads: 64,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 28672,
        vocab: 128_256,
        tied: false,
        max_pos: 131_072,
        tp: 4,
    },
];

pub fn builtin_names() -> Vec<&'static str> {
    BUILTINS.iter().map(|b| b.key).collect()
}

impl ModelProfile {
    /// A built-in profile by key (case-insensitive), or a HF `config.json` at that path.
    pub fn resolve(spec: &str) -> Result<Self, ProfileError> {
        let key = spec.to_ascii_lowercase();
        if let Some(b) = BUILTINS
            .iter()
            .find(|b| b.key == key || b.name.eq_ignore_ascii_case(spec))
        {
            return Ok(ModelProfile {
                name: b.name.to_string(),
                num_layers: b.layers,
                hidden_size: b.hidden,
                num_heads: b.heads,
                num_kv_heads: b.kv_heads,
                head_dim: b.head_dim,
                intermediate_size: b.intermediate,
                vocab_size: b.vocab,
                tie_word_embeddings: b.tied,
                weight_bytes: 2.0,
                max_position_embeddings: b.max_pos,
                tensor_parallel: b.tp,
            });
        }
        let path = Path::new(spec);
        if path.exists() {
            return Self::from_hf_config(path);
        }
        if spec.contains('/') || spec.ends_with(".json") {
            return Err(ProfileError::Read(spec.to_string(), "no such file".into()));
        }
        Err(ProfileError::UnknownModel(
            spec.to_string(),
            builtin_names().join(", "),
        ))
    }

    /// Reads the fields that decide cost from a HF `config.json` (or the folder holding it).
    pub fn from_hf_config(path: &Path) -> Result<Self, ProfileError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let shown = file.display().to_string();
        let text = std::fs::read_to_string(&file)
            .map_err(|e| ProfileError::Read(shown.clone(), e.to_string()))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| ProfileError::Read(shown.clone(), e.to_string()))?;
        // Multimodal configs nest the language model under `text_config`.
        let v = v.get("text_config").cloned().unwrap_or(v);
        let req = |field: &'static str| -> Result<u64, ProfileError> {
            v.get(field)
                .and_then(Value::as_u64)
                .filter(|&x| x > 0)
                .ok_or_else(|| ProfileError::Field {
                    path: shown.clone(),
                    field,
                    reason: "is missing or not a positive integer".into(),
                })
        };
        let hidden = req("hidden_size")?;
        let heads = req("num_attention_heads")?;
        let kv_heads = v
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .unwrap_or(heads);
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .unwrap_or(hidden / heads);
        let dtype = v
            .get("torch_dtype")
            .or_else(|| v.get("dtype"))
            .and_then(Value::as_str)
            .unwrap_or("bfloat16");
        let weight_bytes = match dtype {
            "float32" => 4.0,
            "float8_e4m3fn" | "float8_e5m2" | "fp8" => 1.0,
            _ => 2.0,
        };
        let name = v
            .get("_name_or_path")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| {
                file.parent()
                    .and_then(|p| p.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "custom".into())
            });
        Ok(ModelProfile {
            name,
            num_layers: req("num_hidden_layers")?,
            hidden_size: hidden,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            intermediate_size: req("intermediate_size")?,
            vocab_size: req("vocab_size")?,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            weight_bytes,
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(8192),
            tensor_parallel: 1,
        })
    }

    /// Parameters of the transformer layers (attention and gated MLP; norms are negligible).
    pub fn layer_params(&self) -> f64 {
        let h = self.hidden_size as f64;
        let q = (self.num_heads * self.head_dim) as f64;
        let kv = (self.num_kv_heads * self.head_dim) as f64;
        let attn = h * q + 2.0 * h * kv + q * h;
        let mlp = 3.0 * h * self.intermediate_size as f64;
        self.num_layers as f64 * (attn + mlp)
    }

    /// Parameters of the output projection (the LM head).
    pub fn lm_head_params(&self) -> f64 {
        (self.vocab_size * self.hidden_size) as f64
    }

    /// All parameters, embeddings included: what occupies memory.
    pub fn total_params(&self) -> f64 {
        let embed = self.lm_head_params();
        let head = if self.tie_word_embeddings { 0.0 } else { embed };
        self.layer_params() + embed + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_param_counts_match_the_published_sizes() {
        for (name, billions, tolerance) in [
            ("llama-3.1-8b", 8.03, 0.05),
            ("Qwen3-8B", 8.19, 0.05),
            ("mistral-7b", 7.25, 0.05),
            ("llama-3.1-70b-tp4", 70.55, 0.2),
        ] {
            let p = ModelProfile::resolve(name).unwrap().total_params() / 1e9;
            assert!((p - billions).abs() < tolerance, "{name}: {p}");
        }
    }

    #[test]
    fn reads_a_hf_config_json() {
        let dir = std::env::temp_dir().join(format!("kvgate-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.json");
        std::fs::write(
            &path,
            r#"{"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,
                "num_hidden_layers":32,"intermediate_size":14336,"vocab_size":128256,
                "torch_dtype":"bfloat16","max_position_embeddings":131072}"#,
        )
        .unwrap();
        let p = ModelProfile::resolve(path.to_str().unwrap()).unwrap();
        assert_eq!(p.head_dim, 128);
        assert_eq!(
            p.layer_params(),
            ModelProfile::resolve("llama-3.1-8b")
                .unwrap()
                .layer_params()
        );
        std::fs::write(&path, r#"{"hidden_size":4096}"#).unwrap();
        let e = ModelProfile::resolve(path.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let e = ModelProfile::resolve(path.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("no such file"), "{e}");
    }

    #[test]
    fn unknown_names_list_the_choices() {
        assert!(gpu("v100").unwrap_err().to_string().contains("h100"));
        assert!(ModelProfile::resolve("gpt-5")
            .unwrap_err()
            .to_string()
            .contains("qwen3-8b"));
    }
}
