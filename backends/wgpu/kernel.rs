//! Kernel traits (tile shapes per head dim and device), the metadata buffer, pipeline and bind
//! group caches, and the one launch site.

use std::collections::HashMap;

use super::{backend_err, Ctx, PipelineCache, WgpuStorage};
use crate::call::Layout;
use crate::error::Result;
use crate::types::DType;
use crate::validate::Checked;

const FLASH_SRC: &str = include_str!("../../shaders/flash_attn.wgsl");
const FLASH_MT_SRC: &str = include_str!("../../shaders/flash_attn_mt.wgsl");
const FLASH_PACKED_SRC: &str = include_str!("../../shaders/flash_attn_packed.wgsl");
const FLASH_COOP_SRC: &str = include_str!("../../shaders/flash_attn_coop.wgsl");
const COMBINE_SRC: &str = include_str!("../../shaders/combine.wgsl");
/// Text the flash shaders share, put in place of their `// @include NAME` lines.
const INCLUDES: [(&str, &str); 3] = [
    ("common.wgsl", include_str!("../../shaders/include/common.wgsl")),
    ("storage.wgsl", include_str!("../../shaders/include/storage.wgsl")),
    ("runs.wgsl", include_str!("../../shaders/include/runs.wgsl")),
];

/// Threads per workgroup of the combine pass.
const COMBINE_WG: usize = 64;
/// Most key/value splits of one call.
pub(crate) const MAX_SPLITS: usize = 64;
/// Header words of the metadata buffer (see the `M_*` constants of the shaders).
const HEADER: usize = 24;
/// Micro-tile (rows, keys) tiles tried, largest first; keys >= rows / 1 so that there is a
/// thread per row for the softmax (threads = rows * keys / 16 >= rows).
const MT_TILES: [(usize, usize); 4] = [(32, 32), (16, 32), (32, 16), (16, 16)];
/// Packed-kernel (rows, keys) tiles, largest first (rows / 4 and keys / 4 powers of two); the
/// automatic choice takes only those of 64 keys and 32 rows or more ([`packed_plan`]). The 64-row tile keeps Q^T and P^T
/// 16-bit ([`packed_half`]).
const PACKED_TILES: [(usize, usize); 5] = [(64, 64), (32, 64), (16, 64), (32, 32), (16, 32)];
/// Largest head dim of the packed kernel (its output block: 4 rows of `d / 4 / (keys / 4)` vec4s).
const PACKED_MAX_D: usize = 128;

/// Which kernel variant serves a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `flash_attn.wgsl`: split-KV over key slots; a thread per key for the scores, a thread per
    /// (vec4 column, key slot) for the output. Chosen for short-query calls (decode), where it
    /// wastes no threads on empty rows.
    Rows,
    /// `flash_attn_mt.wgsl`: 4x4 register micro-tiles for scores and output. Chosen when a
    /// workgroup has 32 rows to fill (prefill).
    MicroTile,
    /// `flash_attn_packed.wgsl`: f16/bf16 K/V tiles kept 16-bit in workgroup memory, 4x4 score
    /// and 4-row output micro-tiles, 64-key tiles. Chosen for f16/bf16 calls where a workgroup
    /// has 32 rows to fill and the cooperative-matrix kernel does not serve, head dims up to 128:
    /// a 64-row tile (256 threads, Q^T and P^T 16-bit: 45 KiB of workgroup memory at head dim
    /// 128) where 64 rows fill it and it fits, else a 32-row tile (128 threads, 43.5 KiB);
    /// forced, smaller tiles too; forced for another dtype or a larger head dim, the `MicroTile`
    /// kernel serves.
    Packed,
    /// `flash_attn_coop.wgsl`: cooperative matrices (tensor cores), f16 only, head dims that are
    /// multiples of 32, on devices that have them ([`super::WgpuBackend::has_cooperative_matrices`]).
    /// Chosen for f16 calls of 32 or more queries where it fits (`ATTNKIT_WGPU_COOP=manual`: only
    /// when forced; `=off`: never).
    Coop,
}

/// A kernel variant with its tile shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Plan {
    kernel: Kernel,
    bq: usize,
    bk: usize,
    /// `Rows`: key slots of the value phase (threads = d / 4 * nks); `Coop`: subgroups.
    nks: usize,
    /// `Rows`: the next tile's loads are issued before this tile's arithmetic (1) or at its top (0).
    pf: usize,
    /// `Rows`: threads that share one key's dot product in the score phase.
    tpk: usize,
}

/// Tuning of the `Rows` kernel (decode and short queries) and of the split-KV heuristic, for
/// benchmarks and tuning sweeps ([`super::WgpuBackend::set_rows_tuning`]); the default is the
/// measured best on the GPUs timed so far (see `docs/PERF_NOTES.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsTuning {
    /// Issue the next tile's K and V loads before this tile's arithmetic (else at the tile's top).
    pub prefetch: bool,
    /// Keys each key slot takes per tile, for workgroups of 1-2, 4, and 8-16 rows (1 to 32).
    pub keys_per_slot: [usize; 3],
    /// About this many threads a workgroup: D/4 a key slot, 1 to 8 slots (32 to 256).
    pub threads: usize,
    /// Most threads that share one key's dot product in the score phase (1 to 8).
    pub parts_per_key: usize,
    /// Workgroups the split-KV heuristic aims for (at least 1).
    pub target_workgroups: usize,
    /// Fewest keys a split of the split-KV heuristic owns (at least 16).
    pub min_keys_per_split: usize,
}

impl Default for RowsTuning {
    fn default() -> Self {
        RowsTuning {
            prefetch: false,
            keys_per_slot: [4, 4, 4],
            threads: 128,
            parts_per_key: 4,
            target_workgroups: 4096,
            min_keys_per_split: 256,
        }
    }
}

impl RowsTuning {
    /// The same tuning with every field inside its range.
    pub(crate) fn clamped(self) -> Self {
        RowsTuning {
            prefetch: self.prefetch,
            keys_per_slot: self.keys_per_slot.map(|k| k.clamp(1, 32)),
            threads: self.threads.clamp(32, 256),
            parts_per_key: self.parts_per_key.clamp(1, 8),
            target_workgroups: self.target_workgroups.max(1),
            min_keys_per_split: self.min_keys_per_split.max(16),
        }
    }
}

