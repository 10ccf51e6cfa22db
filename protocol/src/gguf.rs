//! The GGUF container: header, metadata and tensor table (llama.cpp's model file format,
//! version 2 and 3). Only the header is read here — a few megabytes at most, even for large
//! vocabularies — so the gateway can take its tokenizer from the same file the engine serves;
//! the engine memory-maps the tensor data itself, at the offsets recorded here.
//!
//! A malformed file is an error that names the file, the key or tensor, and what was expected:
//! every count and length is checked against the bytes the file actually has before anything
//! is allocated for it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("{path} is not a GGUF file (it starts with {found:?}, not \"GGUF\")")]
    NotGguf { path: PathBuf, found: String },
    #[error("{path}: GGUF version {version} is not supported (2 and 3 are)")]
    Version { path: PathBuf, version: u32 },
    #[error("{path} is truncated or corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{path}: metadata key `{key}` is missing")]
    MissingKey { path: PathBuf, key: String },
    #[error("{path}: metadata key `{key}` should be {expected}")]
    KeyType {
        path: PathBuf,
        key: String,
        expected: &'static str,
    },
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        Some(match *self {
            Value::U8(v) => v as u64,
            Value::U16(v) => v as u64,
            Value::U32(v) => v as u64,
            Value::U64(v) => v,
            Value::I8(v) if v >= 0 => v as u64,
            Value::I16(v) if v >= 0 => v as u64,
            Value::I32(v) if v >= 0 => v as u64,
            Value::I64(v) if v >= 0 => v as u64,
            _ => return None,
        })
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// GGML tensor type ids as GGUF stores them.
pub mod ggml_type {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q4_1: u32 = 3;
    pub const Q8_0: u32 = 8;
    pub const Q4_K: u32 = 12;
    pub const Q6_K: u32 = 14;
    pub const BF16: u32 = 30;

    /// The type's name, for messages.
    pub fn name(t: u32) -> &'static str {
        match t {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16..=23 => "IQ (importance-quantised)",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            _ => "unknown",
        }
    }

    /// (values per block, bytes per block) for the types kvgate reads.
    pub fn block(t: u32) -> Option<(u64, u64)> {
        match t {
            F32 => Some((1, 4)),
            F16 | BF16 => Some((1, 2)),
            Q4_0 => Some((32, 18)),
            Q4_1 => Some((32, 20)),
            Q8_0 => Some((32, 34)),
            Q4_K => Some((256, 144)),
            Q6_K => Some((256, 210)),
            _ => None,
        }
    }
}

/// One tensor of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the length of a row (the fastest-varying dimension).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Absolute offset of the tensor's data in the file.
    pub offset: u64,
    /// Bytes of data, when the type is one kvgate reads.
    pub bytes: Option<u64>,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A GGUF file's header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Where tensor data starts.
    pub data_offset: u64,
    pub file_len: u64,
}

struct Reader<R> {
    inner: R,
    pos: u64,
    len: u64,
    path: PathBuf,
}

