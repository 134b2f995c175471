//! Dtypes, devices and the device-tagged tensor every backend reads and writes.

use half::{bf16, f16};

use crate::error::{Error, Result};

/// Element types. Attention inputs are `F32`, `F16` or `BF16`; metadata is `I32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit signed integer (sequence metadata).
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// Lower-case name as in safetensors-style listings (`f32`, `f16`, `bf16`, `i32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        }
    }
    /// Parse `f32`, `f16`, `bf16`, `i32`.
    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(DType::F32),
            "f16" | "float16" | "half" => Some(DType::F16),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "i32" | "int32" => Some(DType::I32),
            _ => None,
        }
    }
    /// The three floating dtypes attention takes.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory (`cpu` and `reference` backends).
    Host,
    /// A CUDA device, by ordinal.
    Cuda(usize),
    /// A wgpu device, by an id unique within the process.
    Wgpu(u64),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Wgpu(i) => write!(f, "wgpu:{i}"),
        }
    }
}

/// Host memory, typed.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i32 elements.
    I32(Vec<i32>),
}

impl HostData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F16(_) => DType::F16,
            HostData::BF16(_) => DType::BF16,
            HostData::I32(_) => DType::I32,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::F16(v) => v.len(),
            HostData::BF16(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(vec![0.0; n]),
            DType::F16 => HostData::F16(vec![f16::ZERO; n]),
            DType::BF16 => HostData::BF16(vec![bf16::ZERO; n]),
            DType::I32 => HostData::I32(vec![0; n]),
        }
    }
    /// Round f64 values to `dtype`.
    pub fn from_f64(dtype: DType, v: &[f64]) -> HostData {
        match dtype {
            DType::F32 => HostData::F32(v.iter().map(|&x| x as f32).collect()),
            DType::F16 => HostData::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
            DType::BF16 => HostData::BF16(v.iter().map(|&x| bf16::from_f64(x)).collect()),
            DType::I32 => HostData::I32(v.iter().map(|&x| x as i32).collect()),
        }
    }
    /// Widen every element to f64.
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            HostData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            HostData::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            HostData::I32(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }
    /// Raw little-endian bytes.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            HostData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// Parse little-endian bytes of `dtype`; the length must be a multiple of its size.
    pub fn from_le_bytes(dtype: DType, b: &[u8]) -> Option<HostData> {
        if !b.len().is_multiple_of(dtype.size()) {
            return None;
        }
        Some(match dtype {
            DType::F32 => {
                HostData::F32(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            DType::I32 => {
                HostData::I32(b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            DType::F16 => HostData::F16(b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect()),
            DType::BF16 => HostData::BF16(b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect()),
        })
    }
}

/// The memory behind a [`Tensor`]: host vectors, or a backend's device buffer behind its feature.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Host(HostData),
    /// A CUDA allocation (feature `cuda`).
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
    /// A wgpu buffer (feature `wgpu`).
    #[cfg(feature = "wgpu")]
    Wgpu(crate::wgpu::WgpuStorage),
}

/// A dense, row-major, contiguous tensor on one device.
#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: Storage,
}

impl Tensor {
    /// A host tensor from typed data. Errors when the element count does not match the shape.
    pub fn from_host(shape: &[usize], data: HostData) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(Error::Shape {
                arg: "data",
                got: vec![data.len()],
                expected: format!("{n} elements for shape {shape:?}"),
            });
        }
        Ok(Tensor { shape: shape.to_vec(), dtype: data.dtype(), storage: Storage::Host(data) })
    }
    /// A host tensor of f64 values rounded to `dtype`.
    pub fn from_f64(shape: &[usize], dtype: DType, v: &[f64]) -> Result<Tensor> {
        Tensor::from_host(shape, HostData::from_f64(dtype, v))
    }
    /// A host tensor of f32 values converted to `dtype`.
    pub fn from_f32(shape: &[usize], dtype: DType, v: &[f32]) -> Result<Tensor> {
        let w: Vec<f64> = v.iter().map(|&x| x as f64).collect();
        Tensor::from_f64(shape, dtype, &w)
    }
    /// A host i32 tensor.
    pub fn from_i32(shape: &[usize], v: Vec<i32>) -> Result<Tensor> {
        Tensor::from_host(shape, HostData::I32(v))
    }
    /// Host zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        let n = shape.iter().product();
        Tensor { shape: shape.to_vec(), dtype, storage: Storage::Host(HostData::zeros(dtype, n)) }
    }
    /// Wrap a backend's storage. The backend guarantees the storage holds `shape.product()` elements of `dtype`.
    pub fn from_storage(shape: &[usize], dtype: DType, storage: Storage) -> Tensor {
        Tensor { shape: shape.to_vec(), dtype, storage }
    }
    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Element count.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
    /// Where the memory lives.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Host(_) => Device::Host,
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.device(),
            #[cfg(feature = "wgpu")]
            Storage::Wgpu(s) => s.device(),
        }
    }
    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    /// The storage, mutably.
    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }
    /// The host data, if the tensor is on the host.
    pub fn host(&self) -> Option<&HostData> {
        match &self.storage {
            Storage::Host(h) => Some(h),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    /// The host data, mutably, if the tensor is on the host.
    pub fn host_mut(&mut self) -> Option<&mut HostData> {
        match &mut self.storage {
            Storage::Host(h) => Some(h),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
    /// Host data widened to f64 (host tensors only; download device tensors through their backend first).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        self.host().map(HostData::to_f64).ok_or_else(|| Error::Device {
            arg: "tensor",
            got: self.device(),
            expected: Device::Host,
            backend: "host",
        })
    }
    /// Host i32 data (host i32 tensors only).
    pub fn as_i32(&self) -> Option<&[i32]> {
        match self.host() {
            Some(HostData::I32(v)) => Some(v),
            _ => None,
        }
    }
    /// A host copy (host tensors only).
    pub fn try_clone_host(&self) -> Result<Tensor> {
        let h = self.host().ok_or_else(|| Error::Device {
            arg: "tensor",
            got: self.device(),
            expected: Device::Host,
            backend: "host",
        })?;
        Ok(Tensor { shape: self.shape.clone(), dtype: self.dtype, storage: Storage::Host(h.clone()) })
    }
}