/// 8-byte words per vec4 column of a tensor: two for f32, one for f16/bf16.
fn words_per_col(dt: DType) -> usize {
    if dt == DType::F32 {
        2
    } else {
        1
    }
}

/// Workgroup memory of a plan for head dim `d` and `wpc` words per vec4 column, in bytes.
fn wg_bytes(p: &Plan, d: usize, wpc: usize) -> usize {
    match p.kernel {
        // Q rows, the K tile as raw words (rows padded by one word), two score buffers, the row
        // information and the slots' (m, l).
        Kernel::Rows => {
            p.bq * d * 4 + p.bk * (d / 4 * wpc + 1) * 8 + 2 * p.tpk * p.bq * p.bk * 4 + p.bq * 16 + p.nks * p.bq * 8
        }
        // Q^T, K^T-then-V, P^T, and a vec4 per (key group, row group) for the row maxima and sums.
        Kernel::MicroTile => (p.bq * d + p.bk * d + p.bk * p.bq) * 4 + p.bk * p.bq,
        // Q^T in f32 (16-bit with `packed_half`), K^T-then-V in 16-bit pairs, P^T in f32 (16-bit
        // with `packed_half`), a vec4 per (key group, row quad), a vec4 of row information per row,
        // and the unused twins of Q^T and P^T (one element each: a vec4<f32> with `packed_half`,
        // else a vec2<u32>).
        Kernel::Packed => {
            let (w, twin) = if packed_half(p) { (2, 16) } else { (4, 8) };
            (p.bq * d + p.bk * p.bq) * w + p.bk * d * 2 + p.bk * p.bq + p.bq * 16 + 2 * twin
        }
        // Two buffers of K and V tiles in f16 (rows padded by 8), each subgroup's f32 scratch rows
        // and f16 P rows (both padded by 4), a factor per row and the key range (padded to 16 bytes).
        Kernel::Coop => 2 * 2 * p.bk * (d + 8) * 2 + p.nks * 16 * (p.bk + 4) * (4 + 2) + p.bq * 4 + 16,
    }
}

/// The `Rows` plan for `rows` rows per sequence (at most 16 per workgroup): as few rows per
/// workgroup as cover them; about `t.threads` threads (d / 4 columns times key slots); keys per
/// slot and tile fewer as the rows grow (the registers of a thread hold a value per key and an
/// output vec4 per row); smaller tiles, then fewer rows, where the workgroup memory is short.
fn rows_plan(d: usize, wpc: usize, rows: usize, limit: u32, t: &RowsTuning) -> Option<Plan> {
    let d4 = d / 4;
    let nks = (t.threads / d4).clamp(1, 8);
    let first = rows.clamp(1, 16).next_power_of_two();
    let pf = usize::from(t.prefetch);
    [16, 8, 4, 2, 1].into_iter().filter(|&bq| bq <= first).find_map(|bq| {
        let kps = t.keys_per_slot[match bq {
            1 | 2 => 0,
            4 => 1,
            _ => 2,
        }];
        [kps, kps / 2, kps / 4, 1]
            .into_iter()
            .filter(|&k| k >= 1)
            .map(|k| {
                let bk = k * nks;
                let tpk = (d4 * nks / bk).clamp(1, t.parts_per_key);
                Plan { kernel: Kernel::Rows, bq, bk, nks, pf, tpk }
            })
            .find(|p| wg_bytes(p, d, wpc) <= limit as usize)
    })
}

fn mt_plan(d: usize, limit: u32) -> Option<Plan> {
    MT_TILES
        .into_iter()
        .map(|(bq, bk)| Plan { kernel: Kernel::MicroTile, bq, bk, nks: 0, pf: 0, tpk: 0 })
        .find(|p| wg_bytes(p, d, 1) <= limit as usize)
}

/// The packed plan: with `auto` (calls of `rows` rows a sequence at most), the tiles of 64 keys
/// and 32 rows or more, the 64-row one only where 64 rows fill it (the ones measured: 64x64, 256 threads, ran 1.07x
/// (f16) / 1.10x (bf16) faster than 32x64 at head dim 128 on an H200; smaller ones put more K/V
/// words or output columns in each thread's registers, and an H100 ran 16x64 at 4.7x and 32x32
/// at 1.9x the time of 32x64, with the kernel's first, 8-row blocks); forced, any tile that fits.
fn packed_plan(d: usize, dt: DType, limit: u32, auto: Option<usize>) -> Option<Plan> {
    if !matches!(dt, DType::F16 | DType::BF16) || d > PACKED_MAX_D {
        return None;
    }
    PACKED_TILES
        .iter()
        // Automatic: the measured tiles (64 keys, 32 rows or more), none of more rows than the
        // call fills but for the 32-row one.
        .filter(|&&(bq, bk)| auto.is_none_or(|rows| bk == 64 && (32..=rows.max(32)).contains(&bq)))
        .map(|&(bq, bk)| Plan { kernel: Kernel::Packed, bq, bk, nks: 0, pf: 0, tpk: 0 })
        .find(|p| wg_bytes(p, d, 1) <= limit as usize)
}

/// The cooperative-matrix plan: 4 (else 2) subgroups of 16 query rows, 32-key tiles (the Q
/// tile passes through the K/V tile buffer, so 16 * subgroups <= 2 * keys).
fn coop_plan(d: usize, limit: u32) -> Option<Plan> {
    if !coop_head_dim(d) {
        return None;
    }
    let ok = |&(nw, bk): &(usize, usize)| {
        (1..=8).contains(&nw) && bk.is_multiple_of(16) && bk >= 8 * nw && d.is_multiple_of(bk)
    };
    super::coop_settings()
        .tile
        .filter(ok)
        .into_iter()
        .chain([(4, 32), (2, 32)])
        .filter(ok)
        .map(|(nw, bk)| Plan { kernel: Kernel::Coop, bq: 16 * nw, bk, nks: nw, pf: 0, tpk: 0 })
        .find(|p| wg_bytes(p, d, 1) <= limit as usize)
}

/// Head dims the coop kernel takes: multiples of 32 (its key tile divides them), at most 128 (its
/// eight named Q and O matrices).
fn coop_head_dim(d: usize) -> bool {
    d.is_multiple_of(32) && d <= 128
}

/// Whether the coop kernel can serve a call of this dtype and head dim on this device.
fn coop_fits(coop: bool, dt: DType, d: usize) -> bool {
    coop && dt == DType::F16 && coop_head_dim(d)
}