impl<R: Read> Reader<R> {
    fn corrupt(&self, what: impl Into<String>) -> GgufError {
        GgufError::Corrupt {
            path: self.path.clone(),
            what: format!("{} (at byte {})", what.into(), self.pos),
        }
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, GgufError> {
        if n > self.len.saturating_sub(self.pos) {
            return Err(self.corrupt(format!(
                "{what} needs {n} bytes but the file has {} left",
                self.len.saturating_sub(self.pos)
            )));
        }
        let mut buf = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| self.corrupt(format!("reading {what}: {e}")))?;
        self.pos += n;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let v = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b).map_err(|_| self.corrupt(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, t: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match t {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => Value::Bool(self.array::<1>(key)?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 if depth == 0 => {
                let et = self.u32(key)?;
                let n = self.u64(key)?;
                // Every element takes at least one byte: a count beyond the file is corrupt.
                if n > self.len.saturating_sub(self.pos) {
                    return Err(self.corrupt(format!(
                        "metadata `{key}` claims {n} elements, more than the file holds"
                    )));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(et, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            other => {
                return Err(self.corrupt(format!(
                    "metadata `{key}` has value type {other}, which GGUF does not define"
                )))
            }
        })
    }
}

impl GgufHeader {
    /// Reads the header of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |e: std::io::Error| GgufError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Self::read(BufReader::with_capacity(1 << 20, file), len, path)
    }

    /// Reads a header from `reader`, which holds `len` bytes in all.
    pub fn read(reader: impl Read, len: u64, path: &Path) -> Result<Self, GgufError> {
        let mut r = Reader {
            inner: reader,
            pos: 0,
            len,
            path: path.to_path_buf(),
        };
        if len < 4 {
            return Err(GgufError::Corrupt {
                path: path.to_path_buf(),
                what: format!("the file holds {len} bytes, too few for any GGUF header"),
            });
        }
        let magic: [u8; 4] = r.array("the magic number")?;
        if &magic != MAGIC {
            return Err(GgufError::NotGguf {
                path: path.to_path_buf(),
                found: String::from_utf8_lossy(&magic).into_owned(),
            });
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version {
                path: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let t = r.u32(&key)?;
            let v = r.value(t, &key, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::new();
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor name #{i}"))?;
            let nd = r.u32(&name)?;
            if nd == 0 || nd > 4 {
                return Err(r.corrupt(format!("tensor `{name}` has {nd} dimensions (1 to 4)")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(r.u64(&name)?);
            }
            let ggml_type = r.u32(&name)?;
            let offset = r.u64(&name)?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                bytes: None,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::KeyType {
                        path: path.to_path_buf(),
                        key: "general.alignment".into(),
                        expected: "a power of two",
                    })
                }
            },
        };
        let data_offset = r.pos.div_ceil(alignment) * alignment;
        for t in &mut tensors {
            t.offset = data_offset
                .checked_add(t.offset)
                .ok_or_else(|| GgufError::Corrupt {
                    path: path.to_path_buf(),
                    what: format!("tensor `{}` has an impossible offset", t.name),
                })?;
            if let Some((per, bytes)) = ggml_type::block(t.ggml_type) {
                let elements = t
                    .dims
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d))
                    .unwrap_or(u64::MAX);
                if t.dims[0] % per != 0 {
                    return Err(GgufError::Corrupt {
                        path: path.to_path_buf(),
                        what: format!(
                            "tensor `{}` rows of {} values are not whole {}-value {} blocks",
                            t.name,
                            t.dims[0],
                            per,
                            ggml_type::name(t.ggml_type)
                        ),
                    });
                }
                let size = elements / per * bytes;
                if t.offset.saturating_add(size) > len {
                    return Err(GgufError::Corrupt {
                        path: path.to_path_buf(),
                        what: format!(
                            "tensor `{}` ({} bytes at {}) runs past the end of the file ({len} bytes)",
                            t.name, size, t.offset
                        ),
                    });
                }
                t.bytes = Some(size);
            }
        }
        Ok(GgufHeader {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data_offset,
            file_len: len,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        })
    }

    fn typed<T>(
        &self,
        key: &str,
        expected: &'static str,
        f: impl Fn(&Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        f(self.require(key)?).ok_or_else(|| GgufError::KeyType {
            path: self.path.clone(),
            key: key.into(),
            expected,
        })
    }

    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "an unsigned integer", Value::as_u64)
    }

    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        self.typed(key, "a number", Value::as_f64)
    }

