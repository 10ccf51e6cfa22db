//! Parity with HF: the rendered chat and its token ids below were produced by Python's jinja2
//! (HF's environment: trim_blocks, lstrip_blocks) and the `tokenizers` package from the same
//! `models/qwen3` files. Needs the default model files (`scripts/fetch-models.sh`).

use std::path::PathBuf;

use protocol::openai::ChatMessage;
use protocol::tokenizer::{IncrementalDecoder, TextTokenizer};

fn qwen3() -> TextTokenizer {
    let dir = std::env::var("KVGATE_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3"));
    TextTokenizer::from_dir(&dir).unwrap_or_else(|e| {
        panic!("default model files missing ({e}); run scripts/fetch-models.sh first")
    })
}

const RENDERED: &str = "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3? \u{dc}n\u{ef}c\u{f8}d\u{e9} \u{2713}<|im_end|>\n<|im_start|>assistant\n";

const IDS: [u32; 50] = [
    151644, 8948, 198, 2610, 525, 264, 50537, 17847, 13, 151645, 198, 151644, 872, 198, 3838, 374,
    220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198, 19, 151645, 198, 151644, 872, 198, 3036,
    220, 18, 10, 18, 30, 30512, 77, 37572, 66, 74720, 963, 52375, 151645, 198, 151644, 77091, 198,
];

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are a terse assistant."),
        ChatMessage::new("user", "What is 2+2?"),
        ChatMessage::new("assistant", "<think>\nadd\n</think>\n\n4"),
        ChatMessage::new("user", "And 3+3? Ünïcødé ✓"),
    ]
}

#[test]
fn renders_qwen3_chat_template_like_hf() {
    let tok = qwen3();
    let text = tok
        .apply_chat_template(&conversation(), true, None, None)
        .unwrap();
    assert_eq!(text, RENDERED);
}

#[test]
fn tokenises_like_hf() {
    let tok = qwen3();
    assert_eq!(tok.encode(RENDERED, false).unwrap(), IDS.to_vec());
    assert_eq!(
        tok.encode_chat(&conversation(), true, None, None).unwrap(),
        IDS.to_vec()
    );
    assert_eq!(tok.eos_token_id(), Some(151645));
}

#[test]
fn incremental_decoding_reassembles_multibyte_text() {
    let tok = qwen3();
    let text = "Ünïcødé ✓ and 日本語 text";
    let ids = tok.encode(text, false).unwrap();
    let mut dec = IncrementalDecoder::new();
    let mut out = String::new();
    for id in ids {
        let delta = dec.step(&tok, id).unwrap();
        assert!(!delta.contains('\u{FFFD}'));
        out.push_str(&delta);
    }
    assert_eq!(out, text);
}

/// A multi-turn conversation tokenised segment by segment (special tokens split the rendered
/// text) gives the whole-prompt ids, and the next turn reuses the cached segments.
#[test]
fn segmented_encoding_equals_whole_prompt_and_reuses_turns() {
    use protocol::segment_cache::SegmentCache;
    let tok = qwen3();
    let cache = SegmentCache::new(&tok, 1 << 20);
    assert!(cache.is_segmenting());
    let mut msgs = vec![ChatMessage::new(
        "system",
        "You are a meticulous assistant for a logistics company. Quote tracking numbers exactly.",
    )];
    for turn in 0..6 {
        msgs.push(ChatMessage::new(
            "user",
            &format!(
                "Turn {turn}: where is parcel {}? Ünïcødé ✓ \n\n  spaced   out",
                1000 + turn
            ),
        ));
        let text = tok.apply_chat_template(&msgs, true, None, None).unwrap();
        let whole = tok.encode(&text, false).unwrap();
        let before = cache.stats();
        let seg = cache.encode(&tok, &text).unwrap();
        assert_eq!(seg, whole, "turn {turn}");
        if turn > 0 {
            assert!(
                cache.stats().hits > before.hits,
                "turn {turn} reuses earlier segments"
            );
        }
        msgs.push(ChatMessage::new(
            "assistant",
            &format!(
                "<think>\nlooking up\n</think>\n\nParcel {} is in transit, expected tomorrow.",
                1000 + turn
            ),
        ));
    }
    assert_eq!(IDS.to_vec(), cache.encode(&tok, RENDERED).unwrap());
}

/// One tenant's segments are never another's cache hit (a hit is measurably faster, so a
/// shared cache would let a tenant confirm a guess of another's message by timing).
#[test]
fn segment_cache_is_scoped_by_tenant() {
    use protocol::segment_cache::SegmentCache;
    let tok = qwen3();
    let cache = SegmentCache::new(&tok, 1 << 20);
    let text = "<|im_start|>user\nTenant A's confidential quarterly figures: revenue 12.3 million, margin 41 percent<|im_end|>\n";
    let ids = tok.encode(text, false).unwrap();
    let a = Some("kvgate-tenant:a");
    let b = Some("kvgate-tenant:b");
    assert_eq!(cache.encode_scoped(&tok, text, a).unwrap(), ids);
    let after_a = cache.stats();
    assert_eq!(cache.encode_scoped(&tok, text, b).unwrap(), ids);
    let after_b = cache.stats();
    assert_eq!(
        after_b.hits, after_a.hits,
        "tenant B must miss what A tokenised"
    );
    assert_eq!(cache.encode(&tok, text).unwrap(), ids);
    assert_eq!(
        cache.stats().hits,
        after_b.hits,
        "nor may the unscoped tenant hit it"
    );
    assert_eq!(cache.encode_scoped(&tok, text, a).unwrap(), ids);
    assert!(cache.stats().hits > after_b.hits, "tenant A hits its own");
}

