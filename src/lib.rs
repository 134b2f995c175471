//! # attnkit
//!
//! One attention contract, many kernels. Every backend implements [`AttentionBackend`], whose
//! provided [`forward`](AttentionBackend::forward) has one signature everywhere and takes an
//! optional caller-owned output buffer (and lse buffer): a model calls CUDA, any GPU through WGSL,
//! or the CPU the same way, and preallocates its outputs once.
//!
//! ```
//! use attnkit::{AttentionBackend, AttnCall, DType, Tensor};
//!
//! # fn main() -> attnkit::Result<()> {
//! let (b, s, h, d) = (1, 16, 4, 64);
//! let data = |seed: u64| -> Vec<f32> {
//!     (0..b * s * h * d).map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f32 / 500.0) - 1.0).collect()
//! };
//! let q = Tensor::from_f32(&[b, s, h, d], DType::F32, &data(1))?;
//! let k = Tensor::from_f32(&[b, s, h, d], DType::F32, &data(2))?;
//! let v = Tensor::from_f32(&[b, s, h, d], DType::F32, &data(3))?;
//!
//! // The best backend compiled in and present (cuda, then wgpu, then cpu, then reference).
//! let backend = attnkit::best(None)?.backend;
//! let (q, k, v) = (backend.upload(&q)?, backend.upload(&k)?, backend.upload(&v)?);
//! let call = AttnCall::dense(&q, &k, &v).causal(true);
//!
//! // Preallocate once, then every call writes into it.
//! let mut out = backend.alloc(q.shape(), q.dtype())?;
//! backend.forward(&call, Some(&mut out), None)?;
//! let out = backend.download(&out)?;
//! assert_eq!(out.shape(), &[b, s, h, d]);
//! # Ok(())
//! # }
//! ```
//!
//! | feature | backend | runs on |
//! |---|---|---|
//! | (always) | `reference` | host, f64 |
//! | `cpu` (default) | `cpu` | host, tiled online softmax, rayon |
//! | `wgpu` | `wgpu` | any GPU through WGSL |
//! | `cuda` | `cuda` | NVIDIA GPUs, kernels compiled at run time by NVRTC |
//! | `candle` | glue for `candle_core::Tensor` | CPU tensors, on the `cpu` backend |
//! | `candle-cuda` | the glue for CUDA tensors (candle-core's `cuda`: nvcc at build time) | CUDA tensors, on the `cuda` backend on candle's stream |
//! | `cli` | the `attnkit` command | |
//!
//! The contract (layouts, masks, tolerances, errors) is in `SPEC.md` terms: see [`AttnCall`].
#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod backend;
mod call;
#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "cli")]
pub mod casefile;
mod dispatch;
mod error;
pub mod reference;
mod stubs;
mod types;
mod validate;

pub use backend::{AttentionBackend, Outputs};
pub use call::{AttnCall, Capabilities, HeadDims, Layout, LayoutKind, Params, Problem};
pub use dispatch::{best, by_name, compiled, feature_of, is_compiled, Selection, BACKENDS};
pub use error::{Error, Result, Unsupported};
pub use types::{DType, Device, HostData, Storage, Tensor};
pub use validate::{key_range, validate, Checked, Seq};

cfg_if::cfg_if! {
    if #[cfg(feature = "cpu")] {
        #[path = "../backends/cpu/mod.rs"]
        pub mod cpu;
    } else {
        pub use stubs::cpu;
    }
}
cfg_if::cfg_if! {
    if #[cfg(feature = "wgpu")] {
        #[path = "../backends/wgpu/mod.rs"]
        pub mod wgpu;
    } else {
        pub use stubs::wgpu;
    }
}
cfg_if::cfg_if! {
    if #[cfg(feature = "cuda")] {
        #[path = "../backends/cuda/mod.rs"]
        pub mod cuda;
    } else {
        pub use stubs::cuda;
    }
}