/// The plan for a call whose sequences have at most `queries` queries, `g` query heads per kv
/// head (a row of the portable kernels is a (query, head-of-group) pair).
#[allow(clippy::too_many_arguments)]
fn plan(
    d: usize,
    dt: DType,
    queries: usize,
    g: usize,
    limit: u32,
    coop: bool,
    forced: Option<Kernel>,
    t: &RowsTuning,
) -> Option<Plan> {
    let wpc = words_per_col(dt);
    let rows = queries * g;
    match forced {
        Some(Kernel::Rows) => rows_plan(d, wpc, 16, limit, t),
        Some(Kernel::MicroTile) => mt_plan(d, limit).or_else(|| rows_plan(d, wpc, 16, limit, t)),
        Some(Kernel::Packed) => {
            packed_plan(d, dt, limit, None).or_else(|| mt_plan(d, limit)).or_else(|| rows_plan(d, wpc, 16, limit, t))
        }
        Some(Kernel::Coop) => coop_plan(d, limit),
        None if queries >= 32 && coop_fits(coop, dt, d) && super::coop_settings().auto => {
            coop_plan(d, limit).or_else(|| prefill_plan(d, dt, wpc, rows, limit, t))
        }
        None if rows >= 32 => prefill_plan(d, dt, wpc, rows, limit, t),
        None => rows_plan(d, wpc, rows, limit, t),
    }
}

/// The portable prefill plan: the packed kernel where it serves, else the micro-tile kernel, else
/// the `Rows` kernel (head dims too large for the micro-tile kernel's workgroup memory).
fn prefill_plan(d: usize, dt: DType, wpc: usize, rows: usize, limit: u32, t: &RowsTuning) -> Option<Plan> {
    packed_plan(d, dt, limit, Some(rows)).or_else(|| mt_plan(d, limit)).or_else(|| rows_plan(d, wpc, rows, limit, t))
}

/// The largest head dim (a multiple of 4, at most [`super::MAX_HEAD_DIM`]) that fits `limit`
/// for every dtype.
pub(crate) fn max_head_dim(limit: u32) -> usize {
    (1..=super::MAX_HEAD_DIM / 4)
        .rev()
        .map(|n| n * 4)
        .find(|&d| rows_plan(d, 2, 1, limit, &RowsTuning::default()).is_some())
        .unwrap_or(4)
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F16 => 1,
        DType::BF16 => 2,
        _ => 0,
    }
}

/// Which compiled kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum PipeKey {
    /// A flash kernel for (dtype code, head dim, plan).
    Flash(u32, usize, Plan),
    /// The split-KV combine pass for (dtype code, head dim).
    Combine(u32, usize),
}

/// The shader's text with each `// @include NAME` line replaced by shaders/include/NAME, the
/// value of each `const NAME: u32 = ...; // @spec` line replaced, and the loops marked
/// `// @unroll` unrolled (see unroll.rs).
pub(crate) fn specialize(src: &str, values: &[(&str, usize)]) -> String {
    let mut out = String::with_capacity(src.len() + 8192);
    for line in src.lines() {
        if let Some(name) = line.strip_prefix("// @include ") {
            let text = INCLUDES.iter().find(|(n, _)| *n == name.trim()).map(|(_, t)| *t);
            // The shaders are constants of this crate; `includes_resolve` tests every name.
            out.push_str(text.unwrap_or_else(|| panic!("shaders/include/{name} is not embedded")));
            out.push('\n');
            continue;
        }
        let hit =
            values.iter().find(|(name, _)| line.starts_with(&format!("const {name}: u32 =")) && line.contains("@spec"));
        match hit {
            Some((name, v)) => out.push_str(&format!("const {name}: u32 = {v}u; // @spec")),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    // `ATTNKIT_WGPU_UNROLL=0` leaves the marked loops to the driver (the same meaning), for A/B
    // timing.
    if std::env::var("ATTNKIT_WGPU_UNROLL").is_ok_and(|v| v == "0") {
        return out;
    }
    // The same: our own shaders, and `wgsl_shaders` expands every specialisation of each.
    super::unroll::unroll(&out).unwrap_or_else(|e| panic!("a `// @unroll` loop of an attnkit shader: {e}"))
}

/// The SPIR-V of the kernels that `wgsl_bench bench` times (head dim 128, 48 KiB of workgroup
/// memory), each named by kernel, dtype and tile, written by naga as for the cooperative-matrix
/// kernel (the portable kernels go through wgpu's own naga call at run time, with the same
/// bounds-check policy): for reading a driver's statistics of each (registers, spills) in
/// `wgsl_bench kernel_statistics`. Diagnosis only.
pub(crate) fn bench_modules() -> Result<Vec<(String, Vec<u32>)>> {
    let (d, limit) = (128, 48 * 1024);
    let mut out = Vec::new();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        if let Some(p) = mt_plan(d, limit) {
            let src = mt_source(d, dt as u32, &p);
            out.push((format!("micro-tile {dt} {}x{}", p.bq, p.bk), super::spirv::mt_module(&src)?));
        }
        // The bench's calls: 4096 rows a sequence (the 64-row tile where it fits).
        if let Some(p) = packed_plan(d, dt, limit, Some(4096)) {
            let src = packed_source(d, dt as u32, &p);
            out.push((format!("packed {dt} {}x{}", p.bq, p.bk), super::spirv::mt_module(&src)?));
        }
    }
    for rows in [1, 4] {
        let wpc = words_per_col(DType::F16);
        if let Some(p) = rows_plan(d, wpc, rows, limit, &RowsTuning::default()) {
            let values = [
                ("D", d),
                ("DT", DType::F16 as usize),
                ("BQ", p.bq),
                ("BK", p.bk),
                ("NKS", p.nks),
                ("PF", p.pf),
                ("TPK", p.tpk),
            ];
            let name = format!("rows f16 bq{} bk{} nks{} tpk{}", p.bq, p.bk, p.nks, p.tpk);
            out.push((name, super::spirv::coop_module(&specialize(FLASH_SRC, &values))?));
        }
    }
    for (nw, bk) in [(4, 32), (2, 32)] {
        out.push((format!("coop f16 {nw}x{bk}"), super::spirv::coop_module(&coop_source(d, nw, bk))?));
    }
    let combine = specialize(COMBINE_SRC, &[("D", d), ("DT", DType::F16 as usize)]);
    out.push(("combine f16".to_string(), super::spirv::coop_module(&combine)?));
    Ok(out)
}

/// The micro-tile kernel's WGSL for storage dtype code `dt`, head dim `d` and plan `p`.
pub(crate) fn mt_source(d: usize, dt: u32, p: &Plan) -> String {
    specialize(FLASH_MT_SRC, &[("D", d), ("DT", dt as usize), ("BQ", p.bq), ("BK", p.bk)])
}

/// The packed kernel's WGSL for storage dtype code `dt` (f16 or bf16), head dim `d` and plan `p`.
pub(crate) fn packed_source(d: usize, dt: u32, p: &Plan) -> String {
    let half = usize::from(packed_half(p));
    specialize(FLASH_PACKED_SRC, &[("D", d), ("DT", dt as usize), ("BQ", p.bq), ("BK", p.bk), ("HALF", half)])
}

/// Whether the packed kernel keeps Q^T and P^T 16-bit (`HALF`): in the 64-row tile, which then
/// fits 48 KiB at head dim 128 (45 KiB). Q^T is stored as loaded (exact); P is rounded to f16
/// once and the row sums add the rounded values, as the cooperative-matrix kernel does.
fn packed_half(p: &Plan) -> bool {
    p.bq == 64
}

/// The cooperative-matrix kernel's WGSL for head dim `d`, `nw` subgroups and `bk` keys a tile.
pub(crate) fn coop_source(d: usize, nw: usize, bk: usize) -> String {
    let cs = super::coop_settings();
    specialize(FLASH_COOP_SRC, &[("D", d), ("NW", nw), ("BK", bk), ("DEBUG", cs.debug)])
}

/// A pipeline of a portable kernel, from its specialised WGSL through wgpu (layout reflected).
fn wgsl_pipeline(device: &::wgpu::Device, src: String, label: &str, loop_bounding: bool) -> ::wgpu::ComputePipeline {
    // Buffer bounds checks stay on; the loop bounding that wgpu would otherwise add to every
    // loop (a second exit on a hidden counter) is left out, so that the driver's compiler can
    // unroll the constant-trip loops and keep the per-thread arrays they index in registers.
    let mut checks = ::wgpu::ShaderRuntimeChecks::checked();
    checks.force_loop_bounding = loop_bounding;
    // SAFETY: `force_loop_bounding = false` requires that no shader can loop forever. Every
    // loop in shaders/*.wgsl is a counted `for` whose counter only increases, by a positive
    // step, toward a bound fixed before the loop starts (a constant, or a value read from the
    // metadata before the loop: a token count, far below i32::MAX since a storage binding
    // holds at most 4 GiB); none has another back edge.
    let module = unsafe {
        device.create_shader_module_trusted(
            ::wgpu::ShaderModuleDescriptor { label: Some(label), source: ::wgpu::ShaderSource::Wgsl(src.into()) },
            checks,
        )
    };
    device.create_compute_pipeline(&::wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        // Every workgroup array is written before it is read (each shader says how), so the
        // zero fill wgpu would insert at every workgroup's start is wasted work.
        compilation_options: ::wgpu::PipelineCompilationOptions {
            zero_initialize_workgroup_memory: false,
            ..Default::default()
        },
        cache: None,
    })
}

