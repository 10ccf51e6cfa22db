//! 10,000 mutated policy files (lines dropped, duplicated or cut, values replaced by other
//! types, bytes flipped): parsing never panics, and every accepted file classifies any request
//! into a route (the invariants validation promises). Seeded.

use config::routes::DEFAULT_POLICY;
use config::{PolicyFile, Priority};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const VALUES: &[&str] = &[
    "0",
    "-1",
    "1e308",
    "nan",
    "inf",
    "\"\"",
    "\"batch\"",
    "\"urgent\"",
    "true",
    "[]",
    "[1, \"x\"]",
    "{}",
    "{ ttft_ms = 0 }",
    "18446744073709551616",
    "\"prefix_aware\"",
    "\"consistent_hash\"",
    "\"127.0.0.1:8001\"",
    "\"exact\"",
    "\"off\"",
    "[[\"a\", \"b\"]]",
];

fn mutate(r: &mut Rng, text: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for _ in 0..1 + r.below(4) {
        if lines.is_empty() {
            break;
        }
        let i = r.below(lines.len() as u64) as usize;
        match r.below(6) {
            0 => {
                lines.remove(i);
            }
            1 => {
                let l = lines[i].clone();
                lines.insert(i, l);
            }
            2 => {
                if let Some((k, _)) = lines[i].split_once('=') {
                    let v = VALUES[r.below(VALUES.len() as u64) as usize];
                    lines[i] = format!("{k}= {v}");
                }
            }
            3 => lines.truncate(i),
            4 => {
                let l = &mut lines[i];
                if !l.is_empty() {
                    let at = r.below(l.len() as u64) as usize;
                    let mut b = std::mem::take(l).into_bytes();
                    b[at] = r.next() as u8;
                    *l = String::from_utf8_lossy(&b).into_owned();
                }
            }
            _ => lines.insert(i, "[[routes]]\nname = \"extra\"".into()),
        }
    }
    lines.join("\n")
}

#[test]
fn ten_thousand_mutated_policy_files_never_panic() {
    let replicas: Vec<String> = (1..=4).map(|i| format!("127.0.0.1:800{i}")).collect();
    let mut r = Rng(0x5eed_1234_abcd_ef01);
    let (mut accepted, mut refused) = (0, 0);
    for case in 0..10_000 {
        let text = mutate(&mut r, DEFAULT_POLICY);
        let parsed = std::panic::catch_unwind(|| PolicyFile::from_toml(&text, &replicas));
        match parsed {
            Err(_) => panic!("case {case} panicked:\n{text}"),
            Ok(Err(e)) => {
                refused += 1;
                assert!(!e.to_string().is_empty());
            }
            Ok(Ok(f)) => {
                accepted += 1;
                for tokens in [0, 1, 8191, 8192, 1 << 20] {
                    for p in [Priority::Interactive, Priority::Batch] {
                        let i = f.classify(tokens, p);
                        assert!(i < f.routes.len(), "case {case}");
                        assert!(!f.pool(i, &replicas).is_empty(), "case {case}");
                    }
                }
            }
        }
    }
    eprintln!("{accepted} accepted, {refused} refused");
    assert!(accepted > 1000 && refused > 1000);
}
