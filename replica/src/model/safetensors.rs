//! The safetensors format (Hugging Face checkpoints): an 8-byte little-endian header length,
//! a JSON header naming each tensor's dtype, shape and byte range, then the data. Reading keeps
//! the file's bytes and hands out ranges; writing is for tests and exports.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::error::LoadError;

#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

/// The tensor table of one safetensors file.
pub fn read_header(bytes: &[u8], path: &Path) -> Result<BTreeMap<String, TensorEntry>, LoadError> {
    let corrupt = |what: String| LoadError::Corrupt {
        path: path.display().to_string(),
        what,
    };
    if bytes.len() < 8 {
        return Err(corrupt("shorter than the 8-byte header length".into()));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    if n > bytes.len() - 8 {
        return Err(corrupt(format!(
            "the header claims {n} bytes but the file has {}",
            bytes.len() - 8
        )));
    }
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n])
        .map_err(|e| corrupt(format!("the JSON header is invalid: {e}")))?;
    let base = 8 + n;
    let mut out = BTreeMap::new();
    for (name, v) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| corrupt(format!("tensor `{name}` has no dtype")))?
            .to_string();
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| corrupt(format!("tensor `{name}` has no shape")))?;
        let offsets: Vec<usize> = v
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .filter(|o: &Vec<usize>| o.len() == 2 && o[0] <= o[1])
            .ok_or_else(|| corrupt(format!("tensor `{name}` has no valid data_offsets")))?;
        let (start, end) = (base + offsets[0], base + offsets[1]);
        if end > bytes.len() {
            return Err(corrupt(format!(
                "tensor `{name}` ends at byte {end}, past the end of the file ({})",
                bytes.len()
            )));
        }
        out.insert(
            name,
            TensorEntry {
                dtype,
                shape,
                start,
                end,
            },
        );
    }
    Ok(out)
}

/// Writes tensors `(name, dtype, shape, data)` as one safetensors file.
pub fn write(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) -> std::io::Result<()> {
    let mut header = Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut text = Value::Object(header).to_string().into_bytes();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    std::fs::write(path, out)
}
