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
    pub bs_shift: i32,
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
    /// Whether this variant can be built for `arch` (`sm_80`): the Hopper variants (`WG=1`,
    /// or bulk copies, `BULK` above 0) only for sm_90.
    pub fn runs_on(&self, arch: &str) -> bool {
        let hopper_only = self.defines.iter().any(|&(k, v)| (k == "WG" && v == 1) || (k == "BULK" && v > 0));
        !hopper_only || arch == "sm_90"
    }
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
    /// CTAs per SM the compiler must fit (`__launch_bounds__`' second argument: it caps the
    /// registers at 64K / (threads * minb)).
    pub minb: usize,
    /// Whether the call needs the score transform (softcap, ALiBi, or a scale that is not
    /// positive): a separate variant, so the common path carries none of it.
    pub post: bool,
    /// Hopper warpgroup MMAs (`wgmma`, sm_90a) instead of `mma.sync`: whole warpgroups of 64
    /// rows (`bm == 16 * nw`, `nw` a multiple of 4), `dpad >= 64`, `bn` 64 or 128.
    pub wg: bool,
    /// K/V tiles filled by bulk copies (`cp.async.bulk`, sm_90; one copy per row, rows padded by
    /// 16 bytes) in this many stages (2 to 4), or 0 for 16-byte `cp.async` copies into two
    /// swizzled stages. `mma.sync` tiles only.
    pub bulk: usize,
}

impl MmaTraits {
    /// Dynamic shared memory: Q tile plus two stages of K and V (and 1 KiB to align the tiles
    /// of the Hopper variant to the 1024-byte swizzle atoms), or `bulk` stages of padded rows.
    pub fn smem_bytes(&self) -> usize {
        let q = self.bm * self.dpad * 2;
        if self.bulk > 0 {
            return q + self.bulk * 2 * self.bn * (self.dpad * 2 + 16);
        }
        q + 4 * self.bn * self.dpad * 2 + if self.wg { 1024 } else { 0 }
    }
    /// Whether these traits describe a valid Hopper (`wg`) tile.
    pub fn wg_ok(&self) -> bool {
        self.nw.is_multiple_of(4) && self.bm == 16 * self.nw && self.dpad >= 64 && matches!(self.bn, 64 | 128)
    }
    /// Whether the kernel can be built with these traits: whole 16-row slices per warp, 16-key
    /// steps, a register cap it accepts, and a valid Hopper tile where `wg`.
    fn valid(&self) -> bool {
        let (bm, bn, nw) = (self.bm, self.bn, self.nw);
        bm > 0
            && nw > 0
            && bm.is_multiple_of(16 * nw)
            && bn > 0
            && bn.is_multiple_of(16)
            && (1..=4).contains(&self.minb)
            && (!self.wg || self.wg_ok())
            && (self.bulk == 0 || ((2..=4).contains(&self.bulk) && !self.wg))
    }
}

/// The planner's tuning knobs. A backend reads them from the environment once, when it is built
/// ([`CudaTuning::from_env`]), and [`super::CudaBackend::set_tuning`] replaces them: no call
/// reads the environment (which allocates). The defaults are the measured choices of
/// docs/PERF_NOTES.md (cuda).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaTuning {
    /// Prefill tile `[BM, BN, NW, MINB, WG]` instead of the default (`ATTNKIT_CUDA_TILE`, see
    /// [`CudaTuning::parse_tile`]); a tile the kernel cannot run is ignored.
    pub tile: Option<[usize; 5]>,
    /// Tile of the GQA decode kernel, the same way (`ATTNKIT_CUDA_GQA_TILE`, all five values).
    pub gqa_tile: Option<[usize; 5]>,
    /// Keys per tile of the GQA decode kernel, a positive multiple of 16 (`ATTNKIT_CUDA_GQA_BN`).
    pub gqa_bn: Option<usize>,
    /// Bulk-copy stages of the GQA decode kernel on Hopper: 2 to 4, or 0 for 16-byte copies
    /// (`ATTNKIT_CUDA_GQA_BULK`: a count or `off`); `None` or another count: the default, 2.
    pub gqa_bulk: Option<usize>,
    /// Split-KV target in CTAs per SM instead of the planner's own (`ATTNKIT_CUDA_SPLIT_TARGET`).
    pub split_target: Option<usize>,
    /// Hopper's warpgroup-MMA prefill variant (`ATTNKIT_CUDA_WGMMA=off`: false).
    pub wgmma: bool,
    /// GQA decode on the tensor cores (`ATTNKIT_CUDA_GQA=off`: false).
    pub gqa_mma: bool,
}

