//! Seeded workloads with the shapes real traffic has. Text comes from a built-in vocabulary of
//! common English words (each one token in the Llama-3 and Qwen3 vocabularies, so word counts
//! track token counts closely; callers with a tokenizer measure exact counts).
//!
//! - `chat`: multi-turn sessions over a few shared system prompts; every turn resends the whole
//!   history plus a new user message, so each request extends the previous one's prefix, and
//!   sessions interleave. Assistant turns in the history are synthetic text of a typical reply
//!   length (an open-loop generator cannot wait for the real answer). Final conversations
//!   average about 2,300 tokens.
//! - `agent`: a few long shared system prompts with tool schemas and many short questions.
//! - `rag`: long unique contexts with a short question each: little reuse.
//! - `mixed_tail`: `chat` plus a small share of 32k-token prompts (the prompt-length tail).
//! - `bursty`: popular long system prompts arriving in clusters (`bursty.rs`; it brings its
//!   own arrival process).
//! - `apps`: the tail-heavy shape of issue 28 — 16 applications whose system prompts run from
//!   about 1k to 6k tokens, Zipf-popular (the first draws ~30% of sessions), each session of 2
//!   to 10 turns resending its history; a popular application's long prompt is what one
//!   replica must not hoard.

use crate::arrival::Rng;
use protocol::openai::ChatMessage;

#[cfg(test)]
use crate::words::approx_tokens;
pub use crate::words::WorkItem;
pub(crate) use crate::words::{item, text};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Agent,
    Rag,
    MixedTail,
    Bursty,
    Apps,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Agent => "agent",
            Kind::Rag => "rag",
            Kind::MixedTail => "mixed-tail",
            Kind::Bursty => "bursty",
            Kind::Apps => "apps",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "chat" => Some(Kind::Chat),
            "agent" => Some(Kind::Agent),
            "rag" => Some(Kind::Rag),
            "mixed-tail" | "mixed_tail" => Some(Kind::MixedTail),
            "bursty" => Some(Kind::Bursty),
            "apps" => Some(Kind::Apps),
            _ => None,
        }
    }
}

/// Log-normal word count around `median`, clamped to `[lo, hi]`.
fn length(rng: &mut Rng, median: f64, sigma: f64, lo: usize, hi: usize) -> usize {
    ((median * (sigma * rng.normal()).exp()) as usize).clamp(lo, hi)
}

/// `n` requests of workload `kind`, reproducible from `seed`.
pub fn generate(kind: Kind, n: usize, seed: u64) -> Vec<WorkItem> {
    let mut rng = Rng::new(seed);
    match kind {
        Kind::Chat => chat(&mut rng, n),
        Kind::Agent => agent(&mut rng, n),
        Kind::Apps => apps(&mut rng, n),
        // The items of a bursty plan at 5 requests/s (their arrival times are part of the
        // workload: `bursty::plan`).
        Kind::Bursty => crate::bursty::plan(5.0, std::time::Duration::MAX, n, seed).1,
        Kind::Rag => (0..n)
            .map(|i| {
                let words = length(&mut rng, 3000.0, 0.4, 800, 12_000);
                let ctx = text(&mut rng, words);
                let q = text(&mut rng, 20);
                item(
                    Some(i as u64),
                    vec![ChatMessage::new(
                        "user",
                        &format!("Context:\n{ctx}\n\nQuestion: {q}?"),
                    )],
                    128,
                )
            })
            .collect(),
        Kind::MixedTail => {
            let mut out = chat(&mut rng, n);
            for (i, w) in out.iter_mut().enumerate() {
                // 2% of requests carry a 32k-token document.
                if rng.below(100) < 2 {
                    let doc = text(&mut rng, 32_000);
                    *w = item(
                        Some(1_000_000 + i as u64),
                        vec![ChatMessage::new("user", &format!("Summarise:\n{doc}"))],
                        256,
                    );
                }
            }
            out
        }
    }
}

