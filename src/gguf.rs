//! GGUF reader (versions 2 and 3): the llama.cpp file format.
//!
//! Layout: magic "GGUF", version, tensor count, metadata count, then the metadata key/values, the
//! tensor infos (name, shape, type, offset), padding to `general.alignment`, and the tensor data.
//! The reader parses the header from a byte slice and never copies tensor data: a tensor is a
//! `(type, shape, byte range)` into the same buffer, which is a memory map natively and the
//! downloaded bytes in the browser.
//!
//! A model split by llama.cpp's `gguf-split` (`NAME-00001-of-00003.gguf`, ...: each part a whole
//! GGUF file, the metadata in part 1) parses as one model from its parts laid end to end in one
//! buffer, still without a copy: see [`Gguf::parse`].
//!
//! Every count, length and offset comes from an untrusted file, so each is checked against the
//! bytes that remain before anything is allocated; a hostile file gets an error, never a panic
//! or a huge allocation.

use std::collections::{HashMap, HashSet};

use crate::error::{gguf_err, Result};
use crate::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Tensors in GGUF have at most 4 dimensions (ggml's GGML_MAX_DIMS).
const MAX_DIMS: usize = 4;

/// A metadata value. Arrays keep their element type so an empty array still says what it holds.
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
    /// Any integer type as u64 (negative values are rejected).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// Any integer type as i64 (u64 values past i64::MAX are rejected).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
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
    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Where one tensor's bytes are, and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the innermost (row length), `dims[1]` the number of rows.
    pub dims: Vec<usize>,
    /// Absolute byte offset of the tensor data in the file.
    pub offset: usize,
    pub size_bytes: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }
    /// Row length (elements per row).
    pub fn cols(&self) -> usize {
        self.dims[0]
    }
    /// Rows when the tensor is seen as a matrix (all outer dimensions folded).
    pub fn rows(&self) -> usize {
        self.dims[1..].iter().product()
    }
}

/// A parsed GGUF header: metadata and tensor infos. Tensor data stays in the caller's buffer.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Byte offset where tensor data starts (of the first part, for a split model).
    pub data_offset: usize,
    /// Files parsed as one model: the parts of a model split by `gguf-split`, else 1.
    pub parts: usize,
}

impl Gguf {
    /// Parse the header of a GGUF file held in `bytes` and check that every tensor lies inside it.
    ///
    /// A model split by llama.cpp's `gguf-split` parses as one when `bytes` holds its parts laid
    /// end to end in order (see [`split_gguf`]): the metadata is part 1's, the tensors are every
    /// part's, with offsets into `bytes`. Each next part starts where the previous one's tensor
    /// data ends (after zero padding to its alignment, which gguf-split writes).
    pub fn parse(bytes: &[u8]) -> Result<Gguf> {
        let first = Part::parse(bytes, 0)?;
        let count = first.split_key(SPLIT_COUNT)?.unwrap_or(1);
        if count <= 1 {
            return Ok(first.into_gguf());
        }
        let Some(no) = first.split_key(SPLIT_NO)? else {
            return gguf_err!("{SPLIT_COUNT} is {count} but {SPLIT_NO} is missing");
        };
        if no != 0 {
            return gguf_err!(
                "this is part {} of {count} of a split model: load the first part (…-00001-of-{count:05}.gguf), which holds the metadata, with the others after it",
                no + 1
            );
        }
        let Some(expected) = first.split_key(SPLIT_TENSORS)? else {
            return gguf_err!("split model without {SPLIT_TENSORS}");
        };
        let mut end = first.end();
        let Part { version, metadata, mut tensors, data_offset, .. } = first;
        let mut names: HashSet<String> = tensors.iter().map(|t| t.name.clone()).collect();
        for k in 1..count {
            let Some(start) = part_start(bytes, end) else {
                let after = if end.padded >= bytes.len() {
                    "the data ends".to_string()
                } else {
                    format!("no GGUF header follows at byte {}", end.start)
                };
                return gguf_err!(
                    "part {} of {count} of the split model is missing: {after} after part {k}",
                    k + 1
                );
            };
            let part = Part::parse(bytes, start).map_err(|e| in_part(e, k, count))?;
            match (part.split_key(SPLIT_NO)?, part.split_key(SPLIT_COUNT)?) {
                (Some(n), Some(c)) if n == k && c == count => {}
                (n, c) => {
                    return gguf_err!(
                        "part {} of {count} of the split model (at byte {start}) says it is part {} of {}: the parts are out of order, or from different models",
                        k + 1,
                        n.map_or("?".into(), |n| (n + 1).to_string()),
                        c.map_or("?".into(), |c| c.to_string()),
                    )
                }
            }
            end = part.end();
            for t in part.tensors {
                if !names.insert(t.name.clone()) {
                    return gguf_err!(
                        "duplicate tensor name {:?} (again in part {} of {count})",
                        t.name,
                        k + 1
                    );
                }
                tensors.push(t);
            }
        }
        if tensors.len() as u64 != expected {
            return gguf_err!(
                "{SPLIT_TENSORS} is {expected} but the {count} parts hold {} tensors",
                tensors.len()
            );
        }
        // Anything after the last part but its padding is a part too many (a mismatched set).
        if part_start(bytes, end).is_some() || end.padded < bytes.len() {
            return gguf_err!(
                "{} bytes follow the last of the {count} parts of the split model",
                bytes.len().saturating_sub(end.start)
            );
        }
        Ok(Gguf { version, metadata, tensors, data_offset, parts: count as usize })
    }

