//! `multipart/form-data` (RFC 7578) over a buffered body, as `POST /v1/files` receives it:
//! the openai SDKs send a `purpose` field and a `file` part with a filename. Parts are
//! slices of the body (no copy); a body that does not parse is a 400 saying where.

use bytes::Bytes;
use memchr::memmem;
use protocol::ApiError;

/// One part: its form field name, the filename when it is a file, its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub data: Bytes,
}

fn bad(why: impl Into<String>) -> ApiError {
    ApiError::invalid_request(format!("malformed multipart body: {}", why.into()))
        .with_code("invalid_multipart")
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Result<String, ApiError> {
    let mut params = content_type.split(';');
    let kind = params.next().unwrap_or("").trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return Err(ApiError::invalid_request(format!(
            "expected a multipart/form-data upload (fields `purpose` and `file`), got content type {kind:?}"
        ))
        .with_code("invalid_content_type"));
    }
    params
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
        .filter(|b| !b.is_empty() && b.len() <= 70)
        .ok_or_else(|| bad("the content type names no boundary"))
}

/// A `Content-Disposition` parameter's value (`name="x"`, quoted or not).
fn param(disposition: &str, key: &str) -> Option<String> {
    disposition.split(';').skip(1).find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case(key)
            .then(|| v.trim().trim_matches('"').replace("\\\"", "\""))
    })
}

/// Splits `body` into its parts.
pub fn parse(body: &Bytes, boundary: &str) -> Result<Vec<Part>, ApiError> {
    let opening = format!("--{boundary}");
    let delimiter = format!("\r\n--{boundary}");
    let finder = memmem::Finder::new(delimiter.as_bytes());
    // The first delimiter may open the body (no preamble) or follow a preamble.
    let mut pos = if body.starts_with(opening.as_bytes()) {
        opening.len()
    } else {
        finder
            .find(body)
            .map(|i| i + delimiter.len())
            .ok_or_else(|| bad(format!("boundary {boundary:?} not found")))?
    };
    let mut parts = Vec::new();
    loop {
        let rest = &body[pos..];
        if rest.starts_with(b"--") {
            return Ok(parts);
        }
        if !rest.starts_with(b"\r\n") {
            return Err(bad("a boundary line is not followed by CRLF"));
        }
        let start = pos + 2;
        let head_len = memmem::find(&body[start..], b"\r\n\r\n")
            .ok_or_else(|| bad("a part's headers do not end"))?;
        let head = std::str::from_utf8(&body[start..start + head_len])
            .map_err(|_| bad("a part's headers are not UTF-8"))?;
        let data_start = start + head_len + 4;
        let data_len = finder
            .find(&body[data_start..])
            .ok_or_else(|| bad("the last part is not closed by its boundary"))?;
        let disposition = head
            .split("\r\n")
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-disposition"))
            .map(|(_, v)| v.trim())
            .ok_or_else(|| bad("a part has no Content-Disposition"))?;
        let name = param(disposition, "name").ok_or_else(|| bad("a part has no name"))?;
        parts.push(Part {
            name,
            filename: param(disposition, "filename"),
            data: body.slice(data_start..data_start + data_len),
        });
        pos = data_start + data_len + delimiter.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SDK_BODY: &[u8] = b"--abc123\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--abc123\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n{\"a\":1}\n{\"b\":\"\r\n--x\"}\n\r\n--abc123--\r\n";

    #[test]
    fn parses_what_the_openai_sdk_sends() {
        let b = boundary("multipart/form-data; boundary=abc123").unwrap();
        let parts = parse(&Bytes::from_static(SDK_BODY), &b).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "purpose");
        assert_eq!(&parts[0].data[..], b"batch");
        assert_eq!(parts[1].filename.as_deref(), Some("in.jsonl"));
        // Bytes that look like a delimiter of another boundary are data.
        assert_eq!(&parts[1].data[..], b"{\"a\":1}\n{\"b\":\"\r\n--x\"}\n");
    }

    #[test]
    fn quoted_boundaries_and_preambles_are_accepted() {
        let b = boundary("multipart/form-data; charset=utf-8; boundary=\"abc123\"").unwrap();
        let mut body = b"preamble\r\n".to_vec();
        body.extend_from_slice(SDK_BODY);
        assert_eq!(parse(&Bytes::from(body), &b).unwrap().len(), 2);
    }

    #[test]
    fn malformed_bodies_are_refused_with_a_reason() {
        assert!(boundary("application/json").is_err());
        assert!(boundary("multipart/form-data").is_err());
        let cut = &SDK_BODY[..SDK_BODY.len() - 14];
        let e = parse(&Bytes::copy_from_slice(cut), "abc123").unwrap_err();
        assert!(
            e.body.error.message.contains("not closed"),
            "{}",
            e.body.error.message
        );
        let e = parse(&Bytes::from_static(b"hello"), "abc123").unwrap_err();
        assert!(
            e.body.error.message.contains("not found"),
            "{}",
            e.body.error.message
        );
    }
}
