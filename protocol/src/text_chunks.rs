//! Where a long text can be cut so that its pieces tokenise, one by one, to exactly the ids of
//! the whole: the basis of tokenising a shared prefix once (`segment_cache.rs`).
//!
//! The byte-level BPE tokenizers the gateway meets (Qwen, Llama 3, GPT-2-style like SmolLM2's)
//! pre-tokenise with a regex before merging, and merges never cross a pre-token. Between an
//! ASCII letter and a space followed by an ASCII letter ("…word word…") every one of those
//! regexes ends one pre-token and starts the next (`\p{L}+` stops at the space; the space opens
//! `[^\r\n\p{L}\p{N}]?\p{L}+` or ` ?\p{L}+`), and neither side's pre-tokens look across it. So
//! [`chunk_bounds`] cuts only there, at the first such place past every `target` bytes; a text
//! without one stays whole. Cuts depend only on the text before them, so two prompts sharing a
//! prefix are cut the same way up to where they differ.
//!
//! That reasoning is about regexes; a tokenizer could still differ (a normaliser, a `Metaspace`
//! that prefixes every piece, a post-processor that adds more than a leading token). So
//! [`ChunkSupport::check`] proves it per tokenizer at load, on a corpus of prose, code,
//! numbers, whitespace runs, contractions and multi-byte text cut at small intervals: when the
//! pieces' ids differ from the whole's anywhere, chunking is off for that tokenizer.

use crate::tokenizer::TextTokenizer;

/// A varied text for the load-time check: prose, code, numbers, whitespace runs, contractions,
/// punctuation and multi-byte characters, each next to the cuts.
const CORPUS: &str = "The quick brown fox jumps over the lazy dog. It's what they'd \
    call a pangram, and we'll see whether it's tokenised the same way twice.\n\n\
    fn main() {\n    let total: u64 = (1..=12345).map(|x| x * 2).sum();\n    \
    println!(\"total = {total}\");\n}\n\n\
    Prices rose 12.5% to $1,234,567.89 in Q3 2026; volumes fell   three    percent.\t\
    Tabs\tand  double  spaces stay\u{a0}as they are. \
    Ünïcödé wörds like naïve café and 漢字 テキスト mixed with emoji 🚀🔥 and Ελληνικά text \
    go through unchanged, as do URLs like https://example.com/a?b=c&d=e#frag.\n\
    - a bullet\n- another bullet with trailing space \n\n\n\
    SHOUTING WORDS and CamelCaseIdentifiers and snake_case_names and kebab-case-names. \
    <|im_start|>user\nA literal special token in the text<|im_end|>\n\
    Numbers 1 22 333 4444 55555 666666 7777777 in a row, then words again and again. ";

/// Byte offsets where `text` is cut into pieces of at least `target` bytes (each offset a cut
/// before a space that follows an ASCII letter and precedes one); empty when no cut falls.
pub fn chunk_bounds(text: &str, target: usize) -> Vec<usize> {
    let b = text.as_bytes();
    let mut cuts = Vec::new();
    let mut next = target.max(1);
    while next < b.len() {
        let Some(at) = (next..b.len().saturating_sub(1)).find(|&i| {
            b[i] == b' ' && b[i - 1].is_ascii_alphabetic() && b[i + 1].is_ascii_alphabetic()
        }) else {
            break;
        };
        cuts.push(at);
        next = at + target.max(1);
    }
    cuts
}

/// The pieces of `text` at `cuts`.
pub fn pieces<'a>(text: &'a str, cuts: &'a [usize]) -> impl Iterator<Item = &'a str> + 'a {
    let starts = std::iter::once(0).chain(cuts.iter().copied());
    let ends = cuts.iter().copied().chain(std::iter::once(text.len()));
    starts.zip(ends).map(move |(s, e)| &text[s..e])
}

/// What a tokenizer allows, found at load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSupport {
    /// Pieces cut by [`chunk_bounds`] tokenise (without special tokens) to the whole's ids.
    pub chunking: bool,
    /// What `encode(text, true)` adds before the text's own ids (Llama 3's BOS, nothing for
    /// Qwen), when that is all it adds: `None` when a prompt with special tokens added cannot be
    /// assembled from pieces.
    pub added_prefix: Option<Vec<u32>>,
}

impl ChunkSupport {
    /// Checks `tok` on the corpus, cut every 40 and every 200 bytes.
    pub fn check(tok: &TextTokenizer) -> ChunkSupport {
        let text = CORPUS.repeat(3);
        let Ok(whole) = tok.encode(&text, false) else {
            return ChunkSupport {
                chunking: false,
                added_prefix: None,
            };
        };
        let chunking = [40, 200].into_iter().all(|target| {
            let cuts = chunk_bounds(&text, target);
            let mut ids = Vec::with_capacity(whole.len());
            for p in pieces(&text, &cuts) {
                match tok.encode(p, false) {
                    Ok(i) => ids.extend(i),
                    Err(_) => return false,
                }
            }
            !cuts.is_empty() && ids == whole
        });
        let added_prefix = tok.encode("", true).ok().filter(|prefix| {
            tok.encode(&text, true).is_ok_and(|with| {
                with.len() == prefix.len() + whole.len()
                    && with.starts_with(prefix)
                    && with[prefix.len()..] == whole[..]
            })
        });
        ChunkSupport {
            chunking,
            added_prefix,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_between_words_only_and_pieces_rebuild_the_text() {
        let text = "alpha beta gamma delta  epsilon 12 zeta ünï eta theta";
        let cuts = chunk_bounds(text, 8);
        for &c in &cuts {
            let b = text.as_bytes();
            assert!(
                b[c] == b' ' && b[c - 1].is_ascii_alphabetic() && b[c + 1].is_ascii_alphabetic()
            );
        }
        assert_eq!(pieces(text, &cuts).collect::<String>(), text);
        // Not inside a double space, after a number, or next to a multi-byte letter: the only
        // cuts are before " gamma" and before " theta".
        assert_eq!(cuts, vec![10, 49]);
        assert!(chunk_bounds("no-cut-here", 2).is_empty());
        assert!(chunk_bounds("short", 100).is_empty());
    }

    #[test]
    fn a_shared_prefix_is_cut_the_same_way_until_the_texts_differ() {
        let shared = "word ".repeat(400);
        let a = format!("{shared}and then the first question");
        let b = format!("{shared}but a second question instead");
        let (ca, cb) = (chunk_bounds(&a, 256), chunk_bounds(&b, 256));
        let common: Vec<_> = ca.iter().filter(|&&c| c < shared.len() - 256).collect();
        assert!(common.len() >= 5);
        assert!(common.iter().all(|c| cb.contains(c)));
    }
}