    /// The header of the one GGUF file at the start of `bytes`, taken as it is: for a part of a
    /// split model, its own metadata and tensors (the `split.*` keys say which part it is).
    pub fn parse_file(bytes: &[u8]) -> Result<Gguf> {
        Ok(Part::parse(bytes, 0)?.into_gguf())
    }

    /// The header of a GGUF file of `file_len` bytes from the first bytes of it that have
    /// arrived (`prefix`), for a loader that streams the file and never holds it whole: the
    /// header whole, or how many bytes from the start the header needs at least (it may need
    /// more once those are read: a header's length is known only by reading it). Every check of
    /// [`Gguf::parse`] is made against `file_len` (a count the file cannot hold, a tensor past
    /// its end), so a truncated or hostile file is refused as soon as its header is read. Only a
    /// whole model in one file: a part of a split model is an error.
    pub fn parse_header(prefix: &[u8], file_len: usize) -> Result<Header> {
        if prefix.len() > file_len {
            return gguf_err!(
                "{} bytes arrived of a file announced as {file_len} bytes long",
                prefix.len()
            );
        }
        let part = match Part::parse_with(prefix, 0, file_len) {
            Ok(part) => part,
            Err((_, Some(need))) => return Ok(Header::NeedMore(need)),
            Err((e, None)) => return Err(e),
        };
        if let Some(count) = part.split_key(SPLIT_COUNT)?.filter(|&c| c > 1) {
            let no = part.split_key(SPLIT_NO)?.map_or("?".to_string(), |n| (n + 1).to_string());
            return gguf_err!(
                "this file is part {no} of {count} of a split model: load the model by its first part's name (…-00001-of-{count:05}.gguf), which brings the other parts"
            );
        }
        Ok(Header::Complete(part.into_gguf()))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The array `key` with each element converted by `item` (None for an element of the wrong
    /// type, which is an error naming the key and the element); `Ok(None)` when `key` is absent.
    fn array_of<'g, T>(
        &'g self,
        key: &str,
        what: &str,
        item: impl Fn(&'g Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(value) = self.get(key) else { return Ok(None) };
        let Some(items) = value.as_array() else {
            return gguf_err!("metadata {key:?} is not an array (of {what})");
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, v) in items.iter().enumerate() {
            match item(v) {
                Some(x) => out.push(x),
                None => {
                    return gguf_err!("metadata {key:?}[{i}] is a {}, not {what}", v.type_name())
                }
            }
        }
        Ok(Some(out))
    }

    /// The string array `key` (e.g. `tokenizer.ggml.tokens`), or None when absent.
    pub fn str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.array_of(key, "strings", Value::as_str)
    }

    /// The float array `key` (e.g. `tokenizer.ggml.scores`; integers are accepted too).
    pub fn f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.array_of(key, "numbers", |v| v.as_f64().map(|x| x as f32))
    }

    /// The integer array `key` (e.g. `tokenizer.ggml.token_type`), of any integer type.
    pub fn int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.array_of(key, "integers", Value::as_i64)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// `general.architecture`, required by every model file.
    pub fn architecture(&self) -> Result<&str> {
        match self.get("general.architecture").and_then(Value::as_str) {
            Some(a) => Ok(a),
            None => gguf_err!("missing general.architecture"),
        }
    }
}

