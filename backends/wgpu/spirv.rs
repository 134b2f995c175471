//! SPIR-V for the cooperative-matrix kernel, written here by naga and then made correct under the
//! Vulkan memory model.
//!
//! A module with cooperative matrices must declare the Vulkan memory model, and naga 30 declares
//! it, but it still writes every workgroup load and store as a *private* access and every barrier
//! without availability or visibility operations (gfx-rs/wgpu#8805). Under that model a private
//! access is not ordered by a barrier with respect to other invocations, so a driver may move a
//! read of a tile in workgroup memory across the barrier that was meant to publish it. (On the
//! H200 this was not what made the kernel's output wrong, see flash_attn_coop.wgsl's note on its
//! workgroup arrays; the module is mended so that it is correct by the model it declares.)
//!
//! [`non_private_workgroup`] mends the words naga wrote: every access through a workgroup pointer
//! (loads, stores, cooperative-matrix loads and stores) gets `NonPrivatePointer`, and every barrier
//! gets `MakeAvailable | MakeVisible`, the semantics a GLSL compiler gives `barrier()` on shared
//! memory under the same model. A subgroup barrier (naga writes it for subgroup memory, a storage
//! class Vulkan does not have) orders workgroup memory instead: the coop kernel uses it between
//! the steps of a tile that touch only the subgroup's own rows. The module then goes to the driver
//! as it is (wgpu's pass-through shaders), since wgpu would otherwise write it again from the WGSL.

use super::backend_err;
use crate::error::Result;

const OP_MEMORY_MODEL: u32 = 14;
const OP_ENTRY_POINT: u32 = 15;
const OP_TYPE_POINTER: u32 = 32;
const OP_CONSTANT: u32 = 43;
const OP_FUNCTION: u32 = 54;
const OP_FUNCTION_PARAMETER: u32 = 55;
const OP_FUNCTION_END: u32 = 56;
const OP_VARIABLE: u32 = 59;
const OP_LOAD: u32 = 61;
const OP_STORE: u32 = 62;
const OP_ACCESS_CHAIN: u32 = 65;
const OP_IN_BOUNDS_ACCESS_CHAIN: u32 = 66;
const OP_PTR_ACCESS_CHAIN: u32 = 67;
const OP_COPY_OBJECT: u32 = 83;
const OP_CONTROL_BARRIER: u32 = 224;
const OP_MEMORY_BARRIER: u32 = 225;
const OP_LOOP_MERGE: u32 = 246;
const OP_COOP_LOAD: u32 = 4457;
const OP_COOP_STORE: u32 = 4458;

const STORAGE_WORKGROUP: u32 = 4;
/// Loop control: unroll (a hint to the driver).
const LOOP_CONTROL_UNROLL: u32 = 0x1;
const MEMORY_MODEL_VULKAN: u32 = 3;
/// Memory operand: the access takes part in inter-invocation ordering.
pub(crate) const NON_PRIVATE_POINTER: u32 = 0x20;
/// Memory semantics: an availability and a visibility operation on the storage classes named.
pub(crate) const MAKE_AVAILABLE_VISIBLE: u32 = 0x2000 | 0x4000;
/// Memory semantics: subgroup memory ordered (what naga writes for `subgroupBarrier`).
const SEM_SUBGROUP_MEMORY: u32 = 0x80;
/// Memory semantics: workgroup memory ordered.
const SEM_WORKGROUP_MEMORY: u32 = 0x100;

/// What [`non_private_workgroup`] changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mended {
    /// Loads and stores (plain and cooperative) through workgroup pointers now non-private.
    pub accesses: usize,
    /// Barriers whose semantics now make writes available and visible.
    pub barriers: usize,
}

