//! Case files (feature `cli`): one attention call stored as safetensors, and its result.
//!
//! A case file holds the tensors of one call under the contract's names (`q`, `k`, `v`,
//! `cu_seqlens_q`, `cu_seqlens_k`, `k_cache`, `v_cache`, `block_table`, `seq_lens`,
//! `alibi_slopes`) and string metadata: `layout` (`dense` | `varlen` | `paged`), `causal`
//! (`true` | `false`), and optional `window_left`, `window_right`, `softcap`, `scale`. A result
//! file holds `out` (the dtype of q) and `lse` (F32).
//!
//! Reading checks what only the file can get wrong (a missing or unknown tensor, an integer
//! tensor stored as float, a metadata string that does not parse) and names the tensor or key and
//! the value it found; shapes and values are then checked by [`validate`](crate::validate) like
//! every other call.
//!
//! ```
//! use attnkit::casefile::{Case, read_result_bytes, result_bytes};
//! use attnkit::{AttentionBackend, DType, LayoutKind, Params, Tensor};
//!
//! # fn main() -> attnkit::Result<()> {
//! let x: Vec<f32> = (0..2 * 3 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let t = || Tensor::from_f32(&[2, 3, 2, 8], DType::F32, &x);
//! let case = Case::dense(t()?, t()?, t()?, Params { causal: true, ..Params::default() });
//! let bytes = case.to_bytes()?;
//! let case = Case::from_bytes(&bytes, "case.safetensors")?;
//! assert_eq!(case.layout, LayoutKind::Dense);
//!
//! let be = attnkit::by_name("reference")?;
//! let mut out = be.alloc(case.q.shape(), case.q.dtype())?;
//! let mut lse = be.alloc(&case.lse_shape(), DType::F32)?;
//! be.forward(&case.call(), Some(&mut out), Some(&mut lse))?;
//! let (out2, lse2) = read_result_bytes(&result_bytes(&out, &lse, None)?, "out.safetensors")?;
//! assert_eq!(out2.shape(), out.shape());
//! assert_eq!(lse2.shape(), lse.shape());
//! # Ok(())
//! # }
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView, View};

use crate::call::{AttnCall, LayoutKind, Params};
use crate::error::{Error, Result};
use crate::types::{DType, HostData, Tensor};

/// Every tensor name a case file may hold.
pub const TENSORS: [&str; 10] =
    ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "k_cache", "v_cache", "block_table", "seq_lens", "alibi_slopes"];

/// Every metadata key a case file may hold (`format` is what PyTorch's writer adds; it is ignored).
pub const KEYS: [&str; 7] = ["layout", "causal", "window_left", "window_right", "softcap", "scale", "format"];

/// The tensors each layout needs (besides the optional `alibi_slopes`).
pub fn needed(layout: LayoutKind) -> &'static [&'static str] {
    match layout {
        LayoutKind::Dense => &["q", "k", "v"],
        LayoutKind::Varlen => &["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"],
        LayoutKind::Paged => &["q", "k_cache", "v_cache", "cu_seqlens_q", "block_table", "seq_lens"],
    }
}

/// One call read from a case file, on the host.
#[derive(Debug)]
pub struct Case {
    /// The layout.
    pub layout: LayoutKind,
    /// Queries.
    pub q: Tensor,
    /// Keys, or `k_cache` for the paged layout.
    pub k: Tensor,
    /// Values, or `v_cache` for the paged layout.
    pub v: Tensor,
    /// `[B+1]` (varlen, paged).
    pub cu_seqlens_q: Vec<i32>,
    /// `[B+1]` (varlen).
    pub cu_seqlens_k: Vec<i32>,
    /// `[B, max_blocks]` row-major (paged).
    pub block_table: Vec<i32>,
    /// Columns of `block_table` (paged).
    pub max_blocks: usize,
    /// `[B]` (paged).
    pub seq_lens: Vec<i32>,
    /// f32 `[Hq]`, when given.
    pub alibi_slopes: Option<Vec<f32>>,
    /// Mask and score parameters.
    pub params: Params,
}

fn bad(arg: impl Into<String>, value: impl std::fmt::Display, msg: impl Into<String>) -> Error {
    Error::Value { arg: arg.into(), value: value.to_string(), msg: msg.into() }
}