/// What [`Gguf::parse_header`] makes of the first bytes of a file.
#[derive(Debug)]
pub enum Header {
    /// The whole header: tensor data starts at its `data_offset`.
    Complete(Gguf),
    /// The header runs past the bytes given: it needs at least this many from the start.
    NeedMore(usize),
}

/// `general.alignment` when it is one we accept: a power of two up to 1 MiB.
fn valid_alignment(v: &Value) -> Option<u64> {
    v.as_u64().filter(|a| a.is_power_of_two() && *a <= 1 << 20)
}

/// `split.*` keys, which llama.cpp's `gguf-split` writes into every part: `split.no` (u16, from
/// 0), `split.count` (u16) and `split.tensors.count` (i32, the tensors of all parts together).
const SPLIT_NO: &str = "split.no";
const SPLIT_COUNT: &str = "split.count";
const SPLIT_TENSORS: &str = "split.tensors.count";

/// Prefix `e` (a part's own parse error) with the part it is about.
fn in_part(e: crate::Error, k: u64, count: u64) -> crate::Error {
    match e {
        crate::Error::Gguf(m) => crate::Error::Gguf(format!("part {} of {count}: {m}", k + 1)),
        other => other,
    }
}

/// Where one part's tensor data ends, and that end rounded up to its alignment.
#[derive(Clone, Copy)]
struct End {
    start: usize,
    padded: usize,
}

/// Where the part after one that ends at `end` starts: right there, or after the zero padding
/// gguf-split writes; None without a GGUF header there.
fn part_start(bytes: &[u8], end: End) -> Option<usize> {
    let mut p = end.start;
    while p < end.padded && bytes.get(p) == Some(&0) {
        p += 1;
    }
    (bytes.get(p..p + MAGIC.len())? == MAGIC).then_some(p)
}

/// One GGUF file that starts at byte `start` of a buffer (0, or later for the parts of a split
/// model laid end to end); all offsets are into the whole buffer.
struct Part {
    start: usize,
    version: u32,
    metadata: HashMap<String, Value>,
    tensors: Vec<TensorInfo>,
    data_offset: usize,
    alignment: usize,
}

/// What a file that should have been GGUF starts with, readably (`"The " (54 68 65 20)`),
/// and what it looks like when that is recognisable.
fn not_gguf(bytes: &[u8]) -> String {
    let head = &bytes[..bytes.len().min(4)];
    let hex: Vec<String> = head.iter().map(|b| format!("{b:02x}")).collect();
    let text: String = head
        .iter()
        .map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' })
        .collect();
    let start = String::from_utf8_lossy(&bytes[..bytes.len().min(64)]).trim_start().to_lowercase();
    let looks_like = if start.starts_with("version https://git-lfs") {
        "; it is a Git LFS pointer, not the file (run `git lfs pull`)"
    } else if start.starts_with("<!doctype html") || start.starts_with("<html") {
        "; it looks like an HTML page (an error page saved instead of the model?)"
    } else if start.starts_with('<') {
        "; it looks like HTML or XML"
    } else if start.starts_with('{') || start.starts_with('[') {
        "; it looks like JSON (a tokenizer.json? a table model needs the .json extension)"
    } else {
        ""
    };
    format!("it starts with \"{text}\" ({}), not \"GGUF\"{looks_like}", hex.join(" "))
}

impl Part {
    fn parse(bytes: &[u8], start: usize) -> Result<Part> {
        Part::parse_with(bytes, start, bytes.len()).map_err(|(e, _)| e)
    }

    /// The part at `start` of a file of `len` bytes of which `bytes` are the first ones (all of
    /// them, or a prefix while the file streams in). An error that only says the header runs
    /// past `bytes` (not past `len`) comes with the number of bytes the read needed.
    fn parse_with(
        bytes: &[u8],
        start: usize,
        len: usize,
    ) -> std::result::Result<Part, (crate::Error, Option<usize>)> {
        let mut r = Reader { bytes, len, pos: start, array_elements: 0, short: None };
        Part::read(&mut r, start).map_err(|e| (e, r.short))
    }