/// Sessions interleave: each step picks a random live session and sends its next turn.
fn chat(rng: &mut Rng, n: usize) -> Vec<WorkItem> {
    let systems: Vec<String> = (0..4).map(|_| text(rng, 120)).collect();
    struct Session {
        id: u64,
        history: Vec<ChatMessage>,
        turns_left: usize,
    }
    let mut live: Vec<Session> = Vec::new();
    let mut next_id = 0u64;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        if live.len() < 16 {
            let sys = &systems[rng.below(systems.len() as u64) as usize];
            live.push(Session {
                id: next_id,
                history: vec![ChatMessage::new("system", sys)],
                // 3 to 9 turns (mean 6): with ~125-word questions and ~270-word replies
                // (log-normal means) the last turn of an average session carries ~2,300 tokens.
                turns_left: 3 + rng.below(7) as usize,
            });
            next_id += 1;
        }
        let k = rng.below(live.len() as u64) as usize;
        let s = &mut live[k];
        let words = length(rng, 110.0, 0.5, 10, 1_000);
        let question = text(rng, words);
        s.history.push(ChatMessage::new("user", &question));
        out.push(item(Some(s.id), s.history.clone(), 256));
        let words = length(rng, 250.0, 0.4, 20, 1_500);
        let reply = text(rng, words);
        s.history.push(ChatMessage::new("assistant", &reply));
        s.turns_left -= 1;
        if s.turns_left == 0 {
            live.swap_remove(k);
        }
    }
    out
}