impl Default for CudaTuning {
    fn default() -> Self {
        CudaTuning {
            tile: None,
            gqa_tile: None,
            gqa_bn: None,
            gqa_bulk: None,
            split_target: None,
            wgmma: true,
            gqa_mma: true,
        }
    }
}

impl CudaTuning {
    /// The knobs from the `ATTNKIT_CUDA_*` environment variables (unset or unreadable: the
    /// default).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        CudaTuning {
            tile: var("ATTNKIT_CUDA_TILE").and_then(|s| Self::parse_tile(&s, true)),
            gqa_tile: var("ATTNKIT_CUDA_GQA_TILE").and_then(|s| Self::parse_tile(&s, false)),
            gqa_bn: var("ATTNKIT_CUDA_GQA_BN").and_then(|s| s.trim().parse().ok()),
            gqa_bulk: var("ATTNKIT_CUDA_GQA_BULK").map(|s| {
                if s == "off" {
                    0
                } else {
                    s.trim().parse().unwrap_or(GQA_BULK_STAGES)
                }
            }),
            split_target: var("ATTNKIT_CUDA_SPLIT_TARGET").and_then(|s| s.trim().parse().ok()),
            wgmma: var("ATTNKIT_CUDA_WGMMA").is_none_or(|v| v != "off"),
            gqa_mma: var("ATTNKIT_CUDA_GQA").is_none_or(|v| v != "off"),
        }
    }

    /// A tile as `BM,BN,NW,MINB,WG` (rows per CTA, keys per tile, warps, CTAs per SM the
    /// registers must fit, 1 for Hopper's warpgroup MMAs), or with `short` also `BM,BN,NW` and
    /// `BM,BN,NW,MINB` (MINB 1, WG 0).
    pub fn parse_tile(s: &str, short: bool) -> Option<[usize; 5]> {
        let v: Vec<usize> = s.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        match v[..] {
            [bm, bn, nw] if short => Some([bm, bn, nw, 1, 0]),
            [bm, bn, nw, minb] if short => Some([bm, bn, nw, minb, 0]),
            [bm, bn, nw, minb, wg] => Some([bm, bn, nw, minb, wg]),
            _ => None,
        }
    }
}

