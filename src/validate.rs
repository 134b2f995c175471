//! The one place a call is checked, before any backend runs, and the shape math every backend shares.

use crate::call::{AttnCall, Layout, LayoutKind, Params, Problem};
use crate::error::{Error, Result};
use crate::types::{DType, Device, Tensor};

/// A call that passed validation, with its derived sizes. Building it allocates nothing.
#[derive(Clone, Copy, Debug)]
pub struct Checked<'a> {
    /// The call.
    pub call: &'a AttnCall<'a>,
    /// Layout kind.
    pub kind: LayoutKind,
    /// Input dtype.
    pub dtype: DType,
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Head dim.
    pub d: usize,
    /// Query rows of the q tensor (`B*Sq` dense, `Tq` otherwise).
    pub total_q: usize,
    /// Dense `Sq` (0 for other layouts).
    pub dense_sq: usize,
    /// Dense `Sk` (0 for other layouts).
    pub dense_sk: usize,
    /// Longest query sequence.
    pub max_q: usize,
    /// Longest key sequence.
    pub max_k: usize,
    /// Paged block size (0 otherwise).
    pub block_size: usize,
    /// Paged block count (0 otherwise).
    pub num_blocks: usize,
    /// Resolved score scale.
    pub scale: f32,
}

/// One sequence of a batch: where its queries and keys are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    /// First q row (token index into the q tensor's leading rows).
    pub q_start: usize,
    /// Queries.
    pub q_len: usize,
    /// First k row for dense/varlen (0 for paged: use [`Checked::k_row`]).
    pub k_start: usize,
    /// Keys.
    pub k_len: usize,
}

impl Seq {
    /// `[lo, hi)`: the keys visible to query `i`; every mask of the contract is an interval.
    pub fn key_range(&self, i: usize, p: &Params) -> (usize, usize) {
        key_range(i, self.q_len, self.k_len, p)
    }
}

/// `[lo, hi)` of keys visible to query `i` of `sq` queries over `sk` keys (bottom-right aligned).
pub fn key_range(i: usize, sq: usize, sk: usize, p: &Params) -> (usize, usize) {
    let ia = i as i64 + sk as i64 - sq as i64;
    let mut lo: i64 = 0;
    let mut hi: i64 = sk as i64; // exclusive
    if p.causal {
        hi = hi.min(ia + 1);
    }
    if let Some(wl) = p.window_left {
        lo = lo.max(ia - wl as i64);
    }
    if let Some(wr) = p.window_right {
        hi = hi.min(ia.saturating_add(wr as i64).saturating_add(1));
    }
    if hi <= lo {
        (0, 0)
    } else {
        (lo as usize, hi as usize)
    }
}

impl<'a> Checked<'a> {
    /// Sequence `b`.
    #[inline]
    pub fn seq(&self, b: usize) -> Seq {
        match self.call.layout {
            Layout::Dense => Seq {
                q_start: b * self.dense_sq,
                q_len: self.dense_sq,
                k_start: b * self.dense_sk,
                k_len: self.dense_sk,
            },
            Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
                let (q0, q1) = (cu_seqlens_q[b] as usize, cu_seqlens_q[b + 1] as usize);
                let (k0, k1) = (cu_seqlens_k[b] as usize, cu_seqlens_k[b + 1] as usize);
                Seq { q_start: q0, q_len: q1 - q0, k_start: k0, k_len: k1 - k0 }
            }
            Layout::Paged { cu_seqlens_q, seq_lens, .. } => {
                let (q0, q1) = (cu_seqlens_q[b] as usize, cu_seqlens_q[b + 1] as usize);
                Seq { q_start: q0, q_len: q1 - q0, k_start: 0, k_len: seq_lens[b] as usize }
            }
        }
    }
    /// Row of key/value token `t` of sequence `b` in the k/v tensor seen as `[rows, Hkv, D]`.
    #[inline]
    pub fn k_row(&self, b: usize, seq: &Seq, t: usize) -> usize {
        match self.call.layout {
            Layout::Paged { block_table, max_blocks, .. } => {
                let blk = block_table[b * max_blocks + t / self.block_size] as usize;
                blk * self.block_size + t % self.block_size
            }
            _ => seq.k_start + t,
        }
    }
    /// Index into lse of query `i` of sequence `seq` (`b`), head `h`.
    #[inline]
    pub fn lse_index(&self, b: usize, seq: &Seq, h: usize, i: usize) -> usize {
        match self.kind {
            LayoutKind::Dense => (b * self.hq + h) * self.dense_sq + i,
            _ => h * self.total_q + seq.q_start + i,
        }
    }
    /// The lse shape of this call.
    pub fn lse_shape(&self) -> [usize; 3] {
        match self.kind {
            LayoutKind::Dense => [self.batch, self.hq, self.dense_sq],
            _ => [1, self.hq, self.total_q],
        }
    }
    /// The lse shape of this call as the contract writes it: `[B, Hq, Sq]` dense, `[Hq, Tq]` otherwise.
    pub fn lse_shape_vec(&self) -> Vec<usize> {
        let [a, b, c] = self.lse_shape();
        match self.kind {
            LayoutKind::Dense => vec![a, b, c],
            _ => vec![b, c],
        }
    }
    /// The problem, for capability checks.
    pub fn problem(&self, lse: bool) -> Problem {
        let p = &self.call.params;
        Problem {
            dtype: self.dtype,
            head_dim: self.d,
            layout: self.kind,
            num_heads_q: self.hq,
            num_heads_kv: self.hkv,
            causal: p.causal,
            window: p.window_left.is_some() || p.window_right.is_some(),
            softcap: p.softcap.is_some(),
            alibi: self.call.alibi_slopes.is_some(),
            lse,
        }
    }
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.hq / self.hkv
    }
}

