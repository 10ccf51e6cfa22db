use super::{is_json_object, EventChecker};

/// What serde_json says, for UTF-8 text: a JSON text whose value is an object.
fn serde_says(b: &[u8]) -> bool {
    std::str::from_utf8(b).is_ok()
        && b.trim_ascii_start().starts_with(b"{")
        && serde_json::from_slice::<serde::de::IgnoredAny>(b).is_ok()
}

const SAMPLES: &[&str] = &[
    r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1733200000,"model":"qwen3","choices":[{"index":0,"delta":{"content":" tok\u00e9n \"q\"\n"},"logprobs":null,"finish_reason":null}]}"#,
    r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":0}}}"#,
    r#" { "a" : [ 1 , -0.5e+3 , 2E-2 , true , false , null , { } , [ ] , "x\/y\\z\b\f\r\t" ] } "#,
    r#"{"text":"漢字🚀 naïve","n":0,"f":-12.25}"#,
    r#"{"error":{"message":"boom","type":"server_error","code":500}}"#,
];

#[test]
fn agrees_with_serde_on_samples_and_their_mutations() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let alphabet = b"{}[]\":,.-+eE0123456789tfnul \\/\n\x01\xc3\xa9ab";
    let mut checked = 0;
    for s in SAMPLES {
        let b = s.as_bytes();
        assert!(is_json_object(b), "{s}");
        for cut in 0..b.len() {
            assert_eq!(
                is_json_object(&b[..cut]),
                serde_says(&b[..cut]),
                "{s} cut at {cut}"
            );
            checked += 1;
        }
        for _ in 0..4000 {
            let mut m = b.to_vec();
            for _ in 0..1 + next() % 3 {
                let at = (next() as usize) % m.len();
                let c = alphabet[(next() as usize) % alphabet.len()];
                match next() % 3 {
                    0 => m[at] = c,
                    1 => m.insert(at, c),
                    _ => {
                        m.remove(at);
                    }
                }
                if m.is_empty() {
                    break;
                }
            }
            assert_eq!(
                is_json_object(&m),
                serde_says(&m),
                "{}",
                String::from_utf8_lossy(&m)
            );
            checked += 1;
        }
    }
    assert!(checked > 20_000);
}

/// A stream's events through one checker: each verdict is serde's, whatever came before
/// (token texts of every kind, then the same events broken inside and outside the text).
#[test]
fn the_event_checker_agrees_with_serde_event_by_event() {
    let texts = [
        " token",
        "s",
        "",
        "\\\"quoted\\\"",
        "tab\\t",
        "\\u00e9",
        "é漢🚀",
        "\\",
        "\\u12",
        "\"",
        "a\u{1}b",
        "\\x",
        "\\u00zz",
        "line\nbreak",
        "\\\\",
        "end\\",
    ];
    let event = |t: &str| {
        format!(
            r#"{{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1733220000,"model":"m","choices":[{{"index":0,"delta":{{"content":"{t}"}},"logprobs":null,"finish_reason":null}}]}}"#
        )
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let alphabet = b"{}[]\":,.-+e0129tfnul \\/\n\x01\xc3\xa9\xe6a";
    let mut checker = EventChecker::default();
    for round in 0..3000 {
        let t = texts[(next() as usize) % texts.len()];
        let mut e = event(t).into_bytes();
        if round % 3 == 0 {
            // Break it somewhere: in the text or anywhere else.
            let at = (next() as usize) % e.len();
            let c = alphabet[(next() as usize) % alphabet.len()];
            match next() % 3 {
                0 => e[at] = c,
                1 => e.insert(at, c),
                _ => {
                    e.remove(at);
                }
            }
        }
        let before = checker.last.clone();
        let got = checker.check(&e);
        assert_eq!(
            got,
            serde_says(&e),
            "{} after {}",
            String::from_utf8_lossy(&e),
            String::from_utf8_lossy(&before)
        );
    }
    // A clean stream: after its first event, every token event takes the short way.
    let valid = [" token", "s", "", "é漢🚀", "\\\"q\\\"", "\\u00e9", "\\\\"];
    let mut fast = 0;
    for i in 0..100 {
        let before = checker.last.clone();
        assert!(checker.check(event(valid[i % valid.len()]).as_bytes()));
        fast += usize::from(checker.last == before);
    }
    assert!(fast >= 98, "{fast} of 100 took the short way");
}

#[test]
fn refuses_what_is_not_one_object() {
    for bad in [
        &b""[..],
        b"[1,2]",
        b"\"s\"",
        b"{\"a\":1}{\"b\":2}",
        b"{\"a\":01}",
        b"{\"a\":1.}",
        b"{\"a\":\"\x01\"}",
        b"{\"a\":\"\\x\"}",
        b"{\"a\":\"\\u12\"}",
        b"{\"a\":\"\xff\"}",
        b"<html>oops</html>",
        b"{\"a\" 1}",
        b"{,}",
        b"{\"a\":1,}",
    ] {
        assert!(!is_json_object(bad), "{}", String::from_utf8_lossy(bad));
    }
    let deep = |n: usize| format!("{{\"a\":{}1{}}}", "[".repeat(n), "]".repeat(n));
    let value_parses = |n: usize| serde_json::from_str::<serde_json::Value>(&deep(n)).is_ok();
    for n in 120..136 {
        assert_eq!(
            is_json_object(deep(n).as_bytes()),
            value_parses(n),
            "{n} deep"
        );
    }
    assert!(
        !is_json_object(deep(100_000).as_bytes()),
        "no stack overflow"
    );
}
