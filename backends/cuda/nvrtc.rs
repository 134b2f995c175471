//! Run-time compilation: kernel sources are embedded, compiled by NVRTC to a cubin for the
//! device's architecture, and cached on disk keyed by (source, options, architecture, NVRTC
//! version), so a warm process only reads a file and loads a module.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nrt, sys as nsys};

/// Prepended to every kernel source.
const COMMON: &str = include_str!("../../kernels/common.cuh");
const SIMT: &str = include_str!("../../kernels/attn_simt.cu");
// Both split-KV kernels carry the combine kernel that merges their partials.
const DECODE: &str =
    concat!(include_str!("../../kernels/attn_decode.cu"), include_str!("../../kernels/attn_combine.cuh"));
// The tensor-core kernel's Hopper variant (WG=1) takes its wgmma wrappers from wgmma.cuh.
const MMA: &str = concat!(
    include_str!("../../kernels/wgmma.cuh"),
    include_str!("../../kernels/attn_mma.cu"),
    include_str!("../../kernels/attn_combine.cuh")
);

/// The kernel sources, by family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// CUDA-core flash attention (every dtype).
    Simt,
    /// Split-KV decode and its combine kernel.
    Decode,
    /// Tensor-core FlashAttention-2 (f16, bf16).
    Mma,
}

impl Family {
    fn source(self) -> &'static str {
        match self {
            Family::Simt => SIMT,
            Family::Decode => DECODE,
            Family::Mma => MMA,
        }
    }
    /// The file name under `kernels/`.
    pub fn file(self) -> &'static str {
        match self {
            Family::Simt => "attn_simt.cu",
            Family::Decode => "attn_decode.cu",
            Family::Mma => "attn_mma.cu",
        }
    }
}

/// Whether the NVRTC library can be loaded in this process.
pub fn available() -> bool {
    // With `candle-cuda`, candle-core links cudarc to the CUDA libraries (its `dynamic-linking`),
    // so the process could not have started without them.
    #[cfg(feature = "candle-cuda")]
    return true;
    #[cfg(not(feature = "candle-cuda"))]
    // SAFETY: only tries to open the shared library by its usual names; nothing is called.
    unsafe {
        nsys::is_culib_present()
    }
}

/// `major.minor` of the loaded NVRTC.
pub fn version() -> Result<(i32, i32), String> {
    if !available() {
        return Err("the NVRTC library (libnvrtc) cannot be loaded".into());
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: NVRTC is loadable (checked above); both pointers are valid for writes.
    let r = unsafe { nsys::nvrtcVersion(&mut a, &mut b) };
    r.result().map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((a, b))
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &x in *p {
            h ^= x as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The on-disk cache folder: `$ATTNKIT_CACHE_DIR`, else `$XDG_CACHE_HOME/attnkit`, else
/// `~/.cache/attnkit`. `ATTNKIT_CACHE_DIR=off` disables it.
pub fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("ATTNKIT_CACHE_DIR") {
        return if d == "off" || d.is_empty() { None } else { Some(PathBuf::from(d)) };
    }
    if let Ok(d) = std::env::var("XDG_CACHE_HOME") {
        if !d.is_empty() {
            return Some(PathBuf::from(d).join("attnkit"));
        }
    }
    std::env::var("HOME").ok().filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".cache").join("attnkit"))
}

/// Compile `family` with `defines` for `arch` (`sm_90`) to a cubin. No disk cache.
pub fn compile(family: Family, defines: &[(&str, i64)], arch: &str) -> Result<Vec<u8>, String> {
    let src = format!("{COMMON}\n{}", family.source());
    let opts = options(defines, arch);
    compile_src(&src, family.file(), &opts)
}

/// The architecture a variant compiles for: Hopper's warpgroup MMAs (`WG=1`) need the
/// architecture-specific target `sm_90a`.
pub fn target_arch(defines: &[(&str, i64)], arch: &str) -> String {
    if arch == "sm_90" && defines.contains(&("WG", 1)) {
        "sm_90a".to_string()
    } else {
        arch.to_string()
    }
}

fn options(defines: &[(&str, i64)], arch: &str) -> Vec<String> {
    let arch = target_arch(defines, arch);
    let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".to_string()];
    o.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    o
}

/// Cubin of `family` with `defines` for `arch`, from the disk cache when present.
/// Returns the cubin and whether it came from the cache.
pub fn cubin(family: Family, defines: &[(&str, i64)], arch: &str) -> Result<(Vec<u8>, bool), String> {
    let src = format!("{COMMON}\n{}", family.source());
    let opts = options(defines, arch);
    let (va, vb) = version()?;
    let ver = format!("nvrtc {va}.{vb}");
    let key = fnv1a(&[src.as_bytes(), opts.join(" ").as_bytes(), ver.as_bytes()]);
    let stem = family.file().trim_end_matches(".cu");
    let path = cache_dir().map(|d| d.join(format!("{stem}-{arch}-{key:016x}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if bytes.len() > 16 {
                return Ok((bytes, true));
            }
        }
    }
    let bin = compile_src(&src, family.file(), &opts)?;
    if let Some(p) = &path {
        // Best effort: a read-only home must not fail the call. Write, then rename, so a
        // concurrent reader never sees half a file.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &bin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok((bin, false))
}

fn compile_src(src: &str, name: &str, opts: &[String]) -> Result<Vec<u8>, String> {
    if !available() {
        return Err("the NVRTC library (libnvrtc) cannot be loaded".into());
    }
    let csrc = CString::new(src).map_err(|e| e.to_string())?;
    let cname = CString::new(name).map_err(|e| e.to_string())?;
    let prog = nrt::create_program(&csrc, Some(&cname)).map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` was just created and is destroyed exactly once below; every buffer handed to
    // NVRTC is sized from the size NVRTC reported.
    let out = unsafe {
        let res = nrt::compile_program(prog, opts);
        let log = nrt::get_program_log(prog)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default();
        match res {
            Err(e) => Err(format!("NVRTC failed on {name} ({e:?}) with {}:\n{log}", opts.join(" "))),
            Ok(()) => {
                let mut n = 0usize;
                match nsys::nvrtcGetCUBINSize(prog, &mut n).result() {
                    Err(e) => Err(format!("nvrtcGetCUBINSize: {e:?}")),
                    Ok(()) if n == 0 => Err(format!("NVRTC produced no cubin for {name} (is the architecture real?)")),
                    Ok(()) => {
                        let mut buf = vec![0u8; n];
                        nsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                            .result()
                            .map(|_| buf)
                            .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))
                    }
                }
            }
        }
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { nrt::destroy_program(prog) };
    out
}