fn rank_err(arg: &'static str, t: &Tensor, expected: &str) -> Error {
    Error::Shape { arg, got: t.shape().to_vec(), expected: expected.to_string() }
}

fn check_float(arg: &'static str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        got => Err(Error::DType { arg, got, expected: "f32, f16 or bf16".into() }),
    }
}

fn check_device(arg: &'static str, t: &Tensor, device: Device, backend: &'static str) -> Result<()> {
    if t.device() != device {
        return Err(Error::Device { arg, got: t.device(), expected: device, backend });
    }
    Ok(())
}

fn to_usize(arg: &str, i: usize, v: i32) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::value(format!("{arg}[{i}]"), v, "must be >= 0"))
}

/// Check prefix sums: length `batch + 1` (or any when `batch` is None), first 0, non-decreasing, last `total`.
fn check_cu(arg: &'static str, cu: &[i32], batch: Option<usize>, total: usize) -> Result<usize> {
    if cu.is_empty() {
        return Err(Error::value(arg, "[]", "needs B+1 >= 1 entries"));
    }
    if let Some(b) = batch {
        if cu.len() != b + 1 {
            return Err(Error::value(format!("{arg}.len()"), cu.len(), format!("must be B+1 = {}", b + 1)));
        }
    }
    if cu[0] != 0 {
        return Err(Error::value(format!("{arg}[0]"), cu[0], "must be 0"));
    }
    let mut max = 0;
    for i in 1..cu.len() {
        if cu[i] < cu[i - 1] {
            return Err(Error::value(
                format!("{arg}[{i}]"),
                cu[i],
                format!("is less than {arg}[{}] = {}: prefix sums must not decrease", i - 1, cu[i - 1]),
            ));
        }
        max = max.max((cu[i] - cu[i - 1]) as usize);
    }
    let last = *cu.last().unwrap_or(&0);
    if last as usize != total || last < 0 {
        return Err(Error::value(
            format!("{arg}[{}]", cu.len() - 1),
            last,
            format!("must equal the token count {total}"),
        ));
    }
    Ok(max)
}