/// 16 applications (system prompts of 1k–6k words), chosen Zipf-wise for each new session;
/// sessions of 2–10 turns interleave, every turn resending the history.
fn apps(rng: &mut Rng, n: usize) -> Vec<WorkItem> {
    let systems: Vec<String> = (0..16)
        .map(|_| {
            let words = 1_000 + rng.below(5_001) as usize;
            text(rng, words)
        })
        .collect();
    // Zipf with s = 1: application k is chosen with weight 1 / (k + 1).
    let weights: Vec<f64> = (0..systems.len()).map(|k| 1.0 / (k as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    struct Session {
        id: u64,
        history: Vec<ChatMessage>,
        turns_left: usize,
    }
    let mut live: Vec<Session> = Vec::new();
    let mut next_id = 0u64;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        while live.len() < 24 {
            let mut pick = rng.below(1_000_000) as f64 / 1_000_000.0 * total;
            let mut app = 0;
            while app + 1 < weights.len() && pick >= weights[app] {
                pick -= weights[app];
                app += 1;
            }
            live.push(Session {
                id: next_id,
                history: vec![ChatMessage::new("system", &systems[app])],
                turns_left: 2 + rng.below(9) as usize,
            });
            next_id += 1;
        }
        let k = rng.below(live.len() as u64) as usize;
        let s = &mut live[k];
        let words = length(rng, 60.0, 0.5, 5, 600);
        s.history.push(ChatMessage::new("user", &text(rng, words)));
        out.push(item(Some(s.id), s.history.clone(), 128));
        let words = length(rng, 150.0, 0.4, 20, 800);
        s.history
            .push(ChatMessage::new("assistant", &text(rng, words)));
        s.turns_left -= 1;
        if s.turns_left == 0 {
            live.swap_remove(k);
        }
    }
    out
}

fn agent(rng: &mut Rng, n: usize) -> Vec<WorkItem> {
    let systems: Vec<String> = (0..3)
        .map(|a| {
            let tools: Vec<String> = (0..12)
                .map(|t| {
                    format!(
                        "{{\"name\": \"tool_{a}_{t}\", \"description\": \"{}\", \"parameters\": {{\"query\": \"string\"}}}}",
                        text(rng, 40)
                    )
                })
                .collect();
            format!("You are agent {a}. Tools:\n{}\n{}", tools.join("\n"), text(rng, 300))
        })
        .collect();
    (0..n)
        .map(|i| {
            let sys = &systems[rng.below(systems.len() as u64) as usize];
            let words = length(rng, 25.0, 0.4, 5, 200);
            let q = text(rng, words);
            item(
                Some(i as u64),
                vec![
                    ChatMessage::new("system", sys),
                    ChatMessage::new("user", &q),
                ],
                128,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean(v: impl Iterator<Item = usize>) -> f64 {
        let v: Vec<usize> = v.collect();
        v.iter().sum::<usize>() as f64 / v.len() as f64
    }

    #[test]
    fn chat_turns_extend_their_session_and_sessions_interleave() {
        let w = generate(Kind::Chat, 2_000, 11);
        assert_eq!(w, generate(Kind::Chat, 2_000, 11), "seeded");
        let mut last: std::collections::HashMap<u64, Vec<ChatMessage>> = Default::default();
        let mut switches = 0;
        for pair in w.windows(2) {
            switches += usize::from(pair[0].session != pair[1].session);
        }
        for r in &w {
            let s = r.session.unwrap();
            if let Some(prev) = last.get(&s) {
                // The new request's history starts with the previous request's messages.
                assert!(r.messages.len() > prev.len());
                assert_eq!(&r.messages[..prev.len()], &prev[..]);
            }
            last.insert(s, r.messages.clone());
        }
        assert!(
            switches > 1_000,
            "sessions interleave ({switches} switches)"
        );
        // Conversations average about 2,300 tokens at their last turn.
        let finals = mean(last.values().map(|m| approx_tokens(m)));
        assert!((1_900.0..2_700.0).contains(&finals), "{finals}");
    }

    #[test]
    fn agent_shares_long_prefixes_and_rag_does_not() {
        let a = generate(Kind::Agent, 300, 3);
        let systems: std::collections::HashSet<String> = a
            .iter()
            .map(|r| match &r.messages[0].content {
                Some(protocol::openai::MessageContent::Text(t)) => t.clone(),
                _ => String::new(),
            })
            .collect();
        assert_eq!(systems.len(), 3);
        assert!(mean(a.iter().map(|r| r.approx_tokens)) > 700.0);
        let r = generate(Kind::Rag, 100, 3);
        let firsts: std::collections::HashSet<String> = r
            .iter()
            .map(|x| match &x.messages[0].content {
                Some(protocol::openai::MessageContent::Text(t)) => t[..60].to_string(),
                _ => String::new(),
            })
            .collect();
        assert!(firsts.len() > 95, "rag contexts are unique");
    }

    #[test]
    fn apps_have_long_zipf_popular_system_prompts_and_multi_turn_sessions() {
        let w = generate(Kind::Apps, 3_000, 7);
        assert_eq!(w, generate(Kind::Apps, 3_000, 7), "seeded");
        let system = |r: &WorkItem| match &r.messages[0].content {
            Some(protocol::openai::MessageContent::Text(t)) => t.clone(),
            _ => String::new(),
        };
        let mut by_app: std::collections::HashMap<String, usize> = Default::default();
        for r in &w {
            *by_app.entry(system(r)).or_default() += 1;
        }
        assert!(
            by_app.len() >= 12,
            "most of the 16 applications appear: {}",
            by_app.len()
        );
        let top = *by_app.values().max().unwrap() as f64 / w.len() as f64;
        assert!((0.2..0.5).contains(&top), "the most popular draws {top:.2}");
        let words = |t: &str| t.split_whitespace().count();
        assert!(by_app.keys().all(|t| (1_000..=6_000).contains(&words(t))));
        let sessions: std::collections::HashSet<u64> = w.iter().filter_map(|r| r.session).collect();
        let turns = w.len() as f64 / sessions.len() as f64;
        assert!((4.0..8.0).contains(&turns), "{turns} turns a session");
    }

    #[test]
    fn mixed_tail_adds_a_small_share_of_32k_prompts() {
        let w = generate(Kind::MixedTail, 5_000, 5);
        let long = w.iter().filter(|r| r.approx_tokens > 30_000).count();
        let share = long as f64 / w.len() as f64;
        assert!((0.01..0.03).contains(&share), "{share}");
    }
}