    fn read(r: &mut Reader, start: usize) -> Result<Part> {
        let bytes = r.bytes;
        let head = &bytes[start..];
        if r.len <= start {
            return gguf_err!("not a GGUF file: it is empty (0 bytes: truncated or never written)");
        }
        // A prefix of the magic is a truncated GGUF, which the read below reports.
        if !head.starts_with(MAGIC) && !MAGIC.starts_with(head) {
            return gguf_err!("not a GGUF file: {}", not_gguf(head));
        }
        r.take(4, "magic")?;
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return gguf_err!("unsupported GGUF version {version} (supported: 2 and 3)");
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Each key/value takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor info at
        // least 8 + 4 + 4 + 8 bytes. A count that cannot fit in the file is a lie.
        r.check_count(n_kv, 13, "metadata count")?;
        r.check_count(n_tensors, 24, "tensor count")?;

        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let value = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return gguf_err!("duplicate metadata key {key:?}");
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match valid_alignment(v) {
                Some(a) => a,
                None => return gguf_err!("general.alignment {v:?} is not a power of two"),
            },
        };

        let mut infos = Vec::new();
        for i in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor dimension count")? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return gguf_err!(
                    "tensor {name:?} has {n_dims} dimensions (1..={MAX_DIMS} allowed)"
                );
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                let d = r.u64("tensor dimension")?;
                if d == 0 || d > u32::MAX as u64 {
                    return gguf_err!("tensor {name:?} has an absurd dimension {d}");
                }
                dims.push(d as usize);
            }
            let ty_id = r.u32("tensor type")?;
            let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                crate::Error::Gguf(format!(
                    "tensor {name:?} has unsupported type {} (supported: {})",
                    GgmlType::describe_id(ty_id),
                    GgmlType::SUPPORTED
                ))
            })?;
            let offset = r.u64("tensor offset")?;
            if offset % alignment != 0 {
                return gguf_err!("tensor {name:?} offset {offset} is not aligned to {alignment}");
            }
            let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
            let size = n_elements.and_then(|n| ty.bytes_for(n, dims[0] as u64));
            let Some(size) = size else {
                return gguf_err!(
                    "tensor {name:?} of type {} has shape {dims:?}, whose row length is not a multiple of the block size {} or whose size overflows",
                    ty.name(),
                    ty.block_size()
                );
            };
            infos.push((name, ty, dims, offset, size, i));
        }

        // Alignment is relative to the start of the file, which for a later part is `start`.
        let data_offset = start + (r.pos - start).div_ceil(alignment as usize) * alignment as usize;
        let mut tensors = Vec::with_capacity(infos.len());
        let mut seen = HashMap::new();
        for (name, ty, dims, offset, size, index) in infos {
            let start = (data_offset as u64).checked_add(offset);
            let end = start.and_then(|s| s.checked_add(size));
            match end {
                Some(end) if end <= r.len as u64 => {}
                _ => {
                    return gguf_err!(
                        "tensor {name:?} ({} bytes at offset {}) lies past the end of the file ({} bytes): the file is truncated",
                        size,
                        (data_offset as u64).saturating_add(offset),
                        r.len
                    )
                }
            }
            if seen.insert(name.clone(), index).is_some() {
                return gguf_err!("duplicate tensor name {name:?}");
            }
            tensors.push(TensorInfo {
                name,
                ty,
                dims,
                offset: data_offset + offset as usize,
                size_bytes: size as usize,
            });
        }
        Ok(Part { start, version, metadata, tensors, data_offset, alignment: alignment as usize })
    }

    /// This file alone as a model's header.
    fn into_gguf(self) -> Gguf {
        let Part { version, metadata, tensors, data_offset, .. } = self;
        Gguf { version, metadata, tensors, data_offset, parts: 1 }
    }

    /// The integer `split.*` key `key`, if present.
    fn split_key(&self, key: &str) -> Result<Option<u64>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n)),
                None => gguf_err!("{key} is {v:?}, not a count"),
            },
        }
    }

    /// Where this part's tensor data ends (its header's end when it has no tensors). gguf-split
    /// pads each tensor to 32 bytes, whatever the part's alignment.
    fn end(&self) -> End {
        let end = self.tensors.iter().map(|t| t.offset + t.size_bytes);
        let start = end.fold(self.data_offset, usize::max);
        let align = self.alignment.max(DEFAULT_ALIGNMENT as usize);
        End { start, padded: self.start + (start - self.start).div_ceil(align) * align }
    }
}