/// Validate a call against the contract for a backend on `device`, with optional output buffers.
/// Every backend calls this (through the provided `forward`), so the same bad input gets the same error.
pub fn validate<'a>(
    call: &'a AttnCall<'a>,
    device: Device,
    backend: &'static str,
    out: Option<&Tensor>,
    lse: Option<&Tensor>,
) -> Result<Checked<'a>> {
    let (q, k, v) = (call.q, call.k, call.v);
    check_float("q", q)?;
    let (k_name, v_name) = match call.layout {
        Layout::Paged { .. } => ("k_cache", "v_cache"),
        _ => ("k", "v"),
    };
    for (name, t) in [(k_name, k), (v_name, v)] {
        if t.dtype() != q.dtype() {
            return Err(Error::DType {
                arg: name,
                got: t.dtype(),
                expected: format!("{} (the dtype of q)", q.dtype()),
            });
        }
    }
    check_device("q", q, device, backend)?;
    check_device(k_name, k, device, backend)?;
    check_device(v_name, v, device, backend)?;
    if k.shape() != v.shape() {
        return Err(Error::Shape {
            arg: v_name,
            got: v.shape().to_vec(),
            expected: format!("{:?} (the shape of {k_name})", k.shape()),
        });
    }
    let kind = call.layout.kind();
    let (q_rank, kv_rank) = match kind {
        LayoutKind::Dense => (4, 4),
        LayoutKind::Varlen => (3, 3),
        LayoutKind::Paged => (3, 4),
    };
    let q_expect = if q_rank == 4 { "[B, Sq, Hq, D]" } else { "[Tq, Hq, D]" };
    let kv_expect = match kind {
        LayoutKind::Dense => "[B, Sk, Hkv, D]",
        LayoutKind::Varlen => "[Tk, Hkv, D]",
        LayoutKind::Paged => "[num_blocks, block_size, Hkv, D]",
    };
    if q.shape().len() != q_rank {
        return Err(rank_err("q", q, q_expect));
    }
    if k.shape().len() != kv_rank {
        return Err(rank_err(k_name, k, kv_expect));
    }
    let qs = q.shape();
    let ks = k.shape();
    let (hq, d) = (qs[q_rank - 2], qs[q_rank - 1]);
    let (hkv, dk) = (ks[kv_rank - 2], ks[kv_rank - 1]);
    if d == 0 {
        return Err(Error::value("q.shape[-1] (D)", d, "head dim must be >= 1"));
    }
    if dk != d {
        return Err(Error::Shape {
            arg: k_name,
            got: ks.to_vec(),
            expected: format!("{kv_expect} with D = {d} (the head dim of q)"),
        });
    }
    if hq == 0 {
        return Err(Error::value("q.shape (Hq)", hq, "needs at least one query head"));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(Error::value(
            format!("{k_name}.shape (Hkv)"),
            hkv,
            format!("Hq = {hq} must be a positive multiple of Hkv"),
        ));
    }

    let mut c = Checked {
        call,
        kind,
        dtype: q.dtype(),
        batch: 0,
        hq,
        hkv,
        d,
        total_q: qs[0],
        dense_sq: 0,
        dense_sk: 0,
        max_q: 0,
        max_k: 0,
        block_size: 0,
        num_blocks: 0,
        scale: 0.0,
    };
    match call.layout {
        Layout::Dense => {
            if ks[0] != qs[0] {
                return Err(Error::Shape {
                    arg: k_name,
                    got: ks.to_vec(),
                    expected: format!("{kv_expect} with B = {} (the batch of q)", qs[0]),
                });
            }
            c.batch = qs[0];
            c.dense_sq = qs[1];
            c.dense_sk = ks[1];
            c.total_q = qs[0] * qs[1];
            c.max_q = qs[1];
            c.max_k = ks[1];
        }
        Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
            c.batch = cu_seqlens_q.len().saturating_sub(1);
            c.max_q = check_cu("cu_seqlens_q", cu_seqlens_q, None, qs[0])?;
            c.max_k = check_cu("cu_seqlens_k", cu_seqlens_k, Some(c.batch), ks[0])?;
        }
        Layout::Paged { cu_seqlens_q, block_table, max_blocks, seq_lens } => {
            c.batch = cu_seqlens_q.len().saturating_sub(1);
            c.max_q = check_cu("cu_seqlens_q", cu_seqlens_q, None, qs[0])?;
            c.num_blocks = ks[0];
            c.block_size = ks[1];
            if c.block_size == 0 {
                return Err(Error::value("k_cache.shape[1] (block_size)", 0, "must be >= 1"));
            }
            if seq_lens.len() != c.batch {
                return Err(Error::value(
                    "seq_lens.len()",
                    seq_lens.len(),
                    format!("must be B = {} (cu_seqlens_q has B+1 entries)", c.batch),
                ));
            }
            if Some(block_table.len()) != c.batch.checked_mul(max_blocks) {
                return Err(Error::value(
                    "block_table.len()",
                    block_table.len(),
                    format!("must be B * max_blocks = {} * {max_blocks}", c.batch),
                ));
            }
            for (b, &len) in seq_lens.iter().enumerate() {
                let len = to_usize("seq_lens", b, len)?;
                let need = len.div_ceil(c.block_size);
                if need > max_blocks {
                    return Err(Error::value(
                        format!("seq_lens[{b}]"),
                        len,
                        format!("needs {need} blocks of {} but block_table has {max_blocks} columns", c.block_size),
                    ));
                }
                for j in 0..need {
                    let blk = block_table[b * max_blocks + j];
                    if blk < 0 || blk as usize >= c.num_blocks {
                        return Err(Error::value(
                            format!("block_table[{b}][{j}]"),
                            blk,
                            format!("must be in 0..{} (num_blocks)", c.num_blocks),
                        ));
                    }
                }
                c.max_k = c.max_k.max(len);
            }
        }
    }

    if let Some(s) = call.alibi_slopes {
        if s.len() != hq {
            return Err(Error::value("alibi_slopes.len()", s.len(), format!("must be Hq = {hq}")));
        }
        if let Some((h, x)) = s.iter().enumerate().find(|(_, x)| !x.is_finite()) {
            return Err(Error::value(format!("alibi_slopes[{h}]"), x, "must be finite"));
        }
    }
    let p = &call.params;
    if let Some(sc) = p.softcap {
        if !(sc.is_finite() && sc > 0.0) {
            return Err(Error::value("softcap", sc, "must be finite and > 0"));
        }
    }
    c.scale = match p.scale {
        Some(s) if !s.is_finite() => return Err(Error::value("scale", s, "must be finite")),
        Some(s) => s,
        None => 1.0 / (d as f32).sqrt(),
    };

    if let Some(o) = out {
        if o.shape() != qs {
            return Err(Error::Shape {
                arg: "out",
                got: o.shape().to_vec(),
                expected: format!("{qs:?} (the shape of q)"),
            });
        }
        if o.dtype() != q.dtype() {
            return Err(Error::DType {
                arg: "out",
                got: o.dtype(),
                expected: format!("{} (the dtype of q)", q.dtype()),
            });
        }
        check_device("out", o, device, backend)?;
    }
    if let Some(l) = lse {
        let [a, b, cc] = c.lse_shape();
        let ok = match kind {
            LayoutKind::Dense => l.shape() == [a, b, cc],
            _ => l.shape() == [b, cc],
        };
        if !ok {
            let expected = match kind {
                LayoutKind::Dense => format!("[B, Hq, Sq] = {:?}", [a, b, cc]),
                _ => format!("[Hq, Tq] = {:?}", [b, cc]),
            };
            return Err(Error::Shape { arg: "lse", got: l.shape().to_vec(), expected });
        }
        if l.dtype() != DType::F32 {
            return Err(Error::DType { arg: "lse", got: l.dtype(), expected: "f32".into() });
        }
        check_device("lse", l, device, backend)?;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::visible;
    use crate::types::Tensor;

    #[test]
    fn key_range_is_the_visible_set() {
        for sq in 0..7 {
            for sk in 0..9 {
                for causal in [false, true] {
                    for wl in [None, Some(0), Some(2)] {
                        for wr in [None, Some(0), Some(3)] {
                            let p = Params { causal, window_left: wl, window_right: wr, ..Params::default() };
                            for i in 0..sq {
                                let (lo, hi) = key_range(i, sq, sk, &p);
                                for j in 0..sk {
                                    assert_eq!(
                                        (lo..hi).contains(&j),
                                        visible(i, j, sq, sk, &p),
                                        "{sq} {sk} {p:?} i={i} j={j}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    fn t(shape: &[usize]) -> Tensor {
        Tensor::zeros(shape, DType::F16)
    }

    fn err(call: &AttnCall<'_>) -> String {
        validate(call, Device::Host, "test", None, None).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_argument_and_value() {
        let (q, k) = (t(&[5, 4, 8]), t(&[9, 2, 8]));
        assert!(err(&AttnCall::varlen(&q, &k, &k, &[0, 3, 2, 5], &[0, 4, 5, 9])).contains("`cu_seqlens_q[2]` = 2"));
        assert!(err(&AttnCall::varlen(&q, &k, &k, &[0, 5], &[0, 8])).contains("`cu_seqlens_k[1]` = 8"));
        let k3 = t(&[9, 3, 8]);
        assert!(err(&AttnCall::varlen(&q, &k3, &k3, &[0, 5], &[0, 9])).contains("Hkv"));
        let kc = t(&[4, 16, 2, 8]);
        let e = err(&AttnCall::paged(&q, &kc, &kc, &[0, 5], &[0, 4], 2, &[20]));
        assert!(e.contains("`block_table[0][1]` = 4"), "{e}");
        let e = err(&AttnCall::paged(&q, &kc, &kc, &[0, 5], &[0, 1], 2, &[33]));
        assert!(e.contains("`seq_lens[0]` = 33"), "{e}");
        let e = err(&AttnCall::paged(&q, &kc, &kc, &[0, 5], &[0, 1], usize::MAX, &[3]));
        assert!(e.contains("block_table.len()"), "{e}");
        let q4 = t(&[1, 5, 4, 8]);
        let k4 = Tensor::zeros(&[1, 5, 2, 8], DType::F32);
        assert!(err(&AttnCall::dense(&q4, &k4, &k4)).contains("`k` has dtype f32"));
        let k4 = t(&[1, 5, 2, 8]);
        assert!(err(&AttnCall::dense(&q4, &k4, &k4).softcap(Some(-1.0))).contains("`softcap` = -1"));
        let out = t(&[1, 5, 4, 4]);
        let call = AttnCall::dense(&q4, &k4, &k4);
        let e = validate(&call, Device::Host, "test", Some(&out), None).unwrap_err().to_string();
        assert!(e.contains("`out` has shape [1, 5, 4, 4]"), "{e}");
    }
}