fn file_err(path: &str, msg: impl std::fmt::Display) -> Error {
    Error::File { path: path.to_string(), msg: msg.to_string() }
}

fn st_dtype(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::I32 => StDtype::I32,
    }
}

fn our_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        StDtype::I32 => Some(DType::I32),
        _ => None,
    }
}

fn to_tensor(name: &str, t: &TensorView<'_>) -> Result<Tensor> {
    let dtype = our_dtype(t.dtype())
        .ok_or_else(|| bad(format!("{name}.dtype"), format!("{:?}", t.dtype()), "must be F32, F16, BF16 or I32"))?;
    let data = HostData::from_le_bytes(dtype, t.data()).ok_or_else(|| {
        bad(format!("{name}.data"), format!("{} bytes", t.data().len()), format!("not a whole number of {dtype}"))
    })?;
    Tensor::from_host(t.shape(), data)
}

fn float_tensor(name: &str, t: &TensorView<'_>) -> Result<Tensor> {
    match t.dtype() {
        StDtype::F32 | StDtype::F16 | StDtype::BF16 => to_tensor(name, t),
        other => Err(bad(format!("{name}.dtype"), format!("{other:?}"), "must be F32, F16 or BF16")),
    }
}

fn i32_tensor(name: &str, t: &TensorView<'_>, rank: usize) -> Result<Vec<i32>> {
    if t.dtype() != StDtype::I32 {
        return Err(bad(format!("{name}.dtype"), format!("{:?}", t.dtype()), "must be I32"));
    }
    if t.shape().len() != rank {
        return Err(Error::Shape {
            arg: static_name(name),
            got: t.shape().to_vec(),
            expected: format!("a {rank}-d I32 tensor"),
        });
    }
    match to_tensor(name, t)?.host() {
        Some(HostData::I32(v)) => Ok(v.clone()),
        _ => Err(bad(format!("{name}.dtype"), format!("{:?}", t.dtype()), "must be I32")),
    }
}

/// The `&'static` spelling of a known tensor name, for [`Error::Shape`].
fn static_name(name: &str) -> &'static str {
    TENSORS.iter().find(|&&n| n == name).copied().unwrap_or("tensor")
}

fn parse_bool(key: &str, s: &str) -> Result<bool> {
    match s {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(bad(format!("metadata `{key}`"), format!("{s:?}"), "must be \"true\" or \"false\"")),
    }
}

fn parse_window(key: &str, s: &str) -> Result<usize> {
    s.trim().parse::<usize>().map_err(|_| {
        bad(
            format!("metadata `{key}`"),
            format!("{s:?}"),
            "must be a non-negative integer (leave the key out for an unbounded window)",
        )
    })
}

fn parse_f32(key: &str, s: &str) -> Result<f32> {
    match s.trim().parse::<f32>() {
        Ok(x) if x.is_finite() => Ok(x),
        _ => Err(bad(format!("metadata `{key}`"), format!("{s:?}"), "must be a finite number")),
    }
}

impl Case {
    /// A dense case.
    pub fn dense(q: Tensor, k: Tensor, v: Tensor, params: Params) -> Case {
        Case {
            layout: LayoutKind::Dense,
            q,
            k,
            v,
            cu_seqlens_q: vec![],
            cu_seqlens_k: vec![],
            block_table: vec![],
            max_blocks: 0,
            seq_lens: vec![],
            alibi_slopes: None,
            params,
        }
    }

    /// Read a case file.
    pub fn read(path: impl AsRef<Path>) -> Result<Case> {
        let p = path.as_ref();
        let name = p.display().to_string();
        let bytes = std::fs::read(p).map_err(|e| file_err(&name, format!("cannot read: {e}")))?;
        Case::from_bytes(&bytes, &name)
    }