/// The WGSL source `src` (one compute entry point, `main`) as SPIR-V words for Vulkan, with the
/// workgroup accesses and barriers mended (see the module's text).
///
/// Validated without naga's control-flow uniformity analysis: the kernel branches around
/// cooperative operations on values uniform in a subgroup (`subgroupAny`), and the analysis knows
/// only workgroup uniformity. Every other rule is checked.
///
/// Array indices are not clamped (buffer accesses are): every index of that shader is in range by
/// construction (its header says why), as in the micro-tile kernel ([`mt_module`]).
/// `ATTNKIT_WGPU_COOP_INDEX_CHECKS=1` restores the clamps (A/B).
pub(crate) fn coop_module(src: &str) -> Result<Vec<u32>> {
    let flags = naga::valid::ValidationFlags::all() - naga::valid::ValidationFlags::CONTROL_FLOW_UNIFORMITY;
    module(src, (1, 5), array_index_policy("ATTNKIT_WGPU_COOP_INDEX_CHECKS"), flags, false)
}

/// The micro-tile kernel's WGSL as SPIR-V 1.3 (Vulkan 1.1) with every storage-buffer access
/// clamped (`Restrict`, as wgpu would write it) but no clamp on array indices: each index of that
/// shader is in range by construction (its header says why), and naga's clamp on every
/// workgroup-memory index of the inner loops costs integer instructions beside each load and
/// keeps the driver from folding the loads' constant offsets. `ATTNKIT_WGPU_MT_INDEX_CHECKS=1`
/// restores the clamps (A/B).
pub(crate) fn mt_module(src: &str) -> Result<Vec<u32>> {
    module(src, (1, 3), array_index_policy("ATTNKIT_WGPU_MT_INDEX_CHECKS"), naga::valid::ValidationFlags::all(), false)
}

/// [`mt_module`]'s words with naga's debug lines (an `OpLine` before each loop, among others)
/// and no loop controls: for tests that map the words back to the source.
#[cfg(test)]
pub(crate) fn mt_module_with_lines(src: &str) -> Result<Vec<u32>> {
    module(src, (1, 3), array_index_policy("ATTNKIT_WGPU_MT_INDEX_CHECKS"), naga::valid::ValidationFlags::all(), true)
}

/// Array indices of a kernel whose indices are in range by construction: unclamped, unless the
/// environment variable `var` is `1` (clamped, for A/B timing).
fn array_index_policy(var: &str) -> naga::proc::BoundsCheckPolicy {
    if std::env::var(var).is_ok_and(|v| v == "1") {
        naga::proc::BoundsCheckPolicy::Restrict
    } else {
        naga::proc::BoundsCheckPolicy::Unchecked
    }
}

/// `src` as SPIR-V `lang` with array indices under `index` and buffer accesses clamped, validated
/// under `flags`; mended where the module declares the Vulkan memory model (see
/// [`non_private_workgroup`]). With `lines`, naga's debug lines are written and the loop controls
/// left out (tests).
fn module(
    src: &str,
    lang: (u8, u8),
    index: naga::proc::BoundsCheckPolicy,
    flags: naga::valid::ValidationFlags,
    lines: bool,
) -> Result<Vec<u32>> {
    let err = |what: &str, e: String| backend_err(format!("kernel module, {what}: {e}"));
    let module = naga::front::wgsl::parse_str(src).map_err(|e| err("WGSL", e.emit_to_string(src)))?;
    let info = naga::valid::Validator::new(flags, naga::valid::Capabilities::all())
        .validate(&module)
        .map_err(|e| err("WGSL validation", e.emit_to_string(src)))?;
    let options = naga::back::spv::Options {
        // SPIR-V 1.5 (Vulkan 1.2 and later, which every device with cooperative matrices has) for
        // the coop kernel, 1.3 for the portable one.
        lang_version: lang,
        flags: if lines { naga::back::spv::WriterFlags::DEBUG } else { naga::back::spv::WriterFlags::empty() },
        debug_info: lines.then_some(naga::back::spv::DebugInfo {
            source_code: src,
            file_name: "kernel.wgsl",
            language: naga::back::spv::SourceLanguage::WGSL,
        }),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index,
            buffer: naga::proc::BoundsCheckPolicy::Restrict,
            image_load: naga::proc::BoundsCheckPolicy::Restrict,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        // As wgpu is asked for the other kernels: every workgroup array is written before it is
        // read, and every loop is counted (see kernel.rs).
        zero_initialize_workgroup_memory: naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: false,
        ..Default::default()
    };
    let pipeline =
        naga::back::spv::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: "main".into() };
    let mut words = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
        .map_err(|e| err("SPIR-V", e.to_string()))?;
    non_private_workgroup(&mut words).map_err(|e| err("SPIR-V mending", e))?;
    // `ATTNKIT_WGPU_DRIVER_UNROLL=0` leaves the marked loops without the hint (A/B timing).
    if !lines && !std::env::var("ATTNKIT_WGPU_DRIVER_UNROLL").is_ok_and(|v| v == "0") {
        driver_unroll(src, &module, &mut words).map_err(|e| err("loop controls", e))?;
    }
    Ok(words)
}