/// The cooperative-matrix kernel's pipeline: SPIR-V written by naga and mended for the Vulkan
/// memory model (spirv.rs), handed to the driver as it is, with its bind group layout spelled out
/// (a pass-through module carries no reflection).
fn coop_pipeline(device: &::wgpu::Device, src: &str) -> Result<::wgpu::ComputePipeline> {
    let words = super::spirv::coop_module(src)?;
    // SAFETY: the words are a module naga wrote from our own WGSL after validating it, with
    // every storage-buffer access clamped (`Restrict`) and every array index in range by
    // construction (flash_attn_coop.wgsl's header: rows below their region's rows times the row
    // stride, plus a column below the row's width; `wgsl_backend`'s coop tests and the
    // conformance suite run this path, `ATTNKIT_WGPU_COOP_INDEX_CHECKS=1` clamps them), changed
    // afterwards only by memory-operand and barrier-semantics flags that the Vulkan memory model
    // (which the module declares) defines; its bindings are the flash kernels' eight, and the
    // device has the cooperative-matrix, f16 and subgroup features the module uses
    // (`COOP_FEATURES`).
    Ok(unsafe { passthrough_pipeline(device, words, "attnkit flash_attn_coop") })
}

/// The micro-tile kernel's pipeline from its SPIR-V with unclamped array indices
/// ([`super::spirv::mt_module`]), on a device with pass-through shaders.
fn mt_pipeline(device: &::wgpu::Device, src: &str, label: &str) -> Result<::wgpu::ComputePipeline> {
    let words = super::spirv::mt_module(src)?;
    // SAFETY: naga wrote the words from our own WGSL after validating it; every storage-buffer
    // access is clamped to its buffer (`Restrict`); the array indices are not, and every one of
    // them is in range by construction (flash_attn_mt.wgsl and flash_attn_packed.wgsl: each
    // workgroup and per-thread array index is a product of loop counters and thread coordinates
    // below the array's extent, the XOR swizzles stay inside a power-of-two group count, and
    // `wgsl_shaders` plus the conformance suite run this path); its bindings are the flash
    // kernels' eight; the module uses no feature beyond core Vulkan 1.1 compute.
    Ok(unsafe { passthrough_pipeline(device, words, label) })
}

