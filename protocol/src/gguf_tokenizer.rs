//! A Hugging Face `tokenizer.json` and `tokenizer_config.json` rebuilt from a GGUF file's
//! `tokenizer.ggml.*` metadata, so one model file is all a replica or the gateway needs: the
//! vocabulary, merges and special tokens become a byte-level BPE model with the pre-tokeniser
//! that `tokenizer.ggml.pre` names, and `tokenizer.chat_template` becomes the chat template.
//! The same two JSON documents can be written out (`kvgate export-tokenizer`) for tools that
//! want a tokenizer folder.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the pre-tokenisers of the
//! GPT-2, SmolLM/StarCoder, Llama 3 and Qwen 2 families. SentencePiece (`llama`) vocabularies
//! are refused with a message that says so.

use serde_json::{json, Map, Value};

use crate::gguf::{GgufError, GgufHeader, Value as G};

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

fn pre_tokenizer(pre: &str) -> Option<Value> {
    Some(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]})
        }
        "qwen2" | "deepseek-r1-qwen" => {
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]})
        }
        _ => return None,
    })
}

fn unsupported(h: &GgufHeader, key: &str, expected: &'static str) -> GgufError {
    GgufError::KeyType {
        path: h.path.clone(),
        key: key.into(),
        expected,
    }
}

/// The two documents: (`tokenizer.json`, `tokenizer_config.json`).
pub fn tokenizer_files(h: &GgufHeader) -> Result<(Value, Value), GgufError> {
    let model = h.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(unsupported(
            h,
            "tokenizer.ggml.model",
            "\"gpt2\" (byte-level BPE); SentencePiece vocabularies are not supported yet",
        ));
    }
    let pre_name = match h.get("tokenizer.ggml.pre") {
        Some(v) => v
            .as_str()
            .ok_or_else(|| unsupported(h, "tokenizer.ggml.pre", "a string"))?,
        None => "default",
    };
    let pre = pre_tokenizer(pre_name).ok_or_else(|| {
        unsupported(
            h,
            "tokenizer.ggml.pre",
            "one of default, gpt2, smollm, starcoder, llama-bpe, llama3, qwen2",
        )
    })?;
    let tokens = h.strings("tokenizer.ggml.tokens")?;
    let types: Vec<u64> = match h.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(G::as_u64).collect::<Option<Vec<_>>>())
            .filter(|t| t.len() == tokens.len())
            .ok_or_else(|| {
                unsupported(
                    h,
                    "tokenizer.ggml.token_type",
                    "an integer array as long as tokenizer.ggml.tokens",
                )
            })?,
        None => vec![1; tokens.len()],
    };
    let merges = h.strings("tokenizer.ggml.merges")?;

    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(tok.to_string(), json!(id));
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": ty == USER_DEFINED, "special": ty == CONTROL,
            }));
        }
    }
    let token_at = |key: &str| -> Result<Option<String>, GgufError> {
        match h.get(key) {
            None => Ok(None),
            Some(v) => {
                let id = v
                    .as_u64()
                    .ok_or_else(|| unsupported(h, key, "a token id"))?;
                tokens
                    .get(id as usize)
                    .map(|t| Some(t.to_string()))
                    .ok_or_else(|| unsupported(h, key, "a token id inside the vocabulary"))
            }
        }
    };
    let bos = token_at("tokenizer.ggml.bos_token_id")?;
    let eos = token_at("tokenizer.ggml.eos_token_id")?;
    let add_bos = h
        .get("tokenizer.ggml.add_bos_token")
        .and_then(G::as_bool)
        .unwrap_or(false);
    let post = match (&bos, add_bos) {
        (Some(b), true) => {
            let id = vocab[b.as_str()].clone();
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {b.as_str(): {"id": b, "ids": [id], "tokens": [b]}}})
        }
        _ => Value::Null,
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    });
    let mut config = Map::new();
    if let Some(b) = bos {
        config.insert("bos_token".into(), json!(b));
    }
    if let Some(e) = eos {
        config.insert("eos_token".into(), json!(e));
    }
    config.insert("add_bos_token".into(), json!(add_bos));
    if let Some(t) = h.get("tokenizer.chat_template") {
        let t = t
            .as_str()
            .ok_or_else(|| unsupported(h, "tokenizer.chat_template", "a string"))?;
        config.insert("chat_template".into(), json!(t));
    }
    config.insert(
        "source".into(),
        json!(format!("rebuilt by kvgate from {}", h.path.display())),
    );
    Ok((tokenizer, Value::Object(config)))
}

/// The model's end-of-generation token ids: EOS, plus EOT where the file names one.
pub fn stop_token_ids(h: &GgufHeader) -> Vec<u32> {
    let mut ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
        .iter()
        .filter_map(|k| h.get(k).and_then(G::as_u64))
        .map(|v| v as u32)
        .collect();
    ids.dedup();
    ids
}
