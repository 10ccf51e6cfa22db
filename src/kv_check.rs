//! `kvgate kv-check`: the long-generation quality check for a quantised KV cache
//! ([`replica::kv_quality`]) on a real model, with a verdict and an exit code.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use protocol::openai::ChatMessage;
use protocol::tokenizer::TextTokenizer;
use replica::kv_quality::{check, KvElement, QualityPlan, QualityReport};
use replica::model::{LlamaWeights, LoadOptions};

use crate::up;

/// Prompts that ask for long answers (rendered with the model's chat template when it has one).
const PROMPTS: [&str; 8] = [
    "Write a long, detailed essay on how the printing press changed Europe.",
    "Explain step by step how a compiler turns source code into machine code.",
    "Tell a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the water cycle in detail, for a class of twelve-year-olds.",
    "Compare three ways of cooking rice, with the pros and cons of each.",
    "Give a thorough guide to planning a two-week hiking trip in the mountains.",
    "Explain how vaccines train the immune system, with examples.",
    "Write a detailed history of the bicycle from its invention to today.",
];

/// The fixed text scored under both caches, after the sim's corpus (about 600 tokens together
/// for common tokenizers).
const MORE_TEXT: &str = "The river town woke slowly that spring. Fishermen pushed their boats from the muddy bank before \
the sun had cleared the hills, and the baker on the square lit her oven while the streets were \
still blue with shadow. By seven the market stalls were up: onions and early lettuce, cheeses \
wrapped in cloth, a table of second-hand books whose owner read more than he sold. Children ran \
between the stalls on their way to the school by the bridge, and the old ferryman, who had \
carried people across the water for forty years, complained to anyone who would listen that \
the new bridge had taken his work and left him only his stories. Nobody minded; the stories \
were better than the bridge. In the afternoon the wind turned, the clouds came down the valley, \
and the first rain of the season washed the dust from the roofs. The market folded in minutes. \
By evening the river had risen a hand's width, the fishermen were mending nets under the arches, \
and the baker was selling the last of the bread at half price to whoever came in out of the wet.\n\n\
A cache that stores numbers with fewer bits saves memory and bandwidth, but every value it \
returns is slightly wrong. For one token the error is harmless. Over a long generation, where \
every new token attends to hundreds of earlier keys and values, small errors can add up, tip a \
near-tie between two words, and send the text down a different path. That is why a quantised \
cache is judged on long generations and on the probability it assigns to a known text, not on \
a short benchmark that ends before the errors have had time to matter.";