/// A bounds-checked cursor over the file bytes: all of them, or the first ones of a file of
/// `len` bytes that is still arriving.
struct Reader<'a> {
    bytes: &'a [u8],
    /// The file's length (`bytes.len()` unless `bytes` is a prefix).
    len: usize,
    pos: usize,
    /// Metadata array elements read so far (see `MAX_ARRAY_ELEMENTS`).
    array_elements: u64,
    /// Set when a read ran past `bytes` but not past the file: the bytes it needed.
    short: Option<usize>,
}

/// Arrays nest (an array of arrays is legal); deeper than this is hostile.
const MAX_ARRAY_NESTING: usize = 4;
/// Each parsed value takes ~32 bytes however small it is in the file, so cap the elements of all
/// metadata arrays together. Real vocabularies (tokens, scores, merges) stay far below this.
const MAX_ARRAY_ELEMENTS: u64 = 8 << 20;

impl<'a> Reader<'a> {
    /// Bytes of the file after the cursor (arrived or not).
    fn remaining(&self) -> usize {
        self.len - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return gguf_err!(
                "file truncated while reading {what} at byte {} (needs {n} bytes, {} left)",
                self.pos,
                self.remaining()
            );
        }
        if self.pos + n > self.bytes.len() {
            self.short = Some(self.pos + n);
            return gguf_err!("the header runs past the {} bytes read so far", self.bytes.len());
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn check_count(&self, count: u64, min_bytes_each: u64, what: &str) -> Result<()> {
        if count.saturating_mul(min_bytes_each) > self.remaining() as u64 {
            return gguf_err!(
                "{what} {count} is impossible: the {} bytes left cannot hold that many",
                self.remaining()
            );
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("take returned N bytes"))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return gguf_err!(
                "{what} at byte {} claims {len} bytes but only {} are left",
                self.pos,
                self.remaining()
            );
        }
        let raw = self.take(len as usize, what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => gguf_err!("{what} at byte {} is not valid UTF-8", self.pos - raw.len()),
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return gguf_err!("metadata {key:?}: invalid bool byte {b}"),
            },
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return gguf_err!("metadata {key:?}: arrays nested too deeply");
                }
                let elem_ty = self.u32(key)?;
                let len = self.u64(key)?;
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => {
                        return gguf_err!("metadata {key:?}: unknown array element type {elem_ty}")
                    }
                };
                self.check_count(len, min_size, &format!("metadata {key:?} array length"))?;
                self.array_elements = self.array_elements.saturating_add(len);
                if self.array_elements > MAX_ARRAY_ELEMENTS {
                    return gguf_err!("metadata {key:?}: arrays hold more than {MAX_ARRAY_ELEMENTS} elements in all");
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            _ => return gguf_err!("metadata {key:?}: unknown value type {ty}"),
        })
    }
}

/// Writes GGUF v3 files: metadata, then tensors (already encoded in their type's bytes). Used by
/// `synthetic` to build random-weight models (for `nexttoken synth` and the tests).
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, GgmlType, Vec<usize>, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_owned(), value));
        self
    }

    /// Add a tensor of GGUF shape `dims` (innermost first) whose encoded bytes are `data`.
    pub fn tensor(&mut self, name: &str, ty: GgmlType, dims: &[usize], data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_owned(), ty, dims.to_vec(), data));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let sizes: Vec<TensorHeader> = self
            .tensors
            .iter()
            .map(|(name, ty, dims, data)| TensorHeader { name, ty: *ty, dims, size: data.len() })
            .collect();
        let (mut out, align) = gguf_header(&self.metadata, &sizes);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        out
    }
}

/// A tensor as the header describes it: name, type, GGUF shape (innermost first), bytes.
pub struct TensorHeader<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub dims: &'a [usize],
    pub size: usize,
}

