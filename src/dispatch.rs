//! Runtime selection: by name, or the best backend present that supports a problem.

use crate::backend::AttentionBackend;
use crate::call::Problem;
use crate::error::{Error, Result};

/// Every backend name, fastest first: the order `best` tries them in.
pub const BACKENDS: [&str; 4] = ["cuda", "wgpu", "cpu", "reference"];

/// Names of the backends compiled into this build.
pub fn compiled() -> Vec<&'static str> {
    BACKENDS.into_iter().filter(|n| is_compiled(n)).collect()
}

/// Whether the named backend was compiled in.
pub fn is_compiled(name: &str) -> bool {
    (name == "cuda" && cfg!(feature = "cuda"))
        || (name == "wgpu" && cfg!(feature = "wgpu"))
        || (name == "cpu" && cfg!(feature = "cpu"))
        || name == "reference"
}

/// The cargo feature that builds a backend.
pub fn feature_of(name: &str) -> Option<&'static str> {
    match name {
        "cuda" => Some("cuda"),
        "wgpu" => Some("wgpu"),
        "cpu" => Some("cpu"),
        "reference" => Some("(always built)"),
        _ => None,
    }
}

/// A backend by name: `reference`, `cpu`, `wgpu` or `cuda`. A backend whose feature was off
/// answers [`Error::NotCompiled`]; one compiled in without a device answers [`Error::NoDevice`].
pub fn by_name(name: &str) -> Result<Box<dyn AttentionBackend>> {
    Ok(match name {
        "reference" => Box::new(crate::reference::ReferenceBackend::new()?),
        "cpu" => Box::new(crate::cpu::CpuBackend::new()?),
        "wgpu" => Box::new(crate::wgpu::WgpuBackend::new()?),
        "cuda" => Box::new(crate::cuda::CudaBackend::new()?),
        other => return Err(Error::UnknownBackend(other.to_string())),
    })
}

/// The chosen backend and why each faster one was passed over.
pub struct Selection {
    /// The backend.
    pub backend: Box<dyn AttentionBackend>,
    /// `(name, reason)` for each backend tried before it.
    pub skipped: Vec<(&'static str, String)>,
}

/// The fastest backend present that supports `problem` (any problem when `None`), with the reasons
/// the faster ones were skipped. `reference` supports everything, so this fails only if it is asked
/// to exclude nothing and every backend fails to start, which cannot happen.
pub fn best(problem: Option<&Problem>) -> Result<Selection> {
    let mut skipped = Vec::new();
    for name in BACKENDS {
        match by_name(name) {
            Ok(b) => match problem.map(|p| b.supports(p)) {
                Some(Err(u)) => skipped.push((name, u.reasons.join("; "))),
                _ => return Ok(Selection { backend: b, skipped }),
            },
            Err(e) => skipped.push((name, e.to_string())),
        }
    }
    Err(Error::Backend { backend: "reference", msg: "no backend could start".into() })
}