#[derive(Args)]
pub struct KvCheckArgs {
    /// A GGUF file or Hugging Face folder (default: the fetched SmolLM2-135M-Instruct GGUF).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tokenizer folder or GGUF file (default: the model's own).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The cache to judge against f16: fp8 (E4M3, a scale per token and head).
    #[arg(long = "kv-dtype", default_value = "fp8")]
    pub kv_dtype: String,
    /// Tokens generated and compared per prompt.
    #[arg(long, default_value_t = 512)]
    pub tokens: usize,
    /// Prompts (up to 8 built-in ones), generated together as one batch.
    #[arg(long, default_value_t = 4)]
    pub prompts: usize,
    /// A text file to score instead of the built-in text.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Compute threads (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Fail below this share of forced-decoding agreement with the f16 cache.
    #[arg(long, default_value_t = 0.95)]
    pub min_agreement: f64,
    /// Fail when the text's perplexity grows by more than this fraction.
    #[arg(long, default_value_t = 0.01)]
    pub max_perplexity_increase: f64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn render(tok: &TextTokenizer, prompt: &str) -> Result<Vec<u32>> {
    if tok.has_chat_template() {
        Ok(tok
            .encode_chat(&[ChatMessage::new("user", prompt)], true, None, None)
            .map_err(|e| anyhow!("cannot render the chat template: {e}"))?)
    } else {
        Ok(tok.encode(prompt, true)?)
    }
}

fn as_json(r: &QualityReport, a: &KvCheckArgs, pass: bool) -> serde_json::Value {
    let cache = |c: &replica::kv_quality::CacheFigures| {
        serde_json::json!({
            "kv_cache_dtype": c.element,
            "kv_bytes_per_token": c.kv_bytes_per_token,
            "decode_tokens_per_s": c.decode_tokens_per_s,
            "text_perplexity": c.text_perplexity,
        })
    };
    serde_json::json!({
        "reference": cache(&r.reference),
        "candidate": cache(&r.candidate),
        "generated_tokens": r.generated_tokens,
        "agreement": r.agreement,
        "generation_logprob_delta": r.generation_logprob_delta,
        "text_logprob_delta": r.text_logprob_delta,
        "perplexity_increase": r.perplexity_increase(),
        "first_divergence": r.first_divergence,
        "thresholds": {"min_agreement": a.min_agreement, "max_perplexity_increase": a.max_perplexity_increase},
        "pass": pass,
    })
}

pub fn run_kv_check(a: KvCheckArgs) -> Result<()> {
    let candidate = KvElement::parse(&a.kv_dtype)
        .ok_or_else(|| anyhow!("--kv-dtype must be fp8 or f16, got `{}`", a.kv_dtype))?;
    if a.prompts == 0 || a.prompts > PROMPTS.len() || a.tokens == 0 {
        bail!(
            "--prompts must be 1 to {} and --tokens at least 1",
            PROMPTS.len()
        );
    }
    let model = match a.model.clone() {
        Some(m) => m,
        None => up::default_model_file_or_fetch()?,
    };
    let weights = LlamaWeights::load(&model, LoadOptions::default())
        .with_context(|| format!("cannot load {}", model.display()))?;
    let tok_path = a.tokenizer.clone().unwrap_or_else(|| model.clone());
    let tok = TextTokenizer::from_path(&tok_path)
        .with_context(|| format!("cannot load the tokenizer at {}", tok_path.display()))?;
    let prompts = PROMPTS[..a.prompts]
        .iter()
        .map(|p| render(&tok, p))
        .collect::<Result<Vec<_>>>()?;
    let text = match &a.text {
        Some(f) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?
        }
        None => format!("{}\n\n{MORE_TEXT}", replica::sim::CORPUS.trim_end()),
    };
    let text = tok.encode(&text, true)?;
    if text.len() < 2 {
        bail!("the text to score needs at least two tokens");
    }
    let threads = a.threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let plan = QualityPlan {
        prompts,
        tokens: a.tokens,
        text,
        threads,
    };
    eprintln!(
        "kv-check: {} against f16 on {}: {} prompts × {} tokens and a {}-token text, {threads} threads",
        candidate.name(),
        model.display(),
        plan.prompts.len(),
        plan.tokens,
        plan.text.len()
    );
    let r = check(&Arc::new(weights), candidate, &plan)?;
    let agreement_ok = r.agreement >= a.min_agreement;
    let ppl_ok = r.perplexity_increase() <= a.max_perplexity_increase;
    let pass = agreement_ok && ppl_ok;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&as_json(&r, &a, pass))?);
    } else {
        let (f, c) = (&r.reference, &r.candidate);
        println!("| | {} | {} | ratio |", f.element, c.element);
        println!("|---|---|---|---|");
        println!(
            "| KV bytes per token | {} | {} | {:.3} |",
            f.kv_bytes_per_token,
            c.kv_bytes_per_token,
            c.kv_bytes_per_token as f64 / f.kv_bytes_per_token as f64
        );
        println!(
            "| decode tokens/s (batch {}) | {:.1} | {:.1} | {:.3} |",
            plan.prompts.len() + 1,
            f.decode_tokens_per_s,
            c.decode_tokens_per_s,
            c.decode_tokens_per_s / f.decode_tokens_per_s
        );
        println!(
            "| text perplexity | {:.4} | {:.4} | {:.4} |",
            f.text_perplexity,
            c.text_perplexity,
            c.text_perplexity / f.text_perplexity
        );
        println!();
        println!(
            "forced agreement: {:.4} of {} generated tokens (minimum {}) {}",
            r.agreement,
            r.generated_tokens,
            a.min_agreement,
            if agreement_ok { "ok" } else { "FAIL" }
        );
        println!(
            "perplexity increase: {:+.4} (maximum {}) {}",
            r.perplexity_increase(),
            a.max_perplexity_increase,
            if ppl_ok { "ok" } else { "FAIL" }
        );
        println!(
            "mean |Δ log p|: generated {:.5}, text {:.5}",
            r.generation_logprob_delta, r.text_logprob_delta
        );
        let div: Vec<String> = r
            .first_divergence
            .iter()
            .map(|d| d.map_or("never".into(), |i| i.to_string()))
            .collect();
        println!(
            "free-running generations first differ at token: {}",
            div.join(", ")
        );
    }
    if !pass {
        bail!(
            "the {} cache fails the quality check against f16",
            candidate.name()
        );
    }
    Ok(())
}
