//! Kernel parameters, kernel traits (tile shapes per head dim) and the launch plan of a call.

use cudarc::driver::DeviceRepr;

use super::nvrtc::Family;
use crate::types::DType;
use crate::validate::Checked;

/// Mirrors `struct AttnParams` in kernels/common.cuh, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct KernelParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub o_part: u64,
    pub lse_part: u64,
    pub cu_q: u64,
    pub cu_k: u64,
    pub block_table: u64,
    pub seq_lens: u64,
    pub alibi: u64,
    pub q_stride: i64,
    pub kv_stride: i64,
    pub batch: i32,
    pub hq: i32,
    pub hkv: i32,
    pub d: i32,
    pub group: i32,
    pub layout: i32,
    pub dense_sq: i32,
    pub dense_sk: i32,
    pub block_size: i32,
    pub max_blocks: i32,
    pub total_q: i32,
    pub causal: i32,
    pub window_left: i32,
    pub window_right: i32,
    pub num_splits: i32,
    pub pad0: i32,
    pub scale: f32,
    pub softcap: f32,
    pub scale_log2: f32,
    pub pad1: f32,
}

// SAFETY: a plain `repr(C)` struct of integers and floats, laid out exactly as the kernels'
// `AttnParams` (8-byte fields first, no implicit padding: 12 * 8 + 2 * 8 + 20 * 4 bytes).
unsafe impl DeviceRepr for KernelParams {}

const _: () = assert!(std::mem::size_of::<KernelParams>() == 192);

/// One compiled kernel: its family and the macros it was specialised with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Source family.
    pub family: Family,
    /// `-D` macros.
    pub defines: Vec<(&'static str, i64)>,
}

impl Variant {
    /// A stable name for caches and reports: `attn_mma[ATTN_DTYPE=2,DPAD=128,...]`.
    pub fn key(&self) -> String {
        let d: Vec<String> = self.defines.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{}[{}]", self.family.file().trim_end_matches(".cu"), d.join(","))
    }
}

pub(crate) fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        _ => 2,
    }
}

/// Tensor-core tile shape: rows per CTA, keys per tile, warps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaTraits {
    /// Padded head dim (32, 64, 128, 192, 256).
    pub dpad: usize,
    /// Query rows per CTA.
    pub bm: usize,
    /// Keys per tile.
    pub bn: usize,
    /// Warps per CTA.
    pub nw: usize,
}

impl MmaTraits {
    /// Dynamic shared memory: Q tile plus two stages of K and V.
    pub fn smem_bytes(&self) -> usize {
        (self.bm + 4 * self.bn) * self.dpad * 2
    }
}

/// Padded head dim of the tensor-core kernel for `d` (a multiple of 8).
pub fn mma_dpad(d: usize) -> usize {
    match d {
        0..=32 => 32,
        33..=64 => 64,
        65..=128 => 128,
        129..=192 => 192,
        _ => 256,
    }
}

/// Kernel traits per padded head dim. ATTNKIT_CUDA_TILE=BM,BN,NW overrides them (for tuning).
/// These are FlashAttention-2's for sm80+: 128x64 with 4 warps up to d 128 (32 rows per warp,
/// so each K fragment feeds two MMAs), 128x64 with 8 warps above (252 registers at d 256, no
/// spills). They are the traits the conformance suite passed with on an H200. They are not the
/// fastest there: NVRTC for sm_90 reports 229 / 255 registers at d 64 / 128 (~110 bytes of
/// spills at d 128), and the same run timed d 64 at 84.8 TFLOP/s with them against 110.9 with
/// 64x64 and 4 warps (180 registers at d 128, no spills); that shape becomes the default once
/// the suite has run with it on the device. docs/PERF_NOTES.md has the sweep.
pub fn mma_traits(d: usize) -> MmaTraits {
    let dpad = mma_dpad(d);
    if let Ok(s) = std::env::var("ATTNKIT_CUDA_TILE") {
        let v: Vec<usize> = s.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        if let [bm, bn, nw] = v[..] {
            if bm % (16 * nw) == 0 && bn % 16 == 0 && bm > 0 && bn > 0 && nw > 0 {
                return MmaTraits { dpad, bm, bn, nw };
            }
        }
    }
    match dpad {
        32 | 64 | 128 => MmaTraits { dpad, bm: 128, bn: 64, nw: 4 },
        _ => MmaTraits { dpad, bm: 128, bn: 64, nw: 8 },
    }
}