/// A pipeline from SPIR-V words with the flash kernels' bind group layout spelled out (a
/// pass-through module carries no reflection).
///
/// # Safety
/// `words` is a valid compute module whose entry point `main` uses exactly the flash kernels'
/// bindings (q, k, v, out, lse, metadata, split outputs and lse, in that order) and only
/// features the device has, and whose memory accesses stay in bounds.
unsafe fn passthrough_pipeline(device: &::wgpu::Device, words: Vec<u32>, label: &str) -> ::wgpu::ComputePipeline {
    let entry = |binding: u32, read_only: bool| ::wgpu::BindGroupLayoutEntry {
        binding,
        visibility: ::wgpu::ShaderStages::COMPUTE,
        ty: ::wgpu::BindingType::Buffer {
            ty: ::wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    };
    // The flash kernels' bindings: q, k, v, out, lse, metadata, split outputs and lse.
    let read_only = [true, true, true, false, false, true, false, false];
    let entries: Vec<_> = read_only.iter().enumerate().map(|(i, &r)| entry(i as u32, r)).collect();
    let bgl =
        device.create_bind_group_layout(&::wgpu::BindGroupLayoutDescriptor { label: Some(label), entries: &entries });
    let layout = device.create_pipeline_layout(&::wgpu::PipelineLayoutDescriptor {
        label: Some(label),
        bind_group_layouts: &[Some(&bgl)],
        immediate_size: 0,
    });
    // SAFETY: the caller's promise (see above).
    let module = unsafe {
        device.create_shader_module_passthrough(::wgpu::ShaderModuleDescriptorPassthrough {
            label: Some(label),
            entry_points: std::borrow::Cow::Owned(vec![::wgpu::PassthroughShaderEntryPoint {
                name: "main".into(),
                workgroup_size: (0, 0, 0),
            }]),
            spirv: Some(std::borrow::Cow::Owned(words)),
            ..Default::default()
        })
    };
    device.create_compute_pipeline(&::wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: Some(&layout),
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// A device buffer that grows (never shrinks) to the largest size asked of it.
struct Growable {
    buffer: ::wgpu::Buffer,
    label: &'static str,
    usage: ::wgpu::BufferUsages,
}

impl Growable {
    fn new(device: &::wgpu::Device, label: &'static str, usage: ::wgpu::BufferUsages) -> Self {
        let buffer = device.create_buffer(&::wgpu::BufferDescriptor {
            label: Some(label),
            size: 16,
            usage,
            mapped_at_creation: false,
        });
        Growable { buffer, label, usage }
    }
    /// Make room for `bytes`; true when the buffer was replaced.
    fn fit(&mut self, device: &::wgpu::Device, bytes: u64) -> bool {
        if self.buffer.size() >= bytes {
            return false;
        }
        let size = bytes.next_power_of_two().max(16);
        self.buffer = device.create_buffer(&::wgpu::BufferDescriptor {
            label: Some(self.label),
            size,
            usage: self.usage,
            mapped_at_creation: false,
        });
        true
    }
}

/// Per-device state: pipelines, reusable buffers, cached bind groups, host scratch.
pub(crate) struct State {
    pipelines: PipelineCache,
    meta: Growable,
    part_o: Growable,
    part_lse: Growable,
    dummy_lse: ::wgpu::Buffer,
    bind_groups: HashMap<(PipeKey, [Option<::wgpu::Buffer>; 5]), ::wgpu::BindGroup>,
    words: Vec<u32>,
    /// wgpu's loop bounding on (`ATTNKIT_WGPU_LOOP_BOUNDING=1`, for A/B timing).
    loop_bounding: bool,
    /// The micro-tile kernel goes through [`mt_pipeline`] (a Vulkan device with pass-through
    /// shaders: the module is SPIR-V); `ATTNKIT_WGPU_MT_PASSTHROUGH=0` keeps it on wgpu's own
    /// path (A/B).
    pub(crate) mt_passthrough: bool,
}

const BIND_GROUP_CACHE: usize = 64;

impl State {
    pub(crate) fn new(device: &::wgpu::Device) -> State {
        use ::wgpu::BufferUsages as U;
        let dummy_lse = device.create_buffer(&::wgpu::BufferDescriptor {
            label: Some("attnkit no-lse"),
            size: 16,
            usage: U::STORAGE,
            mapped_at_creation: false,
        });
        State {
            pipelines: HashMap::new(),
            meta: Growable::new(device, "attnkit meta", U::STORAGE | U::COPY_DST),
            part_o: Growable::new(device, "attnkit split out", U::STORAGE),
            part_lse: Growable::new(device, "attnkit split lse", U::STORAGE),
            dummy_lse,
            bind_groups: HashMap::new(),
            words: Vec::new(),
            loop_bounding: std::env::var("ATTNKIT_WGPU_LOOP_BOUNDING").is_ok_and(|v| v == "1"),
            mt_passthrough: device.features().contains(::wgpu::Features::PASSTHROUGH_SHADERS)
                && device.adapter_info().backend == ::wgpu::Backend::Vulkan
                && std::env::var("ATTNKIT_WGPU_MT_PASSTHROUGH").map_or(true, |v| v != "0"),
        }
    }

    fn pipeline(&mut self, device: &::wgpu::Device, key: PipeKey) -> Result<::wgpu::ComputePipeline> {
        if let Some(p) = self.pipelines.get(&key) {
            return Ok(p.clone());
        }
        let lb = self.loop_bounding;
        let pipeline = match key {
            PipeKey::Flash(dt, d, p) if p.kernel == Kernel::Rows => wgsl_pipeline(
                device,
                specialize(
                    FLASH_SRC,
                    &[
                        ("D", d),
                        ("DT", dt as usize),
                        ("BQ", p.bq),
                        ("BK", p.bk),
                        ("NKS", p.nks),
                        ("PF", p.pf),
                        ("TPK", p.tpk),
                    ],
                ),
                "attnkit flash_attn",
                lb,
            ),
            PipeKey::Flash(_, d, p) if p.kernel == Kernel::Coop => coop_pipeline(device, &coop_source(d, p.nks, p.bk))?,
            // The micro-tile and packed kernels: from attnkit's own SPIR-V where the device takes it.
            PipeKey::Flash(dt, d, p) => {
                let (src, label) = if p.kernel == Kernel::Packed {
                    (packed_source(d, dt, &p), "attnkit flash_attn_packed")
                } else {
                    (mt_source(d, dt, &p), "attnkit flash_attn_mt")
                };
                if self.mt_passthrough {
                    mt_pipeline(device, &src, label)?
                } else {
                    wgsl_pipeline(device, src, label, lb)
                }
            }
            PipeKey::Combine(dt, d) => {
                wgsl_pipeline(device, specialize(COMBINE_SRC, &[("D", d), ("DT", dt as usize)]), "attnkit combine", lb)
            }
        };
        self.pipelines.insert(key, pipeline.clone());
        Ok(pipeline)
    }

    fn bind_group(
        &mut self,
        device: &::wgpu::Device,
        key: PipeKey,
        pipeline: &::wgpu::ComputePipeline,
        buffers: [Option<::wgpu::Buffer>; 5],
        layout_buffers: &[&::wgpu::Buffer],
    ) -> ::wgpu::BindGroup {
        if self.bind_groups.len() >= BIND_GROUP_CACHE {
            self.bind_groups.clear();
        }
        self.bind_groups
            .entry((key, buffers))
            .or_insert_with(|| {
                let entries: Vec<::wgpu::BindGroupEntry> = layout_buffers
                    .iter()
                    .enumerate()
                    .map(|(i, b)| ::wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
                    .collect();
                device.create_bind_group(&::wgpu::BindGroupDescriptor {
                    label: Some("attnkit bind group"),
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &entries,
                })
            })
            .clone()
    }
}

/// How many key/value chunks to split a call into; `tiles_q` query tiles of `heads` heads per
/// sequence.
fn choose_splits(
    c: &Checked<'_>,
    forced: Option<usize>,
    tiles_q: usize,
    heads: usize,
    bk: usize,
    t: &RowsTuning,
) -> usize {
    let max_by_keys = c.max_k.div_ceil(bk).max(1);
    if let Some(n) = forced {
        return n.clamp(1, MAX_SPLITS).min(max_by_keys);
    }
    // Only short-query calls (decode, small chunked prefill): longer ones fill the GPU already.
    if tiles_q > 4 || c.max_k < 2 * t.min_keys_per_split {
        return 1;
    }
    let wgs = c.batch * heads * tiles_q;
    let want = t.target_workgroups.div_ceil(wgs.max(1));
    want.min(c.max_k / t.min_keys_per_split).clamp(1, MAX_SPLITS)
}

fn push_f32(w: &mut Vec<u32>, x: f32) {
    w.push(x.to_bits());
}

/// Header and arrays of the metadata buffer.
fn fill_meta(w: &mut Vec<u32>, c: &Checked<'_>, splits: usize, want_lse: bool) {
    let p = &c.call.params;
    let clamp = |x: Option<usize>| -> u32 { x.map(|v| v.min(1 << 30) as i32).unwrap_or(-1) as u32 };
    let kind = match c.call.layout {
        Layout::Dense => 0,
        Layout::Varlen { .. } => 1,
        Layout::Paged { .. } => 2,
    };
    w.clear();
    w.extend_from_slice(&[
        c.batch as u32,
        c.hq as u32,
        c.hkv as u32,
        kind,
        c.dense_sq as u32,
        c.dense_sk as u32,
        c.total_q as u32,
        c.block_size as u32,
        0, // max_blocks, below
        p.causal as u32,
        clamp(p.window_left),
        clamp(p.window_right),
    ]);
    push_f32(w, p.softcap.unwrap_or(0.0));
    push_f32(w, c.scale);
    w.push(c.call.alibi_slopes.is_some() as u32);
    w.push(want_lse as u32);
    w.push(splits as u32);
    w.resize(HEADER, 0);
    let ints = |w: &mut Vec<u32>, s: &[i32]| w.extend(s.iter().map(|&x| x as u32));
    match c.call.layout {
        Layout::Dense => {}
        Layout::Varlen { cu_seqlens_q, cu_seqlens_k } => {
            w[17] = w.len() as u32;
            ints(w, cu_seqlens_q);
            w[18] = w.len() as u32;
            ints(w, cu_seqlens_k);
        }
        Layout::Paged { cu_seqlens_q, block_table, max_blocks, seq_lens } => {
            w[8] = max_blocks as u32;
            w[17] = w.len() as u32;
            ints(w, cu_seqlens_q);
            w[18] = w.len() as u32;
            ints(w, seq_lens);
            w[19] = w.len() as u32;
            // Unused entries may hold anything; the kernel never reads past a sequence's length,
            // but keep what it could see in range anyway.
            w.extend(block_table.iter().map(|&x| x.max(0) as u32));
        }
    }
    if let Some(s) = c.call.alibi_slopes {
        w[20] = w.len() as u32;
        w.extend(s.iter().map(|x| x.to_bits()));
    }
}

fn check_binding(ctx: &Ctx, what: &str, bytes: u64) -> Result<()> {
    let max = ctx.limits.max_storage_buffer_binding_size;
    if bytes > max {
        return Err(backend_err(format!(
            "{what} needs a binding of {bytes} bytes, over this device's max_storage_buffer_binding_size {max}"
        )));
    }
    Ok(())
}

/// Compute a validated call. Checks everything that can fail before anything is queued.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    ctx: &Ctx,
    c: &Checked<'_>,
    q: &WgpuStorage,
    k: &WgpuStorage,
    v: &WgpuStorage,
    out: &WgpuStorage,
    lse: Option<&WgpuStorage>,
    forced_splits: Option<usize>,
    forced_kernel: Option<Kernel>,
    tuning: &RowsTuning,
) -> Result<()> {
    if c.total_q == 0 || c.batch == 0 {
        return Ok(());
    }
    let d = c.d;
    let g = c.group();
    if forced_kernel == Some(Kernel::Coop) && !coop_fits(ctx.coop, c.dtype, d) {
        return Err(backend_err(format!(
            "Kernel::Coop needs a device with cooperative matrices (this one: {}), f16 (got {:?}) and a head dim \
             that is a multiple of 32 (got {d})",
            if ctx.coop { "yes" } else { "no" },
            c.dtype
        )));
    }
    let limit = ctx.limits.max_compute_workgroup_storage_size;
    let plan = plan(d, c.dtype, c.max_q, g, limit, ctx.coop, forced_kernel, tuning)
        .ok_or_else(|| backend_err(format!("head dim {d} does not fit this device's workgroup memory")))?;
    let dt = dtype_code(c.dtype);
    // The coop kernel's workgroups own queries of one query head; the others' own rows of
    // (query, head of the group) pairs of one kv head.
    let (tiles_q, heads) = if plan.kernel == Kernel::Coop {
        (c.max_q.div_ceil(plan.bq), c.hq)
    } else {
        ((c.max_q * g).div_ceil(plan.bq), c.hkv)
    };
    let mut splits = choose_splits(c, forced_splits, tiles_q, heads, plan.bk, tuning);
    let rows = (c.total_q * c.hq) as u64;
    // The split scratch must fit one binding; fewer splits otherwise.
    while splits > 1 && rows * splits as u64 * d as u64 * 4 > ctx.limits.max_storage_buffer_binding_size {
        splits /= 2;
    }
    let max_groups = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let z = c.batch * splits;
    if tiles_q > max_groups || heads > max_groups || z > max_groups {
        return Err(backend_err(format!(
            "grid ({tiles_q}, {heads}, {z}) exceeds this device's {max_groups} workgroups per dimension"
        )));
    }
    for (what, s) in [("q", q), ("k", k), ("v", v), ("out", out)] {
        check_binding(ctx, what, s.buffer.size())?;
    }
    if (u32::MAX as u64) < (c.call.k.elem_count().max(c.call.q.elem_count()) as u64) {
        return Err(backend_err("tensors of 2^32 elements or more are not supported"));
    }

    let mut st = ctx.state.lock().map_err(|_| backend_err("state lock poisoned"))?;
    let st = &mut *st;
    let mut words = std::mem::take(&mut st.words);
    fill_meta(&mut words, c, splits, lse.is_some());
    let meta_bytes = (words.len() * 4) as u64;
    check_binding(ctx, "metadata", meta_bytes)?;
    let combine_groups = if splits > 1 { (c.total_q * c.hq * (d / 4)).div_ceil(COMBINE_WG) } else { 0 };
    let (cx, cy) = if combine_groups <= max_groups {
        (combine_groups, 1)
    } else {
        (max_groups, combine_groups.div_ceil(max_groups))
    };
    if cy > max_groups {
        st.words = words;
        return Err(backend_err("too many rows for the split-KV combine pass"));
    }

    let r = ctx.scoped("attention", || {
        let dev = &ctx.device;
        let mut grown = st.meta.fit(dev, meta_bytes);
        if splits > 1 {
            grown |= st.part_o.fit(dev, rows * splits as u64 * d as u64 * 4);
            grown |= st.part_lse.fit(dev, rows * splits as u64 * 4);
        }
        if grown {
            st.bind_groups.clear();
        }
        ctx.queue.write_buffer(&st.meta.buffer, 0, bytemuck_words(&words));

        let fkey = PipeKey::Flash(dt, d, plan);
        let fpipe = st.pipeline(dev, fkey)?;
        let lse_buf = lse.map(|l| l.buffer.clone()).unwrap_or_else(|| st.dummy_lse.clone());
        let (meta_b, po, pl) = (st.meta.buffer.clone(), st.part_o.buffer.clone(), st.part_lse.buffer.clone());
        let fbg = st.bind_group(
            dev,
            fkey,
            &fpipe,
            [
                Some(q.buffer.clone()),
                Some(k.buffer.clone()),
                Some(v.buffer.clone()),
                Some(out.buffer.clone()),
                Some(lse_buf.clone()),
            ],
            &[&q.buffer, &k.buffer, &v.buffer, &out.buffer, &lse_buf, &meta_b, &po, &pl],
        );
        let combine = if splits > 1 {
            let ckey = PipeKey::Combine(dt, d);
            let cpipe = st.pipeline(dev, ckey)?;
            let cbg = st.bind_group(
                dev,
                ckey,
                &cpipe,
                [Some(out.buffer.clone()), Some(lse_buf.clone()), None, None, None],
                &[&out.buffer, &lse_buf, &meta_b, &po, &pl],
            );
            Some((cpipe, cbg))
        } else {
            None
        };

        let mut enc = dev.create_command_encoder(&::wgpu::CommandEncoderDescriptor { label: Some("attnkit forward") });
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&fpipe);
            pass.set_bind_group(0, &fbg, &[]);
            pass.dispatch_workgroups(tiles_q as u32, heads as u32, z as u32);
        }
        if let Some((cpipe, cbg)) = combine {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&cpipe);
            pass.set_bind_group(0, &cbg, &[]);
            pass.dispatch_workgroups(cx as u32, cy as u32, 1);
        }
        ctx.queue.submit([enc.finish()]);
        Ok(())
    });
    st.words = words;
    if r.is_err() {
        // Nothing that failed (a pipeline that did not compile, a bind group) stays cached.
        st.pipelines.clear();
        st.bind_groups.clear();
    }
    r
}