    /// Parse the bytes of a case file; `name` is used in file-level errors.
    pub fn from_bytes(bytes: &[u8], name: &str) -> Result<Case> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| file_err(name, format!("not a safetensors file: {e}")))?;
        let (_, meta) =
            SafeTensors::read_metadata(bytes).map_err(|e| file_err(name, format!("not a safetensors file: {e}")))?;
        let empty = HashMap::new();
        let md = meta.metadata().as_ref().unwrap_or(&empty);
        if let Some(k) = sorted_keys(md).into_iter().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(bad(
                format!("metadata `{k}`"),
                format!("{:?}", md[&k]),
                format!("unknown key (known: {})", KEYS[..6].join(", ")),
            ));
        }
        let layout = match md.get("layout").map(String::as_str) {
            Some("dense") => LayoutKind::Dense,
            Some("varlen") => LayoutKind::Varlen,
            Some("paged") => LayoutKind::Paged,
            Some(other) => {
                return Err(bad(
                    "metadata `layout`",
                    format!("{other:?}"),
                    "must be \"dense\", \"varlen\" or \"paged\"",
                ))
            }
            None => {
                return Err(bad(
                    "metadata `layout`",
                    "(missing)",
                    "a case file must say \"dense\", \"varlen\" or \"paged\"",
                ))
            }
        };
        let causal = match md.get("causal") {
            Some(s) => parse_bool("causal", s)?,
            None => return Err(bad("metadata `causal`", "(missing)", "a case file must say \"true\" or \"false\"")),
        };
        let params = Params {
            causal,
            window_left: md.get("window_left").map(|s| parse_window("window_left", s)).transpose()?,
            window_right: md.get("window_right").map(|s| parse_window("window_right", s)).transpose()?,
            softcap: md.get("softcap").map(|s| parse_f32("softcap", s)).transpose()?,
            scale: md.get("scale").map(|s| parse_f32("scale", s)).transpose()?,
        };

        let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
        names.sort();
        let need = needed(layout);
        for n in &names {
            if !TENSORS.contains(&n.as_str()) {
                return Err(bad(
                    n.clone(),
                    "(unknown tensor)",
                    format!("a case file holds only {}", TENSORS.join(", ")),
                ));
            }
            if !need.contains(&n.as_str()) && n != "alibi_slopes" {
                return Err(bad(
                    n.clone(),
                    "(unexpected tensor)",
                    format!("layout `{layout}` uses only {} (and optionally alibi_slopes)", need.join(", ")),
                ));
            }
        }
        for &n in need {
            if !names.iter().any(|x| x == n) {
                return Err(bad(n, "(missing)", format!("layout `{layout}` needs tensors {}", need.join(", "))));
            }
        }
        let get = |n: &str| st.tensor(n).map_err(|e| file_err(name, format!("tensor `{n}`: {e}")));

        let (kn, vn) = if layout == LayoutKind::Paged { ("k_cache", "v_cache") } else { ("k", "v") };
        let q = float_tensor("q", &get("q")?)?;
        let k = float_tensor(kn, &get(kn)?)?;
        let v = float_tensor(vn, &get(vn)?)?;
        let mut case = Case::dense(q, k, v, params);
        case.layout = layout;
        match layout {
            LayoutKind::Dense => {}
            LayoutKind::Varlen => {
                case.cu_seqlens_q = i32_tensor("cu_seqlens_q", &get("cu_seqlens_q")?, 1)?;
                case.cu_seqlens_k = i32_tensor("cu_seqlens_k", &get("cu_seqlens_k")?, 1)?;
            }
            LayoutKind::Paged => {
                case.cu_seqlens_q = i32_tensor("cu_seqlens_q", &get("cu_seqlens_q")?, 1)?;
                let bt = get("block_table")?;
                case.block_table = i32_tensor("block_table", &bt, 2)?;
                case.max_blocks = bt.shape()[1];
                case.seq_lens = i32_tensor("seq_lens", &get("seq_lens")?, 1)?;
            }
        }
        if names.iter().any(|n| n == "alibi_slopes") {
            let t = get("alibi_slopes")?;
            if t.dtype() != StDtype::F32 {
                return Err(bad("alibi_slopes.dtype", format!("{:?}", t.dtype()), "must be F32"));
            }
            if t.shape().len() != 1 {
                return Err(Error::Shape { arg: "alibi_slopes", got: t.shape().to_vec(), expected: "[Hq] F32".into() });
            }
            case.alibi_slopes = match to_tensor("alibi_slopes", &t)?.host() {
                Some(HostData::F32(v)) => Some(v.clone()),
                _ => None,
            };
        }
        Ok(case)
    }

    /// The call over the case's own host tensors.
    pub fn call(&self) -> AttnCall<'_> {
        self.call_on(&self.q, &self.k, &self.v)
    }

    /// The call over other q, k, v (the case's tensors uploaded to a device).
    pub fn call_on<'a>(&'a self, q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> AttnCall<'a> {
        let mut c = match self.layout {
            LayoutKind::Dense => AttnCall::dense(q, k, v),
            LayoutKind::Varlen => AttnCall::varlen(q, k, v, &self.cu_seqlens_q, &self.cu_seqlens_k),
            LayoutKind::Paged => {
                AttnCall::paged(q, k, v, &self.cu_seqlens_q, &self.block_table, self.max_blocks, &self.seq_lens)
            }
        };
        c.params = self.params;
        c.alibi_slopes = self.alibi_slopes.as_deref();
        c
    }

    /// The lse shape of the contract for this case: `[B, Hq, Sq]` dense, `[Hq, Tq]` otherwise.
    /// Meaningful for a case whose q has the layout's rank (a malformed one fails validation).
    pub fn lse_shape(&self) -> Vec<usize> {
        let s = self.q.shape();
        match (self.layout, s.len()) {
            (LayoutKind::Dense, 4) => vec![s[0], s[2], s[1]],
            (_, 3) => vec![s[1], s[0]],
            _ => vec![0],
        }
    }

    /// The case as a safetensors file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let b = self.cu_seqlens_q.len().saturating_sub(1);
        let (kn, vn) = if self.layout == LayoutKind::Paged { ("k_cache", "v_cache") } else { ("k", "v") };
        let mut ts: Vec<(&str, Owned)> =
            vec![("q", Owned::of(&self.q)?), (kn, Owned::of(&self.k)?), (vn, Owned::of(&self.v)?)];
        let ints =
            |v: &[i32], shape: Vec<usize>| Owned::new(StDtype::I32, shape, HostData::I32(v.to_vec()).to_le_bytes());
        match self.layout {
            LayoutKind::Dense => {}
            LayoutKind::Varlen => {
                ts.push(("cu_seqlens_q", ints(&self.cu_seqlens_q, vec![self.cu_seqlens_q.len()])));
                ts.push(("cu_seqlens_k", ints(&self.cu_seqlens_k, vec![self.cu_seqlens_k.len()])));
            }
            LayoutKind::Paged => {
                ts.push(("cu_seqlens_q", ints(&self.cu_seqlens_q, vec![self.cu_seqlens_q.len()])));
                ts.push(("block_table", ints(&self.block_table, vec![b, self.max_blocks])));
                ts.push(("seq_lens", ints(&self.seq_lens, vec![self.seq_lens.len()])));
            }
        }
        if let Some(s) = &self.alibi_slopes {
            ts.push(("alibi_slopes", Owned::new(StDtype::F32, vec![s.len()], HostData::F32(s.clone()).to_le_bytes())));
        }
        let p = &self.params;
        let mut md = HashMap::new();
        md.insert("layout".to_string(), self.layout.name().to_string());
        md.insert("causal".to_string(), p.causal.to_string());
        let mut opt = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                md.insert(k.to_string(), v);
            }
        };
        opt("window_left", p.window_left.map(|x| x.to_string()));
        opt("window_right", p.window_right.map(|x| x.to_string()));
        opt("softcap", p.softcap.map(|x| x.to_string()));
        opt("scale", p.scale.map(|x| x.to_string()));
        safetensors::serialize(ts, Some(md)).map_err(|e| file_err("case", e))
    }

    /// Write the case file.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let p = path.as_ref();
        std::fs::write(p, self.to_bytes()?)
            .map_err(|e| file_err(&p.display().to_string(), format!("cannot write: {e}")))
    }
}

