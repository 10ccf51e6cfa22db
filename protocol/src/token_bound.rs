//! Bounded tokenisation: decide that a text is longer than a token limit without tokenising all
//! of it. Tokenising is the gateway's most expensive step (HF tokenizers spend ~1 s of CPU and
//! a few hundred bytes of working memory per input byte on a multi-megabyte prompt), so a
//! client must not be able to make it tokenise megabytes only to be told the prompt is too
//! long.
//!
//! Two stages, cheapest first:
//! 1. A bound from the byte length alone: no token covers more input bytes than the longest
//!    vocabulary entry (doubled when the tokenizer normalises, since normalisation can shrink
//!    text), so `bytes / that` tokens is a lower bound. A text whose bound is over the limit
//!    is refused without being tokenised at all.
//! 2. For a long text whose bound is not conclusive, counting in 64 KiB pieces cut at
//!    whitespace, stopping as soon as the count is certainly over the limit. Cutting can move
//!    a few tokens across a cut, so each cut is allowed [`SLACK_PER_CUT`] tokens before the
//!    count is trusted. Working memory is one piece's, and the work stops near the limit.
//!
//! A text that passes is then tokenised exactly by the caller (whole, or segment-wise), and
//! the exact count is checked again.

use crate::tokenizer::{TextTokenizer, TokenizerError};

/// Texts up to this size are tokenised directly: counting first would only add work.
const PIECEWISE_FROM_BYTES: usize = 256 << 10;
/// Size of one counted piece.
const PIECE_BYTES: usize = 64 << 10;
/// Tokens one cut may add or remove against tokenising the text whole.
const SLACK_PER_CUT: usize = 8;

/// The outcome of [`TextTokenizer::check_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitCheck {
    /// The text may fit: tokenise it exactly.
    MayFit,
    /// The text certainly has more than the limit; `at_least` tokens, `tokenized_bytes` of it
    /// were tokenised to find out (0 when the byte bound decided).
    Exceeds {
        at_least: usize,
        tokenized_bytes: usize,
    },
}

/// The end of the next piece of `text` starting at `from`: about [`PIECE_BYTES`] long, cut
/// just before a whitespace character where there is one in the piece's last quarter, always
/// on a character boundary.
fn piece_end(text: &str, from: usize) -> usize {
    let hard = from + PIECE_BYTES;
    if hard >= text.len() {
        return text.len();
    }
    let mut end = hard;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let window_start = end - PIECE_BYTES / 4;
    let bytes = text.as_bytes();
    // Cut before a space that follows a non-space, so runs of whitespace stay whole.
    (window_start + 1..end)
        .rev()
        .find(|&i| bytes[i] == b' ' && !bytes[i - 1].is_ascii_whitespace())
        .unwrap_or(end)
}

impl TextTokenizer {
    /// A lower bound on the number of tokens of a text of `bytes` bytes.
    pub fn min_tokens_for_bytes(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.max_bytes_per_token().max(1))
    }

    /// Whether `text` certainly has more than `limit` tokens, found with bounded work.
    pub fn check_limit(&self, text: &str, limit: usize) -> Result<LimitCheck, TokenizerError> {
        let bound = self.min_tokens_for_bytes(text.len());
        if bound > limit {
            return Ok(LimitCheck::Exceeds {
                at_least: bound,
                tokenized_bytes: 0,
            });
        }
        // Every byte-level or byte-fallback tokenizer spends at least one byte per token (plus
        // the specials it adds), so a text this short fits whatever it holds.
        if text.len() + 2 <= limit || text.len() < PIECEWISE_FROM_BYTES {
            return Ok(LimitCheck::MayFit);
        }
        let (mut counted, mut at, mut cuts) = (0usize, 0usize, 0usize);
        while at < text.len() {
            let end = piece_end(text, at);
            counted += self.encode(&text[at..end], false)?.len();
            at = end;
            if at < text.len() {
                cuts += 1;
            }
            let trusted = counted.saturating_sub(cuts * SLACK_PER_CUT);
            if trusted > limit {
                return Ok(LimitCheck::Exceeds {
                    at_least: trusted,
                    tokenized_bytes: at,
                });
            }
        }
        Ok(LimitCheck::MayFit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_on_char_boundaries() {
        let text = "héllo wörld ".repeat(20_000);
        let mut at = 0;
        let mut n = 0;
        while at < text.len() {
            let end = piece_end(&text, at);
            assert!(end > at && text.is_char_boundary(end));
            assert!(end - at <= PIECE_BYTES);
            if end < text.len() {
                assert_eq!(text.as_bytes()[end], b' ', "cut before a space");
            }
            at = end;
            n += 1;
        }
        assert_eq!(at, text.len());
        assert!(n >= text.len() / PIECE_BYTES);
    }

    #[test]
    fn a_piece_without_spaces_is_cut_at_its_length() {
        let text = "x".repeat(3 * PIECE_BYTES);
        assert_eq!(piece_end(&text, 0), PIECE_BYTES);
        assert_eq!(piece_end(&text, 2 * PIECE_BYTES), 3 * PIECE_BYTES);
    }
}
