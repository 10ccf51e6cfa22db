//! Bearer tokens, shared by the gateway (admin token, client API keys) and the replica (the
//! fleet token that guards its internal endpoints): parsing `Authorization: Bearer …`,
//! comparing in constant time, and the 401 every refusal answers with.

use http::HeaderMap;

use crate::ApiError;

/// The token of an `Authorization: Bearer …` header.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Equality that takes the same time wherever the strings differ.
pub fn constant_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// 401 with the OpenAI error body.
pub fn unauthorized(message: &str, code: &str) -> ApiError {
    ApiError::new(401, "invalid_request_error", message).with_code(code)
}

/// Checks a request against an optional bearer token.
pub fn check_bearer(headers: &HeaderMap, token: Option<&str>) -> Result<(), ApiError> {
    let Some(want) = token else { return Ok(()) };
    match bearer(headers) {
        Some(got) if constant_eq(got, want) => Ok(()),
        Some(_) => Err(unauthorized(
            "the bearer token is not valid",
            "invalid_token",
        )),
        None => Err(unauthorized(
            "this endpoint needs `Authorization: Bearer <token>`",
            "missing_token",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, auth.parse().unwrap());
        h
    }

    #[test]
    fn bearer_tokens_are_checked_exactly() {
        let t = Some("s3cret-token-0123456789");
        assert!(check_bearer(&headers("Bearer s3cret-token-0123456789"), t).is_ok());
        assert!(check_bearer(&headers("bearer s3cret-token-0123456789"), t).is_ok());
        assert_eq!(
            check_bearer(&headers("Bearer bogus"), t)
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(check_bearer(&HeaderMap::new(), t).unwrap_err().status, 401);
        assert!(check_bearer(&HeaderMap::new(), None).is_ok());
        assert!(!constant_eq("abc", "abcd"));
        assert!(constant_eq("abc", "abc"));
    }
}