fn sorted_keys(md: &HashMap<String, String>) -> Vec<String> {
    let mut k: Vec<String> = md.keys().cloned().collect();
    k.sort();
    k
}

/// A host tensor's bytes for the safetensors writer.
struct Owned {
    dtype: StDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Owned {
    fn new(dtype: StDtype, shape: Vec<usize>, data: Vec<u8>) -> Owned {
        Owned { dtype, shape, data }
    }
    fn of(t: &Tensor) -> Result<Owned> {
        let h = t.host().ok_or_else(|| Error::Device {
            arg: "tensor",
            got: t.device(),
            expected: crate::types::Device::Host,
            backend: "casefile",
        })?;
        Ok(Owned::new(st_dtype(t.dtype()), t.shape().to_vec(), h.to_le_bytes()))
    }
}

impl View for Owned {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// A result file's bytes: `out` (its dtype) and `lse` (F32), both host tensors, with optional
/// string metadata (the backend that produced it, for instance).
pub fn result_bytes(out: &Tensor, lse: &Tensor, metadata: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    if lse.dtype() != DType::F32 {
        return Err(Error::DType { arg: "lse", got: lse.dtype(), expected: "f32".into() });
    }
    let ts = vec![("out", Owned::of(out)?), ("lse", Owned::of(lse)?)];
    safetensors::serialize(ts, metadata).map_err(|e| file_err("result", e))
}

/// Write a result file.
pub fn write_result(
    path: impl AsRef<Path>,
    out: &Tensor,
    lse: &Tensor,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let p = path.as_ref();
    std::fs::write(p, result_bytes(out, lse, metadata)?)
        .map_err(|e| file_err(&p.display().to_string(), format!("cannot write: {e}")))
}

/// Parse a result file's bytes into host `(out, lse)`.
pub fn read_result_bytes(bytes: &[u8], name: &str) -> Result<(Tensor, Tensor)> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| file_err(name, format!("not a safetensors file: {e}")))?;
    let get = |n: &str| -> Result<Tensor> {
        let t = st.tensor(n).map_err(|_| bad(n, "(missing)", "a result file holds `out` and `lse`"))?;
        to_tensor(n, &t)
    };
    let (out, lse) = (get("out")?, get("lse")?);
    if lse.dtype() != DType::F32 {
        return Err(bad("lse.dtype", lse.dtype(), "must be F32"));
    }
    Ok((out, lse))
}