/// The marker line before a loop of `main` that the driver is asked to unroll.
pub(crate) const DRIVER_UNROLL: &str = "// @driver-unroll";

/// Give each loop of the entry point `main` whose `for` follows a line [`DRIVER_UNROLL`] the
/// `Unroll` loop control, a hint that the Vulkan driver may take (naga writes no loop control).
/// The loops of `main` in naga's IR, in statement order, are its `OpLoopMerge`s in the words, in
/// order; their counts must agree, and every marker must mark a loop. Returns the loops marked.
///
/// The host unrolls the loops marked `// @unroll` itself (`super::unroll`); this is for loops
/// too long for that, whose unrolling the driver does better with its own register allocation:
/// on an H100, the packed kernel's p.v loop unrolled ran 1.04x (bf16) / 1.005x (f16) faster
/// (docs/PERF_NOTES.md, wgpu v27).
pub(crate) fn driver_unroll(src: &str, module: &naga::Module, words: &mut [u32]) -> std::result::Result<usize, String> {
    // Where each marked loop starts: the first character of the line after the marker.
    let mut targets = Vec::new();
    let mut offset = 0;
    let mut marked = false;
    for (n, line) in src.split_inclusive('\n').enumerate() {
        let text = line.trim_start();
        if marked {
            targets.push((n, offset + line.len() - text.len()));
        }
        marked = text.trim_end() == DRIVER_UNROLL;
        offset += line.len();
    }
    if marked {
        return Err(format!("`{DRIVER_UNROLL}` on the last line"));
    }
    if targets.is_empty() {
        return Ok(0);
    }
    let ep = module.entry_points.iter().find(|e| e.name == "main").ok_or("no entry point `main`")?;
    let mut spans = Vec::new();
    loop_spans(&ep.function.body, &mut spans);
    let merges = entry_loop_merges(words)?;
    if merges.len() != spans.len() {
        return Err(format!("main has {} loops in naga's IR but {} OpLoopMerge", spans.len(), merges.len()));
    }
    for &(line, start) in &targets {
        let i = spans
            .iter()
            .position(|s| s.to_range().is_some_and(|r| r.start == start))
            .ok_or_else(|| format!("`{DRIVER_UNROLL}` before line {} marks no loop of `main`", line + 1))?;
        words[merges[i] + 3] = LOOP_CONTROL_UNROLL;
    }
    Ok(targets.len())
}

/// Where the `OpLoopMerge`s of the (one) entry point's function are, in order: between its
/// `OpFunction` and its `OpFunctionEnd`.
pub(crate) fn entry_loop_merges(words: &[u32]) -> std::result::Result<Vec<usize>, String> {
    let insts = instructions(words)?;
    let f =
        insts.iter().find(|&&(op, _)| op == OP_ENTRY_POINT).map(|&(_, at)| words[at + 2]).ok_or("no OpEntryPoint")?;
    let first =
        insts.iter().position(|&(op, at)| op == OP_FUNCTION && words[at + 2] == f).ok_or("no OpFunction of main")?;
    Ok(insts[first..]
        .iter()
        .take_while(|&&(op, _)| op != OP_FUNCTION_END)
        .filter(|&&(op, _)| op == OP_LOOP_MERGE)
        .map(|&(_, at)| at)
        .collect())
}