/// A GGUF file's header for `metadata` and `tensors` (their data laid out in order, each padded
/// to the alignment), padded to where the data starts, and that alignment: the file is the
/// header, then each tensor's bytes and padding (a writer that streams the data, such as
/// `synthetic::write_to`, needs only this).
pub fn gguf_header(metadata: &[(String, Value)], tensors: &[TensorHeader]) -> (Vec<u8>, usize) {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        write_string(&mut out, key);
        out.extend_from_slice(&value_type(value).to_le_bytes());
        write_value(&mut out, value);
    }
    // The file's own alignment when it names one (a split's part 1 keeps the original's).
    let align = metadata
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .and_then(|(_, v)| valid_alignment(v))
        .unwrap_or(DEFAULT_ALIGNMENT) as usize;
    let mut offset = 0usize;
    for t in tensors {
        write_string(&mut out, t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for &d in t.dims {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += t.size.div_ceil(align) * align;
    }
    out.resize(out.len().div_ceil(align) * align, 0);
    (out, align)
}

/// The GGUF file `bytes` split as llama.cpp's `gguf-split` splits one: part i gets the next
/// `tensors_per_part[i]` tensors (in file order) and is a whole GGUF file of its own; part 1 keeps
/// all the metadata, and every part gets `split.no`, `split.count` and `split.tensors.count`.
/// gguf-split puts a tensor or more in every part but the first (which
/// `--no-tensor-first-split` leaves empty). For the tests and `nexttoken synth --split`.
pub fn split_gguf_by(bytes: &[u8], tensors_per_part: &[usize]) -> Result<Vec<Vec<u8>>> {
    let g = Gguf::parse(bytes)?;
    let n = tensors_per_part.len();
    if g.parts > 1 {
        return gguf_err!("the file is split already ({} parts)", g.parts);
    }
    if n == 0
        || n > u16::MAX as usize
        || tensors_per_part[1..].contains(&0)
        || tensors_per_part.iter().sum::<usize>() != g.tensors.len()
    {
        return Err(crate::Error::Input(format!(
            "cannot split {} tensors into parts of {tensors_per_part:?} tensors",
            g.tensors.len()
        )));
    }
    // Sorted: the map's order is random, the file's bytes should not be.
    let mut keys: Vec<_> = g.metadata.iter().filter(|(k, _)| !k.starts_with("split.")).collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    let mut tensors = g.tensors.iter();
    let parts = tensors_per_part.iter().enumerate().map(|(i, &count)| {
        let mut w = GgufWriter::new();
        if i == 0 {
            for (k, v) in &keys {
                w.metadata(k, (*v).clone());
            }
        }
        w.metadata(SPLIT_NO, Value::U16(i as u16));
        w.metadata(SPLIT_COUNT, Value::U16(n as u16));
        w.metadata(SPLIT_TENSORS, Value::I32(g.tensors.len() as i32));
        for t in tensors.by_ref().take(count) {
            w.tensor(&t.name, t.ty, &t.dims, bytes[t.offset..][..t.size_bytes].to_vec());
        }
        w.to_bytes()
    });
    Ok(parts.collect())
}

/// [`split_gguf_by`] into `parts` parts of tensor counts as equal as can be.
pub fn split_gguf(bytes: &[u8], parts: usize) -> Result<Vec<Vec<u8>>> {
    let n = Gguf::parse(bytes)?.tensors.len();
    if parts == 0 || parts > n {
        return Err(crate::Error::Input(format!("cannot split {n} tensors into {parts} parts")));
    }
    let counts: Vec<usize> = (0..parts).map(|i| (i + 1) * n / parts - i * n / parts).collect();
    split_gguf_by(bytes, &counts)
}

/// llama.cpp's file name of part `k` (from 1) of `n` of a split model: `PREFIX-0000k-of-0000n.gguf`.
pub fn split_file_name(prefix: &str, k: usize, n: usize) -> String {
    format!("{prefix}-{k:05}-of-{n:05}.gguf")
}

/// `(PREFIX, n)` when `name` is that of the first part of a model split in `n > 1` parts
/// (`PREFIX-00001-of-0000n.gguf`, see [`split_file_name`]).
pub fn first_split_part(name: &str) -> Option<(&str, usize)> {
    let (rest, n) = name.strip_suffix(".gguf")?.rsplit_once("-of-")?;
    let (prefix, k) = rest.rsplit_once('-')?;
    let number = |s: &str| {
        (s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse::<usize>().ok())?
    };
    match (number(k)?, number(n)?) {
        (1, n) if n > 1 && !prefix.is_empty() => Some((prefix, n)),
        _ => None,
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            // An empty array is written as an array of u8 (GGUF needs some element type).
            let elem = items.first().map_or(0, value_type);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}
