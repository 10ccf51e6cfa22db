//! Whether bytes are one JSON object, checked on the relay's hot path: every streamed event of
//! every answer goes through here (issue 27: a replica that sends garbage is caught and counted
//! before a client's SDK chokes on it). The check accepts exactly what `serde_json` accepts as
//! a JSON text whose value is an object — same grammar, control characters refused inside
//! strings, and the nesting limit (127 levels) serde_json puts on building a `Value` — and
//! refuses text that is not UTF-8 too. It builds nothing.
//!
//! A stream's token events differ from one another only inside one string (the token's text),
//! so [`EventChecker`] checks the first events in full and then, for an event that equals the
//! last fully checked one but inside one of its strings, only that string: the rest is the same
//! bytes, already valid, and a valid string swapped for a valid string leaves valid JSON. Every
//! event is still checked completely; a token event costs two `memcmp`s and its text (see
//! BENCHMARKS, `sse_relay`).

/// Deepest nesting accepted (serde_json's recursion limit when it builds a `Value`).
const MAX_DEPTH: usize = 127;

/// Whether `bytes`, less surrounding JSON whitespace, is one valid JSON object.
pub fn is_json_object(bytes: &[u8]) -> bool {
    scan_object(bytes, None)
}

fn scan_object(bytes: &[u8], spans: Option<&mut Vec<(usize, usize)>>) -> bool {
    if std::str::from_utf8(bytes).is_err() {
        return false;
    }
    let mut s = Scanner {
        b: bytes,
        i: 0,
        spans,
    };
    s.ws();
    if s.peek() != Some(b'{') || !s.value(0) {
        return false;
    }
    s.ws();
    s.i == bytes.len()
}

/// Checks a stream's events one by one, each completely, reusing what the last full check
/// learnt (see the module docs).
#[derive(Debug, Default)]
pub struct EventChecker {
    /// The last event checked in full, and the content spans (after the opening quote, at the
    /// closing quote) of its strings, in order.
    last: Vec<u8>,
    spans: Vec<(usize, usize)>,
}

impl EventChecker {
    /// Whether `payload` is one valid JSON object.
    pub fn check(&mut self, payload: &[u8]) -> bool {
        if !self.last.is_empty() && self.same_but_one_string(payload) {
            return true;
        }
        self.spans.clear();
        if !scan_object(payload, Some(&mut self.spans)) {
            // The spans are now those of a broken event: nothing to compare the next one with.
            self.last.clear();
            return false;
        }
        self.last.clear();
        self.last.extend_from_slice(payload);
        true
    }

    /// Whether `c` is the last full event with one string's content replaced by a valid one.
    fn same_but_one_string(&self, c: &[u8]) -> bool {
        let p = &self.last[..];
        let pre = common_prefix(p, c);
        if pre == p.len() && pre == c.len() {
            return true;
        }
        let suf = common_suffix(&p[pre..], &c[pre.min(c.len())..]);
        let changed_end = p.len() - suf; // in `p`: the changed bytes are p[pre..changed_end]
                                         // The string whose content holds the whole change (spans are sorted and disjoint).
        let at = self.spans.partition_point(|&(start, _)| start <= pre);
        let Some(&(start, end)) = at.checked_sub(1).and_then(|k| self.spans.get(k)) else {
            return false;
        };
        if changed_end > end {
            return false;
        }
        // In `c` that string's content runs from `start` to its closing quote at `end` moved
        // by the length difference; it must be valid content ending exactly there.
        let c_end = end + c.len() - p.len();
        std::str::from_utf8(&c[start..c_end]).is_ok() && string_content(&c[start..c_end])
    }
}

/// Whether `s` is the whole content of a JSON string (between its quotes): no bare quote, no
/// control character, every escape complete and inside it.
fn string_content(s: &[u8]) -> bool {
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'"' | 0..=0x1f => return false,
            b'\\' => match s.get(i + 1) {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                Some(b'u') => {
                    if !s
                        .get(i + 2..i + 6)
                        .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
                    {
                        return false;
                    }
                    i += 6;
                }
                _ => return false,
            },
            _ => i += 1,
        }
    }
    true
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        let x = u64::from_le_bytes(a[i..i + 8].try_into().unwrap())
            ^ u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if x != 0 {
            return i + (x.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[a.len() - n..], &b[b.len() - n..]);
    let mut k = 0; // bytes matched from the end
    while k + 8 <= n {
        let x = u64::from_be_bytes(a[n - k - 8..n - k].try_into().unwrap())
            ^ u64::from_be_bytes(b[n - k - 8..n - k].try_into().unwrap());
        if x != 0 {
            return k + (x.trailing_zeros() / 8) as usize;
        }
        k += 8;
    }
    while k < n && a[n - k - 1] == b[n - k - 1] {
        k += 1;
    }
    k
}

struct Scanner<'a, 's> {
    b: &'a [u8],
    i: usize,
    spans: Option<&'s mut Vec<(usize, usize)>>,
}

impl Scanner<'_, '_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn value(&mut self, depth: usize) -> bool {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => false,
        }
    }

    fn object(&mut self, depth: usize) -> bool {
        if depth > MAX_DEPTH {
            return false;
        }
        self.i += 1;
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return true;
        }
        loop {
            if self.peek() != Some(b'"') || !self.string() {
                return false;
            }
            self.ws();
            if self.peek() != Some(b':') {
                return false;
            }
            self.i += 1;
            self.ws();
            if !self.value(depth) {
                return false;
            }
            if let Some(done) = self.after_item(b'}') {
                return done;
            }
        }
    }

    /// After an object member or array element: `,` goes on to the next (`None`), `close`
    /// ends the container (`Some(true)`), anything else is not JSON (`Some(false)`).
    fn after_item(&mut self, close: u8) -> Option<bool> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.i += 1;
                self.ws();
                None
            }
            Some(c) if c == close => {
                self.i += 1;
                Some(true)
            }
            _ => Some(false),
        }
    }

    fn array(&mut self, depth: usize) -> bool {
        if depth > MAX_DEPTH {
            return false;
        }
        self.i += 1;
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return true;
        }
        loop {
            if !self.value(depth) {
                return false;
            }
            if let Some(done) = self.after_item(b']') {
                return done;
            }
        }
    }

    /// A string from its opening quote; its content span is recorded when asked.
    fn string(&mut self) -> bool {
        let start = self.i + 1;
        let mut i = start;
        loop {
            match self.b.get(i) {
                None | Some(0..=0x1f) => return false,
                Some(b'"') => break,
                Some(b'\\') => match self.b.get(i + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 2,
                    Some(b'u') => {
                        if !self
                            .b
                            .get(i + 2..i + 6)
                            .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
                        {
                            return false;
                        }
                        i += 6;
                    }
                    _ => return false,
                },
                Some(_) => i += 1,
            }
        }
        if let Some(spans) = self.spans.as_deref_mut() {
            spans.push((start, i));
        }
        self.i = i + 1;
        true
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        if self.b[self.i..].starts_with(word) {
            self.i += word.len();
            true
        } else {
            false
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        self.i - start
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
    fn number(&mut self) -> bool {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return false,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return false;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests;
