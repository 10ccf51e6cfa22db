//! A batch input file, checked line by line before anything runs: each line is a JSON object
//! `{"custom_id", "method": "POST", "url", "body"}` naming one of the generation endpoints,
//! with a unique `custom_id`, a body that names its model and does not stream. The first
//! problem is a 400 naming its line number (1-based, as an editor shows it); blank lines are
//! skipped.

use protocol::ApiError;
use serde_json::Value;

use crate::batch::store::StoredLine;

/// The endpoints a line may name.
pub const ENDPOINTS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

/// One checked line: its position among the requests, its line number, url and id, and body.
#[derive(Debug, Clone)]
pub struct InputLine {
    pub line_no: usize,
    pub url: String,
    /// The model its body names.
    pub model: String,
    pub stored: StoredLine,
}

fn at(line_no: usize, why: impl std::fmt::Display) -> ApiError {
    ApiError::invalid_request(format!("line {line_no} of the batch file: {why}"))
        .with_code("invalid_batch_line")
}

/// Checks a whole file of at most `max_lines` requests.
pub fn parse(content: &[u8], max_lines: usize) -> Result<Vec<InputLine>, ApiError> {
    let text = std::str::from_utf8(content).map_err(|e| {
        let line_no = content[..e.valid_up_to()]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1;
        at(line_no, "not UTF-8")
    })?;
    // A byte-order mark some editors write is not part of the first line.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut out = Vec::new();
    for (i, raw) in text.split('\n').enumerate() {
        let line_no = i + 1;
        let raw = raw.trim_end_matches('\r');
        if raw.trim().is_empty() {
            continue;
        }
        if out.len() == max_lines {
            return Err(at(
                line_no,
                format!("the file has more than {max_lines} requests (batch.max_lines)"),
            ));
        }
        let v: Value = serde_json::from_str(raw).map_err(|e| at(line_no, format!("{e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| at(line_no, "a line must be a JSON object"))?;
        let custom_id = match obj.get("custom_id") {
            Some(Value::String(s)) if !s.is_empty() && s.len() <= 512 => s.clone(),
            _ => {
                return Err(at(
                    line_no,
                    "`custom_id` must be a string of 1 to 512 characters",
                ))
            }
        };
        if let Some(first) = seen.insert(custom_id.clone(), line_no) {
            return Err(at(
                line_no,
                format!("custom_id {custom_id:?} is used on line {first} too; each must be unique"),
            ));
        }
        match obj.get("method").and_then(Value::as_str) {
            Some("POST") => {}
            _ => {
                let got = obj.get("method").map_or("nothing".into(), Value::to_string);
                return Err(at(line_no, format!("`method` must be \"POST\", got {got}")));
            }
        }
        let url = match obj.get("url").and_then(Value::as_str) {
            Some(u) if ENDPOINTS.contains(&u) => u.to_string(),
            _ => {
                let got = obj.get("url").map_or("nothing".into(), Value::to_string);
                return Err(at(
                    line_no,
                    format!("`url` must be {}, got {got}", ENDPOINTS.join(" or ")),
                ));
            }
        };
        let body = obj
            .get("body")
            .and_then(Value::as_object)
            .ok_or_else(|| at(line_no, "`body` must be a JSON object (the request)"))?;
        let Some(model) = body
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_string)
        else {
            return Err(at(line_no, "the body must name its `model`"));
        };
        if body.get("stream").and_then(Value::as_bool) == Some(true) {
            return Err(at(
                line_no,
                "a batch request cannot stream (`stream`: true)",
            ));
        }
        let body = serde_json::to_vec(body).unwrap_or_default();
        out.push(InputLine {
            line_no,
            url,
            model,
            stored: StoredLine {
                idx: out.len() as i64,
                custom_id,
                body,
            },
        });
    }
    if out.is_empty() {
        return Err(ApiError::invalid_request("the batch file has no requests")
            .with_code("invalid_batch_line"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(id: &str) -> String {
        format!(
            r#"{{"custom_id":"{id}","method":"POST","url":"/v1/chat/completions","body":{{"model":"m","messages":[]}}}}"#
        )
    }

    fn message(content: &str, max: usize) -> String {
        parse(content.as_bytes(), max)
            .unwrap_err()
            .body
            .error
            .message
    }

    #[test]
    fn good_lines_are_numbered_and_blank_ones_skipped() {
        let text = format!("{}\n\n{}\r\n", line("a"), line("b"));
        let lines = parse(text.as_bytes(), 10).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!((lines[1].line_no, lines[1].stored.idx), (3, 1));
        assert_eq!(lines[1].stored.custom_id, "b");
        assert_eq!(lines[0].url, "/v1/chat/completions");
        assert_eq!(lines[0].model, "m");
        let bom = format!("\u{feff}{}", line("a"));
        assert_eq!(parse(bom.as_bytes(), 10).unwrap().len(), 1);
    }

    #[test]
    fn each_problem_names_its_line() {
        let cases = [
            (
                format!("{}\n{{oops", line("a")),
                "line 2",
                "key must be a string",
            ),
            (
                format!("{}\n{}", line("a"), line("a")),
                "line 2",
                "line 1 too",
            ),
            (
                line("a").replace("\"POST\"", "\"GET\""),
                "line 1",
                "`method`",
            ),
            (
                line("a").replace("/v1/chat/completions", "/v1/embeddings"),
                "line 1",
                "`url`",
            ),
            (line("a").replace("\"model\":\"m\",", ""), "line 1", "model"),
            (
                line("a").replace("\"model\":\"m\"", "\"model\":\"m\",\"stream\":true"),
                "line 1",
                "cannot stream",
            ),
            ("[1]".to_string(), "line 1", "JSON object"),
        ];
        for (text, where_, what) in cases {
            let m = message(&text, 10);
            assert!(m.contains(where_) && m.contains(what), "{m}");
            assert!(!m.contains("Some("), "no Rust in messages: {m}");
        }
        let many = format!("{}\n{}\n{}", line("a"), line("b"), line("c"));
        assert!(message(&many, 2).contains("line 3"));
        assert!(message("\n\n", 2).contains("no requests"));
        assert!(message("{\"a\":\"\u{e9}\"}\n\u{0}", 2).contains("line 1"));
    }

    #[test]
    fn invalid_utf8_is_placed() {
        let mut bytes = format!("{}\n", line("a")).into_bytes();
        bytes.extend_from_slice(b"{\"x\":\"\xff\"}");
        let m = parse(&bytes, 5).unwrap_err().body.error.message;
        assert!(m.contains("line 2") && m.contains("UTF-8"), "{m}");
    }
}