/// Read a result file into host `(out, lse)`.
pub fn read_result(path: impl AsRef<Path>) -> Result<(Tensor, Tensor)> {
    let p = path.as_ref();
    let name = p.display().to_string();
    let bytes = std::fs::read(p).map_err(|e| file_err(&name, format!("cannot read: {e}")))?;
    read_result_bytes(&bytes, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::from_f32(shape, DType::F32, &(0..n).map(|i| (i as f32 * 0.731).sin()).collect::<Vec<_>>()).unwrap()
    }

    fn raw(n: usize, dtype: StDtype, shape: Vec<usize>) -> Owned {
        Owned::new(dtype, shape, vec![0x3c; n])
    }

    /// A valid paged file's tensors and metadata, to break one piece at a time.
    fn paged_parts() -> (Vec<(String, Owned)>, HashMap<String, String>) {
        let i = |v: Vec<i32>| Owned::new(StDtype::I32, vec![v.len()], HostData::I32(v).to_le_bytes());
        let ts = vec![
            ("q".to_string(), Owned::of(&f32s(&[3, 4, 8])).unwrap()),
            ("k_cache".to_string(), Owned::of(&f32s(&[4, 2, 2, 8])).unwrap()),
            ("v_cache".to_string(), Owned::of(&f32s(&[4, 2, 2, 8])).unwrap()),
            ("cu_seqlens_q".to_string(), i(vec![0, 1, 3])),
            (
                "block_table".to_string(),
                Owned::new(StDtype::I32, vec![2, 2], HostData::I32(vec![3, 1, 0, 2]).to_le_bytes()),
            ),
            ("seq_lens".to_string(), i(vec![3, 4])),
        ];
        let md = [("layout", "paged"), ("causal", "true"), ("window_left", "2"), ("softcap", "20")]
            .into_iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        (ts, md)
    }

    fn parse(ts: Vec<(String, Owned)>, md: Option<HashMap<String, String>>) -> Result<Case> {
        let bytes = safetensors::serialize(ts, md).unwrap();
        Case::from_bytes(&bytes, "t.safetensors")
    }

    fn err_of(ts: Vec<(String, Owned)>, md: Option<HashMap<String, String>>) -> String {
        match parse(ts, md) {
            Ok(_) => panic!("a malformed case file was accepted"),
            Err(e) => e.to_string(),
        }
    }

    fn assert_mentions(err: &str, words: &[&str]) {
        for w in words {
            assert!(err.contains(w), "error {err:?} does not mention {w:?}");
        }
    }

    #[test]
    fn a_valid_paged_file_reads_and_runs() {
        let (ts, md) = paged_parts();
        let c = parse(ts, Some(md)).unwrap();
        assert_eq!(c.layout, LayoutKind::Paged);
        assert_eq!(c.max_blocks, 2);
        assert_eq!(c.block_table, vec![3, 1, 0, 2]);
        assert_eq!(c.params.window_left, Some(2));
        assert_eq!(c.params.softcap, Some(20.0));
        assert!(c.params.causal);
        assert_eq!(c.lse_shape(), vec![4, 3]);
        let be = crate::reference::ReferenceBackend::new().unwrap();
        use crate::AttentionBackend;
        let r = be.forward(&c.call().with_lse(true), None, None).unwrap();
        assert_eq!(r.lse.unwrap().shape(), &[4, 3]);
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let (ts, md) = paged_parts();
        let mut c = parse(ts, Some(md)).unwrap();
        c.alibi_slopes = Some(vec![0.5, 0.25, 0.125, 0.0625]);
        c.params.scale = Some(0.3);
        c.params.window_right = Some(0);
        let d = Case::from_bytes(&c.to_bytes().unwrap(), "x").unwrap();
        assert_eq!(d.params, c.params);
        assert_eq!(d.alibi_slopes, c.alibi_slopes);
        assert_eq!((d.block_table, d.max_blocks, d.seq_lens), (c.block_table, c.max_blocks, c.seq_lens));
        assert_eq!(d.q.host(), c.q.host());
        assert_eq!(d.k.host(), c.k.host());
    }

    #[test]
    fn not_a_safetensors_file() {
        for bytes in [&b""[..], b"hello world, not safetensors", &[0xff; 64]] {
            let e = Case::from_bytes(bytes, "junk.bin").unwrap_err();
            assert!(matches!(e, Error::File { .. }), "{e}");
            assert_mentions(&e.to_string(), &["junk.bin", "not a safetensors file"]);
        }
        // A header that promises more data than there is.
        let mut b = paged_parts_bytes();
        b.truncate(b.len() - 5);
        assert_mentions(&Case::from_bytes(&b, "cut.safetensors").unwrap_err().to_string(), &["cut.safetensors"]);
    }

    fn paged_parts_bytes() -> Vec<u8> {
        let (ts, md) = paged_parts();
        safetensors::serialize(ts, Some(md)).unwrap()
    }

    #[test]
    fn missing_tensor() {
        let (mut ts, md) = paged_parts();
        ts.retain(|(n, _)| n != "block_table");
        let e = err_of(ts, Some(md));
        assert_mentions(&e, &["block_table", "missing", "paged"]);
    }

    #[test]
    fn unknown_and_unexpected_tensors() {
        let (mut ts, md) = paged_parts();
        ts.push(("cu_seqlen_k".into(), raw(12, StDtype::I32, vec![3])));
        assert_mentions(&err_of(ts, Some(md)), &["cu_seqlen_k", "unknown tensor"]);
        let (mut ts, md) = paged_parts();
        ts.push(("cu_seqlens_k".into(), raw(12, StDtype::I32, vec![3])));
        assert_mentions(&err_of(ts, Some(md)), &["cu_seqlens_k", "unexpected", "paged"]);
    }

    #[test]
    fn wrong_dtypes() {
        // cu_seqlens as float, block_table as i64, q as f64, alibi as f16.
        let cases: Vec<(&str, Owned, &[&str])> = vec![
            ("cu_seqlens_q", raw(12, StDtype::F32, vec![3]), &["cu_seqlens_q.dtype", "F32", "I32"]),
            ("block_table", raw(32, StDtype::I64, vec![2, 2]), &["block_table.dtype", "I64", "I32"]),
            ("q", raw(3 * 4 * 8 * 8, StDtype::F64, vec![3, 4, 8]), &["q.dtype", "F64", "F32, F16 or BF16"]),
            ("q", raw(3 * 4 * 8 * 4, StDtype::I32, vec![3, 4, 8]), &["q.dtype", "I32"]),
            ("seq_lens", raw(16, StDtype::U64, vec![2]), &["seq_lens.dtype", "U64"]),
            ("alibi_slopes", raw(8, StDtype::F16, vec![4]), &["alibi_slopes.dtype", "F16", "F32"]),
        ];
        for (name, t, words) in cases {
            let (mut ts, md) = paged_parts();
            ts.retain(|(n, _)| n != name);
            ts.push((name.to_string(), t));
            assert_mentions(&err_of(ts, Some(md)), words);
        }
    }

    #[test]
    fn wrong_metadata_ranks() {
        let (mut ts, md) = paged_parts();
        ts.retain(|(n, _)| n != "block_table");
        ts.push((
            "block_table".into(),
            Owned::new(StDtype::I32, vec![4], HostData::I32(vec![3, 1, 0, 2]).to_le_bytes()),
        ));
        let e = parse(ts, Some(md)).unwrap_err();
        assert!(matches!(e, Error::Shape { arg: "block_table", .. }), "{e}");
    }

    #[test]
    fn bad_metadata_strings() {
        let cases: &[(&str, &str, &[&str])] = &[
            ("layout", "ragged", &["layout", "\"ragged\"", "dense"]),
            ("causal", "yes", &["causal", "\"yes\"", "true"]),
            ("causal", "True", &["causal", "\"True\""]),
            ("window_left", "-1", &["window_left", "\"-1\"", "non-negative"]),
            ("window_right", "abc", &["window_right", "\"abc\""]),
            ("softcap", "nan", &["softcap", "\"nan\"", "finite"]),
            ("scale", "1/8", &["scale", "\"1/8\""]),
            ("windowleft", "3", &["windowleft", "unknown key"]),
        ];
        for (key, value, words) in cases {
            let (ts, mut md) = paged_parts();
            md.insert(key.to_string(), value.to_string());
            assert_mentions(&err_of(ts, Some(md)), words);
        }
    }

    #[test]
    fn missing_metadata() {
        for key in ["layout", "causal"] {
            let (ts, mut md) = paged_parts();
            md.remove(key);
            assert_mentions(&err_of(ts, Some(md)), &[key, "missing"]);
        }
        let (ts, _) = paged_parts();
        assert_mentions(&err_of(ts, None), &["layout", "missing"]);
    }

    #[test]
    fn a_case_that_reads_still_goes_through_validation() {
        // Non-monotone cu_seqlens_q is a value problem: the file reads, forward rejects it.
        let (mut ts, md) = paged_parts();
        ts.retain(|(n, _)| n != "cu_seqlens_q");
        ts.push(("cu_seqlens_q".into(), Owned::new(StDtype::I32, vec![3], HostData::I32(vec![0, 3, 1]).to_le_bytes())));
        let c = parse(ts, Some(md)).unwrap();
        let be = crate::reference::ReferenceBackend::new().unwrap();
        use crate::AttentionBackend;
        let e = be.forward(&c.call(), None, None).unwrap_err().to_string();
        assert_mentions(&e, &["cu_seqlens_q[2]", "1"]);
    }

    #[test]
    fn result_files() {
        let out = Tensor::from_f32(&[2, 3], DType::BF16, &[1.0, -2.0, 3.0, 0.5, 0.25, 8.0]).unwrap();
        let lse = f32s(&[3, 2]);
        let b = result_bytes(&out, &lse, None).unwrap();
        let (o, l) = read_result_bytes(&b, "r").unwrap();
        assert_eq!(o.dtype(), DType::BF16);
        assert_eq!(o.host(), out.host());
        assert_eq!(l.host(), lse.host());
        assert!(result_bytes(&out, &out, None).is_err());
        let e = read_result_bytes(&paged_parts_bytes(), "r").unwrap_err().to_string();
        assert_mentions(&e, &["out", "missing"]);
    }
}