/// The spans of the loops in `block`, in the order naga's SPIR-V writer emits them (a loop, then
/// the loops of its body and continuing; an `if`'s accept block, then its reject block).
pub(crate) fn loop_spans(block: &naga::Block, out: &mut Vec<naga::Span>) {
    for (st, span) in block.span_iter() {
        match st {
            naga::Statement::Block(b) => loop_spans(b, out),
            naga::Statement::If { accept, reject, .. } => {
                loop_spans(accept, out);
                loop_spans(reject, out);
            }
            naga::Statement::Switch { cases, .. } => cases.iter().for_each(|c| loop_spans(&c.body, out)),
            naga::Statement::Loop { body, continuing, .. } => {
                out.push(*span);
                loop_spans(body, out);
                loop_spans(continuing, out);
            }
            _ => {}
        }
    }
}

/// Mark every access through a workgroup pointer `NonPrivatePointer` and give every barrier
/// `MakeAvailable | MakeVisible`, with subgroup memory in its semantics replaced by workgroup
/// memory. A module under another memory model is left as it is (those flags belong to the Vulkan
/// model alone).
pub(crate) fn non_private_workgroup(words: &mut Vec<u32>) -> std::result::Result<Mended, String> {
    let insts = instructions(words)?;
    let vulkan = insts.iter().any(|&(op, at)| op == OP_MEMORY_MODEL && words.get(at + 2) == Some(&MEMORY_MODEL_VULKAN));
    if !vulkan {
        return Ok(Mended::default());
    }
    // Barrier semantics are ids of integer constants; each distinct one gets a twin with the
    // extra bits, defined right after it.
    let mut bound = words[3];
    let mut twins: Vec<(u32, u32)> = Vec::new();
    for &(op, at) in &insts {
        let sem_at = match op {
            OP_CONTROL_BARRIER => at + 3,
            OP_MEMORY_BARRIER => at + 2,
            _ => continue,
        };
        let id = *words.get(sem_at).ok_or("barrier without semantics")?;
        if !twins.iter().any(|&(old, _)| old == id) {
            twins.push((id, bound));
            bound += 1;
        }
    }
    let twin = |id: u32| twins.iter().find(|&&(old, _)| old == id).map(|&(_, new)| new);

    let mut wg_types: Vec<u32> = Vec::new();
    let mut wg_ptrs: Vec<u32> = Vec::new();
    let mut out = Vec::with_capacity(words.len() + 64);
    out.extend_from_slice(&words[..5]);
    out[3] = bound;
    let mut mended = Mended::default();
    let mut defined = 0;
    for &(op, at) in &insts {
        let len = (words[at] >> 16) as usize;
        let orig = &words[at..at + len];
        let mut inst = orig.to_vec();
        let operand = |i: usize| orig.get(i).copied().ok_or(format!("opcode {op}: operand {i} missing"));
        match op {
            OP_TYPE_POINTER if operand(2)? == STORAGE_WORKGROUP => wg_types.push(operand(1)?),
            OP_VARIABLE
            | OP_FUNCTION_PARAMETER
            | OP_ACCESS_CHAIN
            | OP_IN_BOUNDS_ACCESS_CHAIN
            | OP_PTR_ACCESS_CHAIN
            | OP_COPY_OBJECT
                if wg_types.contains(&operand(1)?) =>
            {
                wg_ptrs.push(operand(2)?)
            }
            OP_LOAD if wg_ptrs.contains(&operand(3)?) => {
                add_memory_operand(&mut inst, 4);
                mended.accesses += 1;
            }
            OP_STORE if wg_ptrs.contains(&operand(1)?) => {
                add_memory_operand(&mut inst, 3);
                mended.accesses += 1;
            }
            // Result type, result, pointer, layout, stride, memory operands.
            OP_COOP_LOAD if wg_ptrs.contains(&operand(3)?) => {
                operand(5).map_err(|_| "cooperative load without a stride")?;
                add_memory_operand(&mut inst, 6);
                mended.accesses += 1;
            }
            // Pointer, object, layout, stride, memory operands.
            OP_COOP_STORE if wg_ptrs.contains(&operand(1)?) => {
                operand(4).map_err(|_| "cooperative store without a stride")?;
                add_memory_operand(&mut inst, 5);
                mended.accesses += 1;
            }
            OP_CONTROL_BARRIER | OP_MEMORY_BARRIER => {
                let sem_at = if op == OP_CONTROL_BARRIER { 3 } else { 2 };
                inst[sem_at] = twin(inst[sem_at]).ok_or("barrier semantics without a twin")?;
                mended.barriers += 1;
            }
            _ => {}
        }
        out.extend_from_slice(&inst);
        if op == OP_CONSTANT {
            if let Some(new) = twin(operand(2)?) {
                if len != 4 {
                    return Err(format!("barrier semantics constant {} is not a 32-bit integer", operand(2)?));
                }
                out.extend_from_slice(&[(4 << 16) | OP_CONSTANT, operand(1)?, new, twin_semantics(operand(3)?)]);
                defined += 1;
            }
        }
    }
    // Each twin is written once, right after its original; an original that is no OpConstant
    // leaves its twin unwritten.
    if defined != twins.len() {
        return Err("a barrier's semantics is not an OpConstant".into());
    }
    *words = out;
    Ok(mended)
}