    fn wrong(&self, key: &str, expected: &'static str) -> GgufError {
        GgufError::KeyType {
            path: self.path.clone(),
            key: key.into(),
            expected,
        }
    }

    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| self.wrong(key, "a string"))
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.require(key)?
            .as_array()
            .and_then(|a| a.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
            .ok_or_else(|| self.wrong(key, "an array of strings"))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Test support: writes a GGUF file (version 3) from metadata and raw tensors.
pub mod write {
    use super::Value;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn value(out: &mut Vec<u8>, v: &Value) {
        let (t, body): (u32, Vec<u8>) = match v {
            Value::U8(x) => (0, vec![*x]),
            Value::I8(x) => (1, vec![*x as u8]),
            Value::U16(x) => (2, x.to_le_bytes().to_vec()),
            Value::I16(x) => (3, x.to_le_bytes().to_vec()),
            Value::U32(x) => (4, x.to_le_bytes().to_vec()),
            Value::I32(x) => (5, x.to_le_bytes().to_vec()),
            Value::F32(x) => (6, x.to_le_bytes().to_vec()),
            Value::Bool(x) => (7, vec![*x as u8]),
            Value::String(s) => {
                let mut b = Vec::new();
                string(&mut b, s);
                (8, b)
            }
            Value::Array(items) => {
                let mut b = Vec::new();
                let et = items.first().map_or(4, type_of);
                b.extend_from_slice(&et.to_le_bytes());
                b.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    let mut inner = Vec::new();
                    value(&mut inner, it);
                    b.extend_from_slice(&inner[4..]);
                }
                (9, b)
            }
            Value::U64(x) => (10, x.to_le_bytes().to_vec()),
            Value::I64(x) => (11, x.to_le_bytes().to_vec()),
            Value::F64(x) => (12, x.to_le_bytes().to_vec()),
        };
        out.extend_from_slice(&t.to_le_bytes());
        out.extend_from_slice(&body);
    }

    fn type_of(v: &Value) -> u32 {
        let mut b = Vec::new();
        value(&mut b, v);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// `tensors`: (name, GGML dims, GGML type, data).
    pub fn gguf(metadata: &[(&str, Value)], tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            string(&mut out, k);
            value(&mut out, v);
        }
        let mut offset = 0u64;
        for (name, dims, t, data) in tensors {
            string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        for (_, _, _, data) in tensors {
            out.extend_from_slice(data);
            while out.len() % 32 != 0 {
                out.push(0);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        write::gguf(
            &[
                ("general.architecture", Value::String("llama".into())),
                ("llama.block_count", Value::U32(2)),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
                ),
            ],
            &[("w", vec![32, 2], ggml_type::Q4_1, vec![7u8; 40])],
        )
    }

    fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        GgufHeader::read(bytes, bytes.len() as u64, Path::new("m.gguf"))
    }

    #[test]
    fn reads_metadata_and_tensor_table() {
        let h = parse(&sample()).unwrap();
        assert_eq!(h.str("general.architecture").unwrap(), "llama");
        assert_eq!(h.u64("llama.block_count").unwrap(), 2);
        assert_eq!(h.strings("tokenizer.ggml.tokens").unwrap(), vec!["a", "b"]);
        let t = h.tensor("w").unwrap();
        assert_eq!(t.bytes, Some(40));
        assert_eq!(t.offset % 32, 0);
        assert_eq!(
            &sample()[t.offset as usize..t.offset as usize + 40],
            &[7u8; 40][..]
        );
    }

    #[test]
    fn every_truncation_is_an_error_naming_the_file() {
        let bytes = sample();
        for cut in 0..bytes.len() - 40 {
            let e = parse(&bytes[..cut]).expect_err("truncated header must fail");
            assert!(e.to_string().contains("m.gguf"), "{e}");
        }
    }

    #[test]
    fn wrong_magic_version_and_key_types_are_named() {
        let e = parse(b"PK\x03\x04 not a model").unwrap_err();
        assert!(e.to_string().contains("not a GGUF file"), "{e}");
        let mut v = sample();
        v[4] = 9;
        assert!(parse(&v).unwrap_err().to_string().contains("version 9"));
        let h = parse(&sample()).unwrap();
        let e = h.str("llama.block_count").unwrap_err().to_string();
        assert!(
            e.contains("llama.block_count") && e.contains("a string"),
            "{e}"
        );
        let e = h.u64("llama.nope").unwrap_err().to_string();
        assert!(e.contains("`llama.nope` is missing"), "{e}");
    }

    #[test]
    fn absurd_counts_do_not_allocate() {
        let mut v = sample();
        // The metadata count becomes 2^60.
        v[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(parse(&v).is_err());
    }
}