/// A tile override as kernel traits. The Hopper flag holds only on Hopper; a tile the kernel
/// cannot run is ignored.
fn tile_traits(tile: Option<[usize; 5]>, dpad: usize, post: bool, hopper: bool) -> Option<MmaTraits> {
    let [bm, bn, nw, minb, wg] = tile?;
    let t = MmaTraits { dpad, bm, bn, nw, minb, post, wg: wg == 1 && hopper, bulk: 0 };
    t.valid().then_some(t)
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

/// Kernel traits per padded head dim, for a call with (`post`) or without the score transform,
/// on a Hopper GPU (`hopper`: sm_90, where the warpgroup-MMA variant runs) or not.
/// `tuning.tile` overrides them; `tuning.wgmma` false keeps Hopper on `mma.sync`.
///
/// The defaults and the measurements that chose them are in docs/PERF_NOTES.md (cuda, v2, v4).
pub fn mma_traits(d: usize, post: bool, hopper: bool, tuning: &CudaTuning) -> MmaTraits {
    let dpad = mma_dpad(d);
    if let Some(t) = tile_traits(tuning.tile, dpad, post, hopper) {
        return t;
    }
    if hopper && tuning.wgmma && dpad >= 64 {
        // Two warpgroups of 64 rows, 64-key tiles. At d 128 the registers are capped so that
        // two CTAs share an SM (128 registers, 24 bytes of spills): 473 TFLOP/s where one CTA
        // per SM (155 registers) reached 316 on an H200; d 64 fits two CTAs uncapped (107
        // registers), and d 192 / 256 need one SM's shared memory per CTA anyway. The softcap /
        // ALiBi variant would spill 96 bytes under the cap: it keeps one CTA per SM (not timed).
        let minb = if dpad == 128 && !post { 2 } else { 1 };
        return MmaTraits { dpad, bm: 128, bn: 64, nw: 8, minb, post, wg: true, bulk: 0 };
    }
    let (bm, bn, nw, minb) = match dpad {
        32 | 64 | 128 => (128, 64, 4, 1),
        _ => (128, 64, 8, 1),
    };
    MmaTraits { dpad, bm, bn, nw, minb, post, wg: false, bulk: 0 }
}

/// A kernel variant as a `Copy` value (see [`Plan::kernel_key`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    family: Family,
    vals: [i64; 9],
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
    Mma {
        /// Tile shape.
        t: MmaTraits,
        /// Key splits per row block (split-KV with the combine kernel when above 1).
        splits: usize,
    },
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
            Plan::Mma { t, .. } => Variant {
                family: Family::Mma,
                defines: vec![
                    ("ATTN_DTYPE", dt),
                    ("DPAD", t.dpad as i64),
                    ("BM", t.bm as i64),
                    ("BN", t.bn as i64),
                    ("NW", t.nw as i64),
                    ("MINB", t.minb as i64),
                    ("POST", t.post as i64),
                    ("WG", t.wg as i64),
                    ("BULK", t.bulk as i64),
                ],
            },
        }
    }
    /// The kernel this plan runs, as a `Copy` key: the values of [`Plan::variant`]'s macros in
    /// order. The kernel cache is looked up with it, so a warm call builds no [`Variant`].
    pub fn kernel_key(&self, dtype: DType) -> KernelKey {
        let dt = dtype_code(dtype);
        let (family, vals) = match *self {
            Plan::Simt { dmax } => (Family::Simt, [dt, dmax as i64, 0, 0, 0, 0, 0, 0, 0]),
            Plan::Decode { lpk, rmax, .. } => (Family::Decode, [dt, lpk as i64, rmax as i64, 0, 0, 0, 0, 0, 0]),
            Plan::Mma { t, .. } => (
                Family::Mma,
                [
                    dt,
                    t.dpad as i64,
                    t.bm as i64,
                    t.bn as i64,
                    t.nw as i64,
                    t.minb as i64,
                    t.post as i64,
                    t.wg as i64,
                    t.bulk as i64,
                ],
            ),
        };
        KernelKey { family, vals }
    }
    /// f32 elements of split-KV workspace this plan needs.
    pub fn workspace_elems(&self, c: &Checked<'_>) -> usize {
        match *self {
            Plan::Decode { splits, .. } | Plan::Mma { splits, .. } if splits > 1 => {
                splits * c.total_q * c.hq * (c.d + 1)
            }
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

/// Tile of the tensor-core kernel for decode with GQA: one warp, 16 rows (the queries times
/// the heads of a group), K/V streamed through shared memory and read once for the group.
/// Elsewhere than Hopper: 32 keys per tile through 16-byte async copies (37 KiB of shared
/// memory at d 128, so six CTAs per SM; on an H200 3.36 TB/s where 64 keys read 1.77 and 128
/// keys 0.52, docs/PERF_NOTES.md, cuda v2). On Hopper: 16 keys per tile through bulk copies.
/// `tuning.gqa_bn` overrides the key count, `tuning.gqa_tile` the whole tile (for tuning).
pub fn gqa_decode_traits(d: usize, post: bool, hopper: bool, tuning: &CudaTuning) -> MmaTraits {
    let dpad = mma_dpad(d);
    if let Some(t) = tile_traits(tuning.gqa_tile, dpad, post, hopper) {
        return t;
    }
    let bn = tuning.gqa_bn.filter(|b| b % 16 == 0 && *b > 0);
    // On Hopper the K/V rows arrive by bulk copies (`gqa_bulk` 0 keeps the 16-byte copies, 3
    // or 4 sets the stages).
    let bulk = match tuning.gqa_bulk {
        _ if !hopper => 0,
        Some(n) if n == 0 || (2..=4).contains(&n) => n,
        _ => GQA_BULK_STAGES,
    };
    // 16 keys a tile with bulk copies: 10 CTAs per SM at d 128 (32 keys: 5), 3.70 against
    // 2.60 TB/s at batch 64 on an H200 (docs/PERF_NOTES.md, cuda v6).
    let bn = bn.unwrap_or(if bulk > 0 { 16 } else { 32 });
    MmaTraits { dpad, bm: 16, bn, nw: 1, minb: 1, post, wg: false, bulk }
}

/// Stages of the GQA decode tile's bulk copies on Hopper.
const GQA_BULK_STAGES: usize = 2;

/// Query heads per kv head from which decode runs on the tensor cores (`gqa_decode_traits`)
/// rather than the CUDA-core decode kernel, for f16 and bf16.
pub const GQA_MMA_MIN_GROUP: usize = 4;

/// Split count: about `mult` CTAs per SM, each split keeping at least 256 keys, at most 64
/// splits.
fn split_count(ctas: usize, max_k: usize, sms: usize, mult: usize) -> usize {
    let target = mult.max(1) * sms.max(1);
    let by_len = (max_k / 256).max(1);
    if ctas >= target {
        1
    } else {
        target.div_ceil(ctas.max(1)).min(by_len).clamp(1, 64)
    }
}

/// Split count for `ctas` CTAs (before splitting) of a memory-bound kernel of which the device
/// holds `slots` at once, each split keeping at least 256 of `max_k` keys, at most 128 splits.
///
/// The model: CTAs run in waves of `slots`; a wave of n CTAs streams at the full rate once n is
/// at least 3/4 of `slots` (on an H200 the GQA decode tile read as fast from 78% of its slots in
/// one wave as from two full waves), else at n / (3/4 slots) of it, being latency-bound. Each
/// CTA reads 1 / (ctas * s) of the bytes. The smallest split count within 2% of the best
/// predicted time wins (fewer partials to merge). Two unsplit waves or more are not split.
pub fn wave_splits(ctas: usize, slots: usize, max_k: usize) -> usize {
    let (ctas, slots) = (ctas.max(1), slots.max(1));
    // Two waves or more unsplit: CTAs finish at staggered times, so the last wave is no real
    // tail (the model below, in lock-step waves, would split anyway).
    if ctas >= 2 * slots {
        return 1;
    }
    let sat = (3 * slots).div_ceil(4);
    let max = (max_k / 256).clamp(1, 128);
    // Predicted time in units of (all bytes / full rate).
    let cost = |s: usize| {
        let total = ctas * s;
        let (full, last) = (total / slots, total % slots);
        let t = full * slots.max(sat) + if last > 0 { last.max(sat) } else { 0 };
        t as f64 / total as f64
    };
    let best = (1..=max).map(cost).fold(f64::INFINITY, f64::min);
    (1..=max).find(|&s| cost(s) <= best * 1.02).unwrap_or(1)
}

/// Choose the kernel: decode when every kv head has at most [`DECODE_MAX_ROWS`] query rows
/// (on the tensor cores for f16/bf16 with a GQA group of at least [`GQA_MMA_MIN_GROUP`]), else
/// the tensor cores for f16/bf16, else CUDA cores. `force` picks `simt`, `mma` or `decode` where
/// that kernel can run the call; `splits` forces the split count of the split-KV kernels;
/// `hopper` (an sm_90 device) lets prefill use the warpgroup-MMA variant; `tuning` holds the
/// overrides (`tuning.split_target`: about that many CTAs per SM instead of the planner's split
/// count).
pub fn plan(
    c: &Checked<'_>,
    sms: usize,
    hopper: bool,
    force: Option<&str>,
    splits: Option<usize>,
    tuning: &CudaTuning,
    occupancy: &dyn Fn(&MmaTraits) -> Option<usize>,
) -> Plan {
    let rows = c.max_q * c.group();
    let decode_ok = rows <= DECODE_MAX_ROWS;
    let mma_ok = matches!(c.dtype, DType::F16 | DType::BF16);
    let post = c.call.params.softcap.is_some() || c.call.alibi_slopes.is_some() || c.scale <= 0.0; // scale is finite (validated)
    let simt = Plan::Simt { dmax: simt_dmax(c.d) };
    let decode = || {
        let rmax = rows.max(1).next_power_of_two();
        let lpk = (c.d / 8).max(1).next_power_of_two();
        // About three CTAs per SM (the planner the suite passed with on an H200).
        let splits =
            splits.unwrap_or_else(|| split_count(c.batch * c.hkv, c.max_k, sms, tuning.split_target.unwrap_or(3)));
        Plan::Decode { lpk, rmax, splits }
    };
    let mma = || {
        if decode_ok {
            // One-warp CTAs: split the keys so the CTAs fill whole waves of what the device
            // holds at once (`tuning.split_target`: about that many CTAs per SM instead).
            let t = gqa_decode_traits(c.d, post, hopper, tuning);
            let ctas = c.batch * c.hkv * rows.div_ceil(t.bm);
            let splits = splits.unwrap_or_else(|| match (occupancy(&t), tuning.split_target) {
                (Some(per_sm), None) => wave_splits(ctas, per_sm * sms, c.max_k),
                (_, mult) => split_count(ctas, c.max_k, sms, mult.unwrap_or(8)),
            });
            Plan::Mma { t, splits }
        } else {
            Plan::Mma { t: mma_traits(c.d, post, hopper, tuning), splits: splits.unwrap_or(1) }
        }
    };
    match force {
        Some("simt") => return simt,
        Some("mma") if mma_ok => return mma(),
        Some("decode") if decode_ok => return decode(),
        _ => {}
    }
    if decode_ok && mma_ok && tuning.gqa_mma && c.group() >= GQA_MMA_MIN_GROUP {
        mma()
    } else if decode_ok {
        decode()
    } else if mma_ok {
        mma()
    } else {
        simt
    }
}

/// Every kernel variant the backend can launch for head dims `8..=256` (multiples of 8), with
/// the default kernel traits, on Hopper and elsewhere: what CI compiles (the Hopper variants
/// only for sm_90, see [`Variant::runs_on`]).
pub fn all_variants() -> Vec<Variant> {
    let tn = &CudaTuning::default();
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
                for post in [false, true] {
                    v.push(Plan::Mma { t: mma_traits(dpad, post, false, tn), splits: 1 }.variant(dt));
                    if dpad >= 64 {
                        v.push(Plan::Mma { t: mma_traits(dpad, post, true, tn), splits: 1 }.variant(dt));
                    }
                    v.push(Plan::Mma { t: gqa_decode_traits(dpad, post, false, tn), splits: 1 }.variant(dt));
                    v.push(Plan::Mma { t: gqa_decode_traits(dpad, post, true, tn), splits: 1 }.variant(dt));
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::{gqa_decode_traits, mma_traits, wave_splits, CudaTuning, MmaTraits};

    fn tile(t: MmaTraits) -> (usize, usize, usize, usize, bool, usize) {
        (t.bm, t.bn, t.nw, t.minb, t.wg, t.bulk)
    }

    #[test]
    fn tuning_defaults_and_overrides() {
        let def = CudaTuning::default();
        assert!(def.wgmma && def.gqa_mma && def.tile.is_none() && def.split_target.is_none());
        // The measured defaults (docs/PERF_NOTES.md, cuda v4 and v6).
        assert_eq!(tile(mma_traits(128, false, true, &def)), (128, 64, 8, 2, true, 0));
        assert_eq!(tile(mma_traits(128, true, true, &def)), (128, 64, 8, 1, true, 0));
        assert_eq!(tile(mma_traits(128, false, false, &def)), (128, 64, 4, 1, false, 0));
        assert_eq!(tile(mma_traits(256, false, false, &def)), (128, 64, 8, 1, false, 0));
        assert_eq!(tile(gqa_decode_traits(128, false, true, &def)), (16, 16, 1, 1, false, 2));
        assert_eq!(tile(gqa_decode_traits(128, false, false, &def)), (16, 32, 1, 1, false, 0));
        // Overrides.
        let no_wg = CudaTuning { wgmma: false, ..def.clone() };
        assert_eq!(tile(mma_traits(128, false, true, &no_wg)), (128, 64, 4, 1, false, 0));
        let t = CudaTuning { tile: CudaTuning::parse_tile("64,64,4", true), ..def.clone() };
        assert_eq!(tile(mma_traits(64, false, false, &t)), (64, 64, 4, 1, false, 0));
        // A tile the kernel cannot run (BM not a multiple of 16 warps' rows) is ignored.
        let bad = CudaTuning { tile: Some([40, 64, 4, 1, 0]), ..def.clone() };
        assert_eq!(mma_traits(128, false, false, &bad), mma_traits(128, false, false, &def));
        let off = CudaTuning { gqa_bulk: Some(0), ..def.clone() };
        assert_eq!(tile(gqa_decode_traits(128, false, true, &off)), (16, 32, 1, 1, false, 0));
        let odd = CudaTuning { gqa_bulk: Some(7), gqa_bn: Some(24), ..def.clone() };
        assert_eq!(tile(gqa_decode_traits(128, false, true, &odd)), (16, 16, 1, 1, false, 2));
        // The tile syntax.
        assert_eq!(CudaTuning::parse_tile("128,64,8,2,1", false), Some([128, 64, 8, 2, 1]));
        assert_eq!(CudaTuning::parse_tile("128,64,8", false), None);
        assert_eq!(CudaTuning::parse_tile("128, 64, 8, 2", true), Some([128, 64, 8, 2, 0]));
        assert_eq!(CudaTuning::parse_tile("x", true), None);
    }

    #[test]
    fn wave_splits_fill_whole_waves() {
        // 512 CTAs on 1320 slots (the bulk tile on an H200, batch 64): two splits fill 78%.
        assert_eq!(wave_splits(512, 1320, 4096), 2);
        // 792 slots (six CTAs per SM): two splits would leave a thin second wave; three fill two.
        assert_eq!(wave_splits(512, 792, 4096), 3);
        // Batch 1: as many splits as fill one wave, within the 128 cap.
        let s = wave_splits(8, 1320, 65536);
        assert!((121..=128).contains(&s) && 8 * s >= 970, "{s}");
        // Short keys cap the splits (256 keys each at least); more CTAs than slots split less.
        assert_eq!(wave_splits(8, 1320, 300), 1);
        assert_eq!(wave_splits(4000, 1320, 4096), 1);
        assert_eq!(wave_splits(0, 0, 0), 1);
    }
}