/// The mended barrier semantics: availability and visibility added, and subgroup memory (naga's
/// `subgroupBarrier`) read as workgroup memory, the storage its callers order.
fn twin_semantics(sem: u32) -> u32 {
    let sem = if sem & SEM_SUBGROUP_MEMORY != 0 { (sem & !SEM_SUBGROUP_MEMORY) | SEM_WORKGROUP_MEMORY } else { sem };
    sem | MAKE_AVAILABLE_VISIBLE
}

/// Set `NonPrivatePointer` in the memory-operand mask at word `at` of `inst`, adding the mask if
/// the instruction has none.
fn add_memory_operand(inst: &mut Vec<u32>, at: usize) {
    if at < inst.len() {
        inst[at] |= NON_PRIVATE_POINTER;
    } else {
        inst.push(NON_PRIVATE_POINTER);
        inst[0] = ((inst.len() as u32) << 16) | (inst[0] & 0xffff);
    }
}

/// (opcode, first word) of every instruction after the five-word header.
pub(crate) fn instructions(words: &[u32]) -> std::result::Result<Vec<(u32, usize)>, String> {
    if words.len() < 5 || words[0] != 0x0723_0203 {
        return Err("not a SPIR-V module".into());
    }
    let mut v = Vec::new();
    let mut at = 5;
    while at < words.len() {
        let len = (words[at] >> 16) as usize;
        if len == 0 || at + len > words.len() {
            return Err(format!("bad instruction length {len} at word {at}"));
        }
        v.push((words[at] & 0xffff, at));
        at += len;
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every workgroup access of the specialised kernel is non-private, every barrier makes its
    /// writes available and visible, and the accesses through other storage are untouched.
    fn check(words: &[u32]) -> (usize, usize, usize) {
        let insts = instructions(words).unwrap();
        let mut wg_types = Vec::new();
        let mut wg_ptrs = Vec::new();
        let mut consts = std::collections::HashMap::new();
        let (mut wg_access, mut barriers, mut subgroup) = (0, 0, 0);
        for &(op, at) in &insts {
            let w = |i: usize| words[at + i];
            let len = (words[at] >> 16) as usize;
            match op {
                OP_TYPE_POINTER if w(2) == STORAGE_WORKGROUP => wg_types.push(w(1)),
                OP_VARIABLE | OP_ACCESS_CHAIN | OP_IN_BOUNDS_ACCESS_CHAIN | OP_PTR_ACCESS_CHAIN
                    if wg_types.contains(&w(1)) =>
                {
                    wg_ptrs.push(w(2))
                }
                OP_CONSTANT => {
                    consts.insert(w(2), w(3));
                }
                OP_LOAD | OP_STORE | OP_COOP_LOAD | OP_COOP_STORE => {
                    let (ptr, mask_at) = match op {
                        OP_LOAD => (w(3), 4),
                        OP_STORE => (w(1), 3),
                        OP_COOP_LOAD => (w(3), 6),
                        _ => (w(1), 5),
                    };
                    let mask = if mask_at < len { w(mask_at) } else { 0 };
                    if wg_ptrs.contains(&ptr) {
                        assert_ne!(mask & NON_PRIVATE_POINTER, 0, "workgroup access at word {at} is private");
                        wg_access += 1;
                    } else {
                        assert_eq!(mask & NON_PRIVATE_POINTER, 0, "non-workgroup access at word {at} was changed");
                    }
                }
                OP_CONTROL_BARRIER => {
                    let sem = consts[&w(3)];
                    assert_eq!(sem & MAKE_AVAILABLE_VISIBLE, MAKE_AVAILABLE_VISIBLE, "barrier at word {at}: {sem:#x}");
                    // Every barrier orders workgroup memory, a subgroup one too.
                    assert_eq!(
                        sem & (SEM_WORKGROUP_MEMORY | SEM_SUBGROUP_MEMORY),
                        SEM_WORKGROUP_MEMORY,
                        "barrier at word {at}: {sem:#x}"
                    );
                    barriers += 1;
                    // Execution scope 3: subgroup.
                    subgroup += usize::from(consts[&w(1)] == 3);
                }
                _ => {}
            }
        }
        (wg_access, barriers, subgroup)
    }

    #[test]
    fn coop_kernel_spirv_is_mended_for_the_vulkan_memory_model() {
        for (d, nw, bk) in [(32, 1, 16), (64, 4, 32), (128, 4, 32), (96, 2, 32)] {
            let src = super::super::kernel::coop_source(d, nw, bk);
            let words = coop_module(&src).unwrap();
            let (acc, bar, sub) = check(&words);
            eprintln!("d {d} nw {nw} bk {bk}: {acc} workgroup accesses, {bar} barriers mended ({sub} subgroup)");
            // Q, K/V, S, P and O all pass through workgroup memory, behind a dozen barriers, the
            // steps of a subgroup's own rows behind subgroup barriers.
            assert!(acc > 20 && bar > 5 && sub > 0, "d {d}: {acc} workgroup accesses, {bar} barriers, {sub} subgroup");
            // Mending twice finds the same accesses, already marked.
            let mut again = words.clone();
            let m = non_private_workgroup(&mut again).unwrap();
            assert_eq!((m.accesses, m.barriers), (acc, bar));
            assert_eq!(check(&again), (acc, bar, sub));
        }
    }

    #[test]
    fn a_module_under_the_glsl450_model_is_left_alone() {
        let src = "var<workgroup> t: array<u32, 64>;\n@group(0) @binding(0) var<storage, read_write> o: array<u32>;\n\
                   @compute @workgroup_size(64) fn main(@builtin(local_invocation_index) i: u32) {\n\
                   t[i] = i; workgroupBarrier(); o[i] = t[63u - i]; }";
        let module = naga::front::wgsl::parse_str(src).unwrap();
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(&module)
            .unwrap();
        let mut words = naga::back::spv::write_vec(&module, &info, &Default::default(), None).unwrap();
        let before = words.clone();
        assert_eq!(non_private_workgroup(&mut words).unwrap(), Mended::default());
        assert_eq!(words, before);
    }

    #[test]
    fn malformed_words_are_an_error_not_a_panic() {
        assert!(non_private_workgroup(&mut vec![1, 2, 3]).is_err());
        let mut w = vec![0x0723_0203, 0x0001_0500, 0, 10, 0, 0x0005_0000];
        assert!(non_private_workgroup(&mut w).is_err());
    }
}