/// Which kernel runs a call, and how.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// CUDA-core kernel; DMAX is the accumulator class.
    Simt {
        /// 32, 64, 128 or 256.
        dmax: usize,
    },
    /// Split-KV decode.
    Decode {
        /// Lanes per key.
        lpk: usize,
        /// Query rows per kv head class (1, 2, 4, 8).
        rmax: usize,
        /// Key splits per (sequence, kv head).
        splits: usize,
    },
    /// Tensor-core kernel.
    Mma(MmaTraits),
}

/// Rows (queries times GQA group) the decode kernel takes per kv head.
pub const DECODE_MAX_ROWS: usize = 8;

impl Plan {
    /// The compiled kernel this plan launches (the combine kernel lives in the decode variant).
    pub fn variant(&self, dtype: DType) -> Variant {
        let dt = dtype_code(dtype);
        match *self {
            Plan::Simt { dmax } => {
                Variant { family: Family::Simt, defines: vec![("ATTN_DTYPE", dt), ("DMAX", dmax as i64)] }
            }
            Plan::Decode { lpk, rmax, .. } => Variant {
                family: Family::Decode,
                defines: vec![("ATTN_DTYPE", dt), ("LPK", lpk as i64), ("RMAX", rmax as i64)],
            },
            Plan::Mma(t) => Variant {
                family: Family::Mma,
                defines: vec![
                    ("ATTN_DTYPE", dt),
                    ("DPAD", t.dpad as i64),
                    ("BM", t.bm as i64),
                    ("BN", t.bn as i64),
                    ("NW", t.nw as i64),
                ],
            },
        }
    }
    /// f32 elements of split-KV workspace this plan needs.
    pub fn workspace_elems(&self, c: &Checked<'_>) -> usize {
        match *self {
            Plan::Decode { splits, .. } if splits > 1 => splits * c.total_q * c.hq * (c.d + 1),
            _ => 0,
        }
    }
}

fn simt_dmax(d: usize) -> usize {
    match d {
        0..=32 => 32,
        33..=64 => 64,
        65..=128 => 128,
        _ => 256,
    }
}

/// Choose the kernel: decode when every kv head has at most [`DECODE_MAX_ROWS`] query rows,
/// else the tensor cores for f16/bf16, else CUDA cores. `force` (ATTNKIT_CUDA_KERNEL) picks
/// `simt`, `mma` or `decode` where that kernel can run the call.
pub fn plan(c: &Checked<'_>, sms: usize, force: Option<&str>) -> Plan {
    let rows = c.max_q * c.group();
    let decode_ok = rows <= DECODE_MAX_ROWS;
    let mma_ok = matches!(c.dtype, DType::F16 | DType::BF16);
    let simt = Plan::Simt { dmax: simt_dmax(c.d) };
    let decode = || {
        let rmax = rows.max(1).next_power_of_two();
        let lpk = (c.d / 8).max(1).next_power_of_two();
        let ctas = (c.batch * c.hkv).max(1);
        // About three CTAs per SM, each split keeping at least 256 keys (the planner the suite
        // passed with on an H200). More CTAs should help batch-1 decode (13 splits reached 2.9 of
        // FA2's 3.8 TB/s there); ATTNKIT_CUDA_SPLIT_TARGET scales the target for that sweep.
        let mult = std::env::var("ATTNKIT_CUDA_SPLIT_TARGET").ok().and_then(|s| s.parse().ok()).unwrap_or(3usize);
        let target = mult.max(1) * sms.max(1);
        let by_len = (c.max_k / 256).max(1);
        let splits = if ctas >= target { 1 } else { target.div_ceil(ctas).min(by_len).clamp(1, 64) };
        Plan::Decode { lpk, rmax, splits }
    };
    match force {
        Some("simt") => return simt,
        Some("mma") if mma_ok => return Plan::Mma(mma_traits(c.d)),
        Some("decode") if decode_ok => return decode(),
        _ => {}
    }
    if decode_ok {
        decode()
    } else if mma_ok {
        Plan::Mma(mma_traits(c.d))
    } else {
        simt
    }
}

/// Every kernel variant the backend can launch for head dims `8..=256` (multiples of 8), with
/// the default kernel traits: what CI compiles.
pub fn all_variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for dmax in [32, 64, 128, 256] {
            v.push(Plan::Simt { dmax }.variant(dt));
        }
        for lpk in [1, 2, 4, 8, 16, 32] {
            for rmax in [1, 2, 4, 8] {
                v.push(Plan::Decode { lpk, rmax, splits: 1 }.variant(dt));
            }
        }
        if dt != DType::F32 {
            for dpad in [32, 64, 128, 192, 256] {
                v.push(Plan::Mma(mma_traits(dpad)).variant(dt));
            }
        }
    }
    v
}
