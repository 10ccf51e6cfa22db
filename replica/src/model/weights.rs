//! Loading a Llama model's weights. GGUF files are memory-mapped and their quantised tensors
//! used in place (the kernels compute on Q4_0/Q4_1/Q8_0 blocks directly); F16/BF16 tensors are
//! widened to f32 once. Hugging Face checkpoints (`config.json` + `*.safetensors`, f32/f16/bf16)
//! are loaded into the same structure, with the query and key projections permuted to the
//! interleaved RoPE layout GGUF files use, so one forward pass serves both.
//!
//! Every failure names the file and the tensor or key, and says what was expected.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kernels::kquant::KQuant;
use kernels::matrix::{MatrixError, SharedBytes};
use kernels::{Format, Matrix};
use protocol::gguf::{ggml_type, GgufHeader};

use super::config::LlamaConfig;
use super::error::LoadError;
use super::safetensors;

/// How to hold the weights.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoadOptions {
    /// Widen quantised matrices to f32 at load (more memory, float matmuls).
    pub dequantize: bool,
}

#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

#[derive(Debug)]
pub struct LlamaWeights {
    pub config: LlamaConfig,
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None`: tied to the embedding.
    pub lm_head: Option<Matrix>,
    pub source: PathBuf,
}

impl LlamaWeights {
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights as held in memory (mapped or owned).
    pub fn bytes(&self) -> usize {
        let m = |x: &Matrix| x.stored_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                m(&l.wq)
                    + m(&l.wk)
                    + m(&l.wv)
                    + m(&l.wo)
                    + m(&l.w_gate)
                    + m(&l.w_up)
                    + m(&l.w_down)
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
            })
            .sum();
        layers + m(&self.embed) + self.lm_head.as_ref().map_or(0, m) + 4 * self.norm.len()
    }

    /// Loads a GGUF file, or a Hugging Face folder (`config.json` + safetensors), or the only
    /// GGUF file in a folder.
    pub fn load(path: &Path, opts: LoadOptions) -> Result<Self, LoadError> {
        if path.is_dir() {
            if path.join("config.json").exists() {
                return Self::from_hf_dir(path, opts);
            }
            let ggufs = files_with_extension(path, "gguf")?;
            return match ggufs.as_slice() {
                [one] => Self::from_gguf(one, opts),
                [] => Err(LoadError::Unsupported {
                    path: path.display().to_string(),
                    what: "a folder with neither config.json nor a .gguf file".into(),
                }),
                _ => Err(LoadError::Unsupported {
                    path: path.display().to_string(),
                    what: "a folder with several .gguf files (name the file)".into(),
                }),
            };
        }
        Self::from_gguf(path, opts)
    }

    pub fn from_gguf(path: &Path, opts: LoadOptions) -> Result<Self, LoadError> {
        let header = GgufHeader::open(path)?;
        let n_tokens = header
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.len());
        let mut config = LlamaConfig::from_gguf(&header, n_tokens)?;
        let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
        let bytes: SharedBytes = Arc::new(map(&file).map_err(|e| LoadError::io(path, e))?);
        let src = GgufSource {
            header: &header,
            bytes,
            opts,
        };
        if header.tensor("rope_freqs.weight").is_some() {
            config.rope.freq_factors = Some(src.vector("rope_freqs.weight", config.rope.dims / 2)?);
        }
        let embed = src.matrix("token_embd.weight", config.vocab_size, config.hidden)?;
        let lm_head = match header.tensor("output.weight") {
            Some(_) => Some(src.matrix("output.weight", config.vocab_size, config.hidden)?),
            None => None,
        };
        let c = &config;
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let layers = (0..c.layers)
            .map(|i| {
                let t = |n: &str| format!("blk.{i}.{n}.weight");
                Ok(LayerWeights {
                    attn_norm: src.vector(&t("attn_norm"), c.hidden)?,
                    wq: src.matrix(&t("attn_q"), q, c.hidden)?,
                    wk: src.matrix(&t("attn_k"), kv, c.hidden)?,
                    wv: src.matrix(&t("attn_v"), kv, c.hidden)?,
                    wo: src.matrix(&t("attn_output"), c.hidden, q)?,
                    ffn_norm: src.vector(&t("ffn_norm"), c.hidden)?,
                    w_gate: src.matrix(&t("ffn_gate"), c.intermediate, c.hidden)?,
                    w_up: src.matrix(&t("ffn_up"), c.intermediate, c.hidden)?,
                    w_down: src.matrix(&t("ffn_down"), c.hidden, c.intermediate)?,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let norm = src.vector("output_norm.weight", config.hidden)?;
        config.validate(&path.display().to_string())?;
        Ok(LlamaWeights {
            config,
            embed,
            layers,
            norm,
            lm_head,
            source: path.to_path_buf(),
        })
    }

    /// A Hugging Face Llama checkpoint: `config.json` and every `*.safetensors` in `dir`.
    pub fn from_hf_dir(dir: &Path, opts: LoadOptions) -> Result<Self, LoadError> {
        let _ = opts;
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| LoadError::io(&cfg_path, e))?;
        let cfg: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LoadError::Corrupt {
                path: cfg_path.display().to_string(),
                what: e.to_string(),
            })?;
        let config = LlamaConfig::from_hf(&cfg, &cfg_path.display().to_string())?;
        config.validate(&cfg_path.display().to_string())?;
        let tied = cfg
            .get("tie_word_embeddings")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        let files = files_with_extension(dir, "safetensors")?;
        if files.is_empty() {
            return Err(LoadError::Unsupported {
                path: dir.display().to_string(),
                what: "a checkpoint folder without *.safetensors files".into(),
            });
        }
        let mut table: BTreeMap<String, (usize, safetensors::TensorEntry)> = BTreeMap::new();
        let mut blobs: Vec<(PathBuf, Vec<u8>)> = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let bytes = std::fs::read(f).map_err(|e| LoadError::io(f, e))?;
            for (name, entry) in safetensors::read_header(&bytes, f)? {
                table.insert(name, (i, entry));
            }
            blobs.push((f.clone(), bytes));
        }
        let c = &config;
        let get = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>, LoadError> {
            let (i, e) = table.get(name).ok_or_else(|| LoadError::Tensor {
                path: dir.display().to_string(),
                tensor: name.into(),
                what: "missing".into(),
            })?;
            let (path, bytes) = &blobs[*i];
            let want: Vec<usize> = if rows == 1 {
                vec![cols]
            } else {
                vec![rows, cols]
            };
            let tensor_err = |what: String| LoadError::Tensor {
                path: path.display().to_string(),
                tensor: name.into(),
                what,
            };
            if e.shape != want {
                return Err(tensor_err(format!(
                    "shape {:?}, expected {:?}",
                    e.shape, want
                )));
            }
            let format = match e.dtype.as_str() {
                "F32" => Format::F32,
                "F16" => Format::F16,
                "BF16" => Format::BF16,
                other => {
                    return Err(tensor_err(format!(
                        "dtype {other} (F32, F16 and BF16 are supported)"
                    )))
                }
            };
            let data = &bytes[e.start..e.end];
            if Some(data.len()) != format.row_bytes(rows * cols) {
                return Err(tensor_err(format!(
                    "{} bytes for {rows}x{cols} {}",
                    data.len(),
                    format.name()
                )));
            }
            let mut out = vec![0f32; rows * cols];
            kernels::quant::dequantize_row(format, data, &mut out);
            Ok(out)
        };
        let dense = |v: Vec<f32>, rows: usize, cols: usize| Matrix::from_f32(rows, cols, v);
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let embed = dense(
            get("model.embed_tokens.weight", c.vocab_size, c.hidden)?,
            c.vocab_size,
            c.hidden,
        );
        let lm_head = if tied || !table.contains_key("lm_head.weight") {
            None
        } else {
            Some(dense(
                get("lm_head.weight", c.vocab_size, c.hidden)?,
                c.vocab_size,
                c.hidden,
            ))
        };
        let layers = (0..c.layers)
            .map(|i| {
                let t = |n: &str| format!("model.layers.{i}.{n}.weight");
                let wq =
                    hf_to_interleaved(get(&t("self_attn.q_proj"), q, c.hidden)?, c.heads, c.hidden);
                let wk = hf_to_interleaved(
                    get(&t("self_attn.k_proj"), kv, c.hidden)?,
                    c.kv_heads,
                    c.hidden,
                );
                Ok(LayerWeights {
                    attn_norm: get(&t("input_layernorm"), 1, c.hidden)?,
                    wq: dense(wq, q, c.hidden),
                    wk: dense(wk, kv, c.hidden),
                    wv: dense(get(&t("self_attn.v_proj"), kv, c.hidden)?, kv, c.hidden),
                    wo: dense(get(&t("self_attn.o_proj"), c.hidden, q)?, c.hidden, q),
                    ffn_norm: get(&t("post_attention_layernorm"), 1, c.hidden)?,
                    w_gate: dense(
                        get(&t("mlp.gate_proj"), c.intermediate, c.hidden)?,
                        c.intermediate,
                        c.hidden,
                    ),
                    w_up: dense(
                        get(&t("mlp.up_proj"), c.intermediate, c.hidden)?,
                        c.intermediate,
                        c.hidden,
                    ),
                    w_down: dense(
                        get(&t("mlp.down_proj"), c.hidden, c.intermediate)?,
                        c.hidden,
                        c.intermediate,
                    ),
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let norm = get("model.norm.weight", 1, c.hidden)?;
        Ok(LlamaWeights {
            config,
            embed,
            layers,
            norm,
            lm_head,
            source: dir.to_path_buf(),
        })
    }

    /// Writes the weights as a Hugging Face checkpoint (`config.json` + one f32
    /// `model.safetensors`), undoing the RoPE permutation: the inverse of
    /// [`LlamaWeights::from_hf_dir`], used to check that both loaders agree.
    pub fn write_hf_dir(&self, dir: &Path) -> std::io::Result<()> {
        let c = &self.config;
        std::fs::create_dir_all(dir)?;
        let cfg = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": c.hidden, "intermediate_size": c.intermediate,
            "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads, "rms_norm_eps": c.rms_eps,
            "rope_theta": c.rope.base, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position,
            "tie_word_embeddings": self.lm_head.is_none(),
        });
        std::fs::write(dir.join("config.json"), cfg.to_string())?;
        let f32b = |v: &[f32]| kernels::quant::encode_row(Format::F32, v);
        let mut t: Vec<(String, &str, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut m = |name: String, x: &Matrix, permute: Option<usize>| {
            let mut v = x.to_f32();
            if let Some(heads) = permute {
                v = interleaved_to_hf(v, heads, x.cols());
            }
            t.push((name, "F32", vec![x.rows(), x.cols()], f32b(&v)));
        };
        m("model.embed_tokens.weight".into(), &self.embed, None);
        if let Some(h) = &self.lm_head {
            m("lm_head.weight".into(), h, None);
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = |n: &str| format!("model.layers.{i}.{n}.weight");
            m(p("self_attn.q_proj"), &l.wq, Some(c.heads));
            m(p("self_attn.k_proj"), &l.wk, Some(c.kv_heads));
            m(p("self_attn.v_proj"), &l.wv, None);
            m(p("self_attn.o_proj"), &l.wo, None);
            m(p("mlp.gate_proj"), &l.w_gate, None);
            m(p("mlp.up_proj"), &l.w_up, None);
            m(p("mlp.down_proj"), &l.w_down, None);
        }
        for (i, l) in self.layers.iter().enumerate() {
            let p = |n: &str| format!("model.layers.{i}.{n}.weight");
            t.push((
                p("input_layernorm"),
                "F32",
                vec![c.hidden],
                f32b(&l.attn_norm),
            ));
            t.push((
                p("post_attention_layernorm"),
                "F32",
                vec![c.hidden],
                f32b(&l.ffn_norm),
            ));
        }
        t.push((
            "model.norm.weight".into(),
            "F32",
            vec![c.hidden],
            f32b(&self.norm),
        ));
        safetensors::write(&dir.join("model.safetensors"), &t)
    }
}

/// Hugging Face stores each head's rotary pairs as (i, i + d/2); GGUF as (2i, 2i + 1). Row
/// `2i + j` of a head in GGUF order is row `j·d/2 + i` in HF order.
fn hf_to_interleaved(w: Vec<f32>, heads: usize, cols: usize) -> Vec<f32> {
    permute_rope_rows(w, heads, cols, true)
}

/// The inverse of [`hf_to_interleaved`].
fn interleaved_to_hf(w: Vec<f32>, heads: usize, cols: usize) -> Vec<f32> {
    permute_rope_rows(w, heads, cols, false)
}

fn permute_rope_rows(w: Vec<f32>, heads: usize, cols: usize, to_interleaved: bool) -> Vec<f32> {
    let hd = w.len() / cols / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let gguf = (h * hd + 2 * i + j) * cols;
                let hf = (h * hd + j * hd / 2 + i) * cols;
                let (dst, src) = if to_interleaved {
                    (gguf, hf)
                } else {
                    (hf, gguf)
                };
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// The files in `dir` named `*.ext`, sorted.
fn files_with_extension(dir: &Path, ext: &str) -> Result<Vec<PathBuf>, LoadError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| LoadError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    files.sort();
    Ok(files)
}

/// Why a K-quant tensor's bytes cannot become a matrix; the loader reports it as a
/// [`LoadError::Tensor`] naming the file and tensor.
#[derive(Debug, thiserror::Error)]
enum KQuantError {
    #[error("{format} rows must be whole 256-value super-blocks, got {cols} columns")]
    PartialSuperBlock { format: &'static str, cols: usize },
    #[error("{got} bytes for {rows}x{cols} {format}")]
    Size {
        format: &'static str,
        rows: usize,
        cols: usize,
        got: usize,
    },
    #[error(transparent)]
    Matrix(#[from] MatrixError),
}

/// A K-quant matrix as the kernels run it: each row decoded and re-quantised to Q8_0 (finer
/// than Q4_K or Q6_K), or widened to f32 when asked.
fn k_quant_matrix(
    kind: KQuant,
    rows: usize,
    cols: usize,
    src: &[u8],
    dequantize: bool,
) -> Result<Matrix, KQuantError> {
    let row = kind.row_bytes(cols).ok_or(KQuantError::PartialSuperBlock {
        format: kind.name(),
        cols,
    })?;
    if src.len() != row * rows {
        return Err(KQuantError::Size {
            format: kind.name(),
            rows,
            cols,
            got: src.len(),
        });
    }
    let mut values = vec![0f32; cols];
    if dequantize {
        let mut all = Vec::with_capacity(rows * cols);
        for r in src.chunks_exact(row) {
            kind.dequantize_row(r, &mut values);
            all.extend_from_slice(&values);
        }
        return Ok(Matrix::from_f32(rows, cols, all));
    }
    let mut q8 = Vec::with_capacity(rows * Format::Q8_0.row_bytes(cols).unwrap_or(0));
    for r in src.chunks_exact(row) {
        kind.dequantize_row(r, &mut values);
        q8.extend(kernels::quant::quantize_row(Format::Q8_0, &values));
    }
    let len = q8.len();
    Ok(Matrix::from_bytes(
        Format::Q8_0,
        rows,
        cols,
        Arc::new(q8),
        0,
        len,
    )?)
}

/// Maps the model file read-only.
#[allow(unsafe_code)]
fn map(file: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the mapping is read-only and kvgate never writes model files. Truncating or
    // rewriting a model file while a replica serves it is unsupported (as with llama.cpp's
    // mmap): the process could fault on pages that no longer exist.
    unsafe { memmap2::Mmap::map(file) }
}

struct GgufSource<'a> {
    header: &'a GgufHeader,
    bytes: SharedBytes,
    opts: LoadOptions,
}

impl GgufSource<'_> {
    fn err(&self, tensor: &str, what: String) -> LoadError {
        LoadError::Tensor {
            path: self.header.path.display().to_string(),
            tensor: tensor.into(),
            what,
        }
    }

    fn info(&self, name: &str) -> Result<&protocol::gguf::TensorInfo, LoadError> {
        self.header
            .tensor(name)
            .ok_or_else(|| self.err(name, "missing".into()))
    }

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
        let m = self.matrix(name, 1, n)?;
        Ok(m.to_f32())
    }

    /// A `rows × cols` matrix (GGML dims `[cols, rows]`).
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        let t = self.info(name)?;
        let want: Vec<u64> = if rows == 1 {
            vec![cols as u64]
        } else {
            vec![cols as u64, rows as u64]
        };
        let dims: Vec<u64> = match (t.dims.as_slice(), rows) {
            ([n, 1], 1) => vec![*n],
            (d, _) => d.to_vec(),
        };
        if dims != want {
            return Err(self.err(name, format!("dims {:?}, expected {:?}", t.dims, want)));
        }
        if let Some(kind) = match t.ggml_type {
            ggml_type::Q4_K => Some(KQuant::Q4K),
            ggml_type::Q6_K => Some(KQuant::Q6K),
            _ => None,
        } {
            let len = t.bytes.expect("sized for supported types") as usize;
            let at = t.offset as usize;
            let src = &(*self.bytes).as_ref()[at..at + len];
            return k_quant_matrix(kind, rows, cols, src, self.opts.dequantize)
                .map_err(|e| self.err(name, e.to_string()));
        }
        let format = match t.ggml_type {
            ggml_type::F32 => Format::F32,
            ggml_type::F16 => Format::F16,
            ggml_type::BF16 => Format::BF16,
            ggml_type::Q8_0 => Format::Q8_0,
            ggml_type::Q4_0 => Format::Q4_0,
            ggml_type::Q4_1 => Format::Q4_1,
            other => {
                return Err(self.err(
                    name,
                    format!(
                    "type {} ({other}); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K",
                    ggml_type::name(other)
                ),
                ))
            }
        };
        let len = t.bytes.expect("sized for supported types") as usize;
        let m = Matrix::from_bytes(
            format,
            rows,
            cols,
            self.bytes.clone(),
            t.offset as usize,
            len,
        )
        .map_err(|e| self.err(name, e.to_string()))?;
        if self.opts.dequantize && format.is_quantized() {
            return Ok(Matrix::from_f32(rows, cols, m.to_f32()));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_quant_rows_become_q8_0_within_its_rounding() {
        // Two Q6_K rows of 256 values: random payload, sane scales.
        let mut src = Vec::new();
        for r in 0..2u32 {
            let mut blk: Vec<u8> = (0..210u32)
                .map(|i| (i.wrapping_mul(2654435761).wrapping_add(r * 97) >> 13) as u8)
                .collect();
            blk[208..210].copy_from_slice(&[0x1f, 0x21]); // f16 0.01
            src.extend(blk);
        }
        let m = k_quant_matrix(KQuant::Q6K, 2, 256, &src, false).unwrap();
        assert_eq!(m.format(), Format::Q8_0);
        let mut exact = vec![0f32; 256];
        KQuant::Q6K.dequantize_row(&src[210..], &mut exact);
        let mut got = vec![0f32; 256];
        m.row_f32(1, &mut got);
        let amax = exact.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (g, e) in got.iter().zip(&exact) {
            assert!((g - e).abs() <= amax / 127.0, "{g} vs {e}");
        }
        let err = k_quant_matrix(KQuant::Q4K, 1, 128, &src[..144], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("256-value super-blocks"), "{err}");
    }
}
