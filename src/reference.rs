//! The f64 reference: the contract of the SPEC written as plainly as it reads, used by every test.
//!
//! Visibility is decided key by key from the SPEC's three predicates, not from the interval
//! helper the fast backends use, so the two are checked against each other.

use crate::backend::{host_memory_impl, AttentionBackend};
use crate::call::{Capabilities, HeadDims, Params};
use crate::error::{Error, Result};
use crate::types::{Device, HostData, Tensor};
use crate::validate::Checked;

/// The SPEC's visibility rule for query `i` of `sq`, key `j` of `sk`.
pub fn visible(i: usize, j: usize, sq: usize, sk: usize, p: &Params) -> bool {
    let ia = i as i64 + sk as i64 - sq as i64;
    let j = j as i64;
    (!p.causal || j <= ia)
        && p.window_left.is_none_or(|wl| j >= ia - wl as i64)
        && p.window_right.is_none_or(|wr| j <= ia + wr as i64)
}

/// The f64 result of a validated call: `out` in the q layout, `lse` in the contract's lse layout.
pub fn attention_f64(c: &Checked<'_>) -> Result<(Vec<f64>, Vec<f64>)> {
    let q = c.call.q.to_f64_vec()?;
    let k = c.call.k.to_f64_vec()?;
    let v = c.call.v.to_f64_vec()?;
    let p = &c.call.params;
    let (hq, hkv, d) = (c.hq, c.hkv, c.d);
    let scale = c.scale as f64;
    let mut out = vec![0.0f64; c.total_q * hq * d];
    let mut lse = vec![f64::NEG_INFINITY; c.total_q * hq];
    let mut scores = Vec::new();
    for b in 0..c.batch {
        let seq = c.seq(b);
        let (sq, sk) = (seq.q_len, seq.k_len);
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..sq {
                let ia = i as i64 + sk as i64 - sq as i64;
                let qrow = &q[((seq.q_start + i) * hq + h) * d..][..d];
                scores.clear();
                for j in 0..sk {
                    if !visible(i, j, sq, sk, p) {
                        continue;
                    }
                    let krow = &k[(c.k_row(b, &seq, j) * hkv + kh) * d..][..d];
                    let mut s = scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>();
                    if let Some(cap) = p.softcap {
                        let cap = cap as f64;
                        s = cap * (s / cap).tanh();
                    }
                    if let Some(slopes) = c.call.alibi_slopes {
                        s -= slopes[h] as f64 * (ia - j as i64).abs() as f64;
                    }
                    scores.push((j, s));
                }
                if scores.is_empty() {
                    continue; // out stays 0, lse stays -inf
                }
                let m = scores.iter().fold(f64::NEG_INFINITY, |m, &(_, s)| m.max(s));
                let sum: f64 = scores.iter().map(|&(_, s)| (s - m).exp()).sum();
                let l = m + sum.ln();
                lse[c.lse_index(b, &seq, h, i)] = l;
                let o = &mut out[((seq.q_start + i) * hq + h) * d..][..d];
                for &(j, s) in &scores {
                    let w = (s - l).exp();
                    let vrow = &v[(c.k_row(b, &seq, j) * hkv + kh) * d..][..d];
                    for (o, &x) in o.iter_mut().zip(vrow) {
                        *o += w * x;
                    }
                }
            }
        }
    }
    Ok((out, lse))
}

/// The reference as a backend (host tensors, any head dim, every feature).
#[derive(Debug, Default)]
pub struct ReferenceBackend {
    _priv: (),
}

static REFERENCE_CAPS: Capabilities = Capabilities::full(HeadDims::UpTo(usize::MAX));

impl ReferenceBackend {
    /// The reference backend.
    pub fn new() -> Result<Self> {
        Ok(ReferenceBackend { _priv: () })
    }
}

impl AttentionBackend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn device(&self) -> Device {
        Device::Host
    }
    fn capabilities(&self) -> &Capabilities {
        &REFERENCE_CAPS
    }
    host_memory_impl!("reference");
    fn forward_into(&self, c: &Checked<'_>, out: &mut Tensor, lse: Option<&mut Tensor>) -> Result<()> {
        let (o, l) = attention_f64(c)?;
        let dtype = out.dtype();
        let od = out.host_mut().ok_or(Error::Backend { backend: "reference", msg: "out is not on the host".into() })?;
        *od = HostData::from_f64(dtype, &o);
        if let Some(lse) = lse {
            if let Some(HostData::F32(dst)) = lse.host_mut() {
                for (d, s) in dst.iter_mut().zip(&l) {
                    *d = *s as f32;
                }
            }
        }
        Ok(())
    }
}
