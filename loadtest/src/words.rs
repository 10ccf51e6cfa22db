//! The text every generated workload is made of, and the request item they produce: a
//! built-in vocabulary of common English words (each one token in the Llama-3 and Qwen3
//! vocabularies, so word counts track token counts closely).

use crate::arrival::Rng;
use protocol::openai::ChatMessage;

const WORDS: &[&str] = &[
    "the", "cache", "block", "token", "prefix", "server", "request", "model", "memory", "time",
    "user", "answer", "system", "data", "query", "result", "batch", "queue", "latency", "route",
    "load", "replica", "table", "file", "value", "report", "order", "price", "customer", "account",
    "service", "network", "policy", "error", "update", "change", "support", "product", "market",
    "team", "project", "plan", "review", "test", "build", "release", "version", "window", "page",
    "line", "word", "number", "point", "state", "level", "rate", "cost", "week", "month", "year",
    "and", "with", "from", "into", "over", "under", "after", "before", "about", "between", "is",
    "was", "will", "can", "should", "must", "may", "has", "had", "does", "makes", "takes", "new",
    "old", "large", "small", "long", "short", "high", "low", "fast", "slow", "first", "last",
];

/// `n` words of seeded text.
pub fn text(rng: &mut Rng, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            out.push(if i % 17 == 0 { '.' } else { ' ' });
            if i % 17 == 0 {
                out.push(' ');
            }
        }
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
    }
    out
}

/// One request of a workload, in sending order.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkItem {
    /// Conversation it belongs to (`x-session-id`), if any.
    pub session: Option<u64>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: u32,
    /// Approximate prompt tokens (words and punctuation plus template overhead).
    pub approx_tokens: usize,
}

pub(crate) fn approx_tokens(messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .map(|m| {
            // Vocabulary words are one token each; punctuation mostly splits off its own.
            let pieces = match &m.content {
                Some(protocol::openai::MessageContent::Text(t)) => {
                    t.split_whitespace().count()
                        + t.chars().filter(char::is_ascii_punctuation).count()
                }
                _ => 0,
            };
            pieces + 5
        })
        .sum()
}

pub(crate) fn item(session: Option<u64>, messages: Vec<ChatMessage>, max_tokens: u32) -> WorkItem {
    WorkItem {
        approx_tokens: approx_tokens(&messages),
        session,
        messages,
        max_tokens,
    }
}