fn bytemuck_words(w: &[u32]) -> &[u8] {
    bytemuck::cast_slice(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which kernel and tile serve prefill: the packed kernel's measured 32x64 tile only where it
    /// fits, else the micro-tile kernel; smaller packed tiles only when forced; f32 never packed.
    #[test]
    fn prefill_plans() {
        let t = RowsTuning::default();
        let pick = |d, dt, limit, forced| {
            let p = plan(d, dt, 4096, 1, limit, false, forced, &t).expect("a plan");
            (p.kernel, p.bq, p.bk)
        };
        let (k48, k32) = (48 * 1024, 32 * 1024);
        assert_eq!(pick(128, DType::F16, k48, None), (Kernel::Packed, 64, 64));
        assert_eq!(pick(128, DType::BF16, k48, None), (Kernel::Packed, 64, 64));
        let p = plan(128, DType::BF16, 40, 1, k48, false, None, &t).expect("a plan");
        assert_eq!((p.kernel, p.bq, p.bk), (Kernel::Packed, 32, 64));
        assert_eq!(pick(128, DType::F32, k48, None), (Kernel::MicroTile, 32, 32));
        assert_eq!(pick(64, DType::F16, k32, None), (Kernel::Packed, 64, 64));
        assert_eq!(pick(128, DType::F16, k32, None), (Kernel::MicroTile, 16, 32));
        assert_eq!(pick(128, DType::F16, k32, Some(Kernel::Packed)), (Kernel::Packed, 16, 64));
        assert_eq!(pick(256, DType::F16, k48, Some(Kernel::Packed)).0, Kernel::MicroTile);
        assert_eq!(pick(128, DType::F32, k48, Some(Kernel::Packed)).0, Kernel::MicroTile);
    }

    /// Every include a shader asks for is embedded (`specialize` panics otherwise) and lands in
    /// its place. That the expanded text validates is tests/wgsl_shaders.rs's part (from disk).
    #[test]
    fn includes_resolve() {
        let expanded = [
            ("flash_attn", specialize(FLASH_SRC, &[])),
            ("flash_attn_mt", specialize(FLASH_MT_SRC, &[])),
            ("flash_attn_packed", specialize(FLASH_PACKED_SRC, &[])),
            ("combine", specialize(COMBINE_SRC, &[])),
            ("flash_attn_coop", coop_source(64, 4, 32)),
        ];
        for (name, s) in &expanded {
            assert!(!s.lines().any(|l| l.starts_with("// @include ")), "{name}: an include left");
        }
        assert!(expanded[4].1.contains("fn put_lse(") && expanded[2].1.contains("fn put_lse("));
        assert!(expanded[2].1.contains("fn run_slot(") && expanded[4].1.contains("fn run_slot("));
        assert!(expanded[0].1.contains("fn store_o("));
    }

    #[test]
    fn packed_tile_follows_rows_and_memory() {
        let tile = |d, limit, auto| packed_plan(d, DType::F16, limit, auto).map(|p| (p.bq, p.bk));
        // The 64-row tile (Q^T and P^T 16-bit) at head dim 128 in 48 KiB, where 64 rows fill it.
        assert_eq!(tile(128, 48 * 1024, Some(4096)), Some((64, 64)));
        assert_eq!(tile(128, 48 * 1024, Some(64)), Some((64, 64)));
        assert_eq!(tile(128, 48 * 1024, Some(63)), Some((32, 64)));
        assert_eq!(tile(128, 48 * 1024, Some(1)), Some((32, 64)));
        let wide = Plan { kernel: Kernel::Packed, bq: 64, bk: 64, nks: 0, pf: 0, tpk: 0 };
        assert!(packed_half(&wide) && wg_bytes(&wide, 128, 1) == 46112);
        // 32 KiB (Mesa's lavapipe): the 64-row tile up to head dim 72, the 32-row one to 84.
        assert_eq!(tile(72, 32 * 1024, Some(4096)), Some((64, 64)));
        assert_eq!(tile(76, 32 * 1024, Some(4096)), Some((32, 64)));
        assert_eq!(tile(84, 32 * 1024, Some(4096)), Some((32, 64)));
        assert_eq!(tile(88, 32 * 1024, Some(4096)), None);
        // Forced: any tile that fits, the 64-row one first.
        assert_eq!(tile(128, 32 * 1024, None), Some((16, 64)));
        assert_eq!(tile(64, 32 * 1024, None), Some((64, 64)));
        assert!(packed_source(128, DType::F16 as u32, &wide).contains("const HALF: u32 = 1u;"));
    }

    /// The packed kernel's p.v loop, marked `// @driver-unroll`, is the one loop of `main` whose
    /// SPIR-V asks the driver to unroll it. That rests on naga writing `main`'s loops in its IR's
    /// statement order, checked here on the same module written with debug lines (the `OpLine`
    /// before each `OpLoopMerge` is its loop's line). A marker before anything but a loop is an
    /// error.
    #[test]
    fn driver_unroll_marks_the_p_v_loop() {
        use super::super::spirv;
        const OP_LINE: u32 = 8;
        for (bq, d, dt) in [(64, 128, DType::F16), (64, 64, DType::BF16), (32, 128, DType::BF16), (32, 96, DType::F16)]
        {
            let p = Plan { kernel: Kernel::Packed, bq, bk: 64, nks: 0, pf: 0, tpk: 0 };
            let src = packed_source(d, dt as u32, &p);
            let module = naga::front::wgsl::parse_str(&src).unwrap();
            let mut spans = Vec::new();
            spirv::loop_spans(&module.entry_points[0].function.body, &mut spans);
            let lines: Vec<u32> = spans.iter().map(|s| s.location(&src).line_number).collect();
            // The same module with naga's debug lines (and no loop controls).
            let dbg = spirv::mt_module_with_lines(&src).unwrap();
            let merges = spirv::entry_loop_merges(&dbg).unwrap();
            let insts = spirv::instructions(&dbg).unwrap();
            let merge_lines: Vec<u32> = merges
                .iter()
                .map(|&m| {
                    insts.iter().rev().find(|&&(op, at)| op == OP_LINE && at < m).map_or(0, |&(_, at)| dbg[at + 2])
                })
                .collect();
            assert_eq!(merge_lines, lines, "{bq} rows, D {d}, {dt}");
            // The kernel's own module: one loop of main marked, the one after the marker.
            let words = spirv::mt_module(&src).unwrap();
            let controls: Vec<u32> =
                spirv::entry_loop_merges(&words).unwrap().iter().map(|&at| words[at + 3]).collect();
            assert_eq!(controls.len(), lines.len());
            let marked: Vec<usize> = (0..controls.len()).filter(|&i| controls[i] == 1).collect();
            assert!(marked.len() == 1 && controls.iter().all(|&c| c <= 1), "{controls:?}");
            let line = lines[marked[0]] as usize;
            let text: Vec<&str> = src.lines().collect();
            assert!(text[line - 1].trim_start().starts_with("for (var jj = 0u; jj < BK;"), "{}", text[line - 1]);
            assert_eq!(text[line - 2].trim(), spirv::DRIVER_UNROLL);
        }
        let loop_src = |marker_at_loop: bool| {
            let m = |here: bool| if here { spirv::DRIVER_UNROLL } else { "" };
            format!(
                "@compute @workgroup_size(1)\nfn main() {{\n    {}\n    var x = 0u;\n    {}\n    for (var i = 0u; i < 4u; i++) {{ x += i; }}\n}}\n",
                m(!marker_at_loop),
                m(marker_at_loop)
            )
        };
        let words = spirv::mt_module(&loop_src(true)).unwrap();
        let merges = spirv::entry_loop_merges(&words).unwrap();
        assert!(merges.len() == 1 && words[merges[0] + 3] == 1);
        let e = spirv::mt_module(&loop_src(false)).unwrap_err().to_string();
        assert!(e.contains("marks no loop"), "{e}");
        let e = spirv::mt_module(&format!("{}\n{}\n", loop_src(true).trim_end(), spirv::DRIVER_UNROLL)).unwrap_err();
        assert!(e.to_string().contains("last line"), "{e}");
    }

    #[test]
    fn packed_q_steps_follow_the_head_dim() {
        // 16 d a q.k iteration where D / 4 allows it (4 unrolled steps), else 8 or 4; in the
        // 64-row tile (Q^T and P^T 16-bit) 8 d an iteration at most.
        let cases = [(32, 128, 4), (32, 96, 4), (32, 24, 2), (32, 20, 1), (64, 128, 2), (64, 24, 2), (64, 20, 1)];
        for (bq, d, steps) in cases {
            let p = Plan { kernel: Kernel::Packed, bq, bk: 64, nks: 0, pf: 0, tpk: 0 };
            let s = packed_source(d, DType::F16 as u32, &p);
            assert!(s.contains(&format!("let cu = {}u;", steps - 1)), "{bq} rows, D {d}");
            assert!(!s.contains(&format!("let cu = {steps}u;")), "{bq} rows, D {d}");
        }
    }
}