#[test]
fn segment_cache_stays_within_its_byte_budget() {
    use protocol::segment_cache::SegmentCache;
    let tok = qwen3();
    let cache = SegmentCache::new(&tok, 4096);
    for i in 0..200 {
        let text = format!("<|im_start|>user\nmessage number {i} with enough words to be cached for sure<|im_end|>\n");
        assert_eq!(
            cache.encode(&tok, &text).unwrap(),
            tok.encode(&text, false).unwrap()
        );
    }
    let s = cache.stats();
    assert!(s.bytes <= 4096, "{s:?}");
    assert!(s.entries > 0 && s.entries < 200, "{s:?}");
}

/// Prompts sharing a long prefix and then differing mid-word, inside a whitespace run, or
/// inside a multi-byte character's word: tokenised through the cache (in pieces, the shared
/// ones reused) they give exactly the whole-text ids, special tokens added or not.
fn pieces_equal_whole(tok: &TextTokenizer, what: &str) {
    use protocol::segment_cache::SegmentCache;
    let cache = SegmentCache::new(tok, 8 << 20);
    let support = cache.chunk_support().clone();
    assert!(support.chunking, "{what}: chunking proven at load");
    let shared = "You are the support assistant of a logistics company. Quote tracking numbers \
                  exactly, answer in two sentences, and never invent a delivery date. "
        .repeat(60);
    let tails = [
        "Where is parcel 1234? It was due yester", // a cut mid-word
        "Where is parcel 1234?   \t  It was due",  // inside a whitespace run
        "Wo ist das Paket für Jürgen? Ünïcödé 漢字🚀 naïve", // multi-byte characters
        " leading space, then words",
        "\n\nNew paragraph after the shared part.",
    ];
    let scope = Some("kvgate-tenant:golden");
    for (i, tail) in tails.iter().enumerate() {
        let text = format!("{shared}{tail}");
        let before = cache.stats();
        let got = cache.encode_prompt_scoped(tok, &text, scope).unwrap();
        assert_eq!(
            got,
            tok.encode(&text, true).unwrap(),
            "{what}: prompt {i}, special tokens added"
        );
        let plain = cache.encode_scoped(tok, &text, scope).unwrap();
        assert_eq!(
            plain,
            tok.encode(&text, false).unwrap(),
            "{what}: prompt {i}, plain"
        );
        if i > 0 {
            assert!(
                cache.stats().hits > before.hits,
                "{what}: prompt {i} reuses the shared pieces"
            );
        }
    }
    // Cut mid-word at every offset of a stretch: still exact.
    let text = format!("{shared}supercalifragilisticexpialidocious words follow");
    for cut in (shared.len()..shared.len() + 40).step_by(3) {
        let t = &text[..cut];
        assert_eq!(
            cache.encode_scoped(tok, t, scope).unwrap(),
            tok.encode(t, false).unwrap(),
            "{what}: cut at {cut}"
        );
    }
}

#[test]
fn qwen3_prompts_tokenised_in_pieces_equal_whole_prompts() {
    pieces_equal_whole(&qwen3(), "qwen3");
}

#[test]
fn smollm2_gguf_prompts_tokenised_in_pieces_equal_whole_prompts() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tok = TextTokenizer::from_gguf(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models.sh)", path.display()));
    pieces_equal_whole(&tok, "smollm2");
}

#[test]
fn llama3_prompts_tokenised_in_pieces_equal_whole_prompts() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/llama3");
    let tok = TextTokenizer::from_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-models.sh)", dir.display()));
    pieces_equal_whole(&tok, "llama3");
}

/// Newer Hugging Face folders (transformers 5) keep the chat template in `chat_template.jinja`
/// rather than in `tokenizer_config.json`: the folder loads with its template either way.
#[test]
fn a_chat_template_in_its_own_file_is_found() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3");
    let dir = std::env::temp_dir().join(format!("kvgate-jinja-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let template = cfg["chat_template"].as_str().unwrap().to_string();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let without = TextTokenizer::from_dir(&dir).unwrap();
    assert!(!without.has_chat_template());
    std::fs::write(dir.join("chat_template.jinja"), &template).unwrap();
    let with = TextTokenizer::from_dir(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(with.has_chat_template());
    let msgs = vec![ChatMessage::new("user", "hi")];
    assert_eq!(
        with.apply_chat_template(&msgs, true, None, None).unwrap(),
        qwen3()
            .apply_chat_template(&msgs, true, None, None)
            .unwrap()
    );
}
