//! Timing of the wgpu backend, against the cuda backend in the same run when that is compiled in
//! and finds a device. Ignored by default (run with `--ignored --nocapture`); `ATTNKIT_BENCH_QUICK=1`
//! shrinks every shape for a smoke run on a software adapter.
//!
//! Every timed call writes into preallocated caller buffers; inputs are random (never zeros);
//! the device is synchronised before the clock stops; the figure is the median of 5 repetitions.
#![cfg(feature = "wgpu")]

mod common;

use std::time::Instant;

use attnkit::{AttentionBackend, AttnCall, DType, Tensor};
use common::Rng;

struct Shape {
    dtype: DType,
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
    /// Paged, with this block size (a shuffled block table); 0 = dense.
    block: usize,
}

impl Shape {
    fn name(&self) -> String {
        let layout = if self.block == 0 { "dense".to_string() } else { format!("paged{}", self.block) };
        format!(
            "{} {layout}{} B{} Hq{}/Hkv{} Sq{} Sk{} D{}",
            self.dtype,
            if self.causal { " causal" } else { "" },
            self.b,
            self.hq,
            self.hkv,
            self.sq,
            self.sk,
            self.d
        )
    }
    fn flops(&self) -> f64 {
        let pairs = if self.causal && self.sq == self.sk {
            (self.sq * (self.sq + 1) / 2) as f64
        } else {
            (self.sq * self.sk) as f64
        };
        4.0 * (self.b * self.hq) as f64 * pairs * self.d as f64
    }
    /// Bytes of K and V read once (the decode figure of merit).
    fn kv_bytes(&self) -> f64 {
        2.0 * (self.b * self.sk * self.hkv * self.d * self.dtype.size()) as f64
    }
}

fn random(shape: &[usize], dtype: DType, rng: &mut Rng) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_f64(shape, dtype, &rng.vec(n, 1.5)).unwrap()
}

/// Median seconds per call.
fn time(be: &dyn AttentionBackend, s: &Shape, rng: &mut Rng) -> attnkit::Result<f64> {
    Ok(time_each(&[be], s, rng)?[0])
}

/// Median seconds per call of each backend, on the same inputs (uploaded once through the
/// first: the backends must share its device).
fn time_each(bes: &[&dyn AttentionBackend], s: &Shape, rng: &mut Rng) -> attnkit::Result<Vec<f64>> {
    let be = bes[0];
    let (b, hq, hkv, sq, sk, d) = (s.b, s.hq, s.hkv, s.sq, s.sk, s.d);
    let q = be.upload(&random(&[b, sq, hq, d], s.dtype, rng))?;
    let (k, v, cu_q, bt, sl, max_blocks);
    if s.block == 0 {
        k = be.upload(&random(&[b, sk, hkv, d], s.dtype, rng))?;
        v = be.upload(&random(&[b, sk, hkv, d], s.dtype, rng))?;
        cu_q = vec![];
        bt = vec![];
        sl = vec![];
        max_blocks = 0;
    } else {
        max_blocks = sk.div_ceil(s.block);
        let nb = b * max_blocks;
        k = be.upload(&random(&[nb, s.block, hkv, d], s.dtype, rng))?;
        v = be.upload(&random(&[nb, s.block, hkv, d], s.dtype, rng))?;
        cu_q = (0..=b as i32).map(|i| i * sq as i32).collect::<Vec<_>>();
        // A shuffled block table: pages of one sequence are not contiguous.
        let mut perm: Vec<i32> = (0..nb as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        bt = perm;
        sl = vec![sk as i32; b];
    }
    let q2;
    let q = if s.block == 0 {
        &q
    } else {
        q2 = be.upload(&random(&[b * sq, hq, d], s.dtype, rng))?;
        &q2
    };
    let call = if s.block == 0 {
        AttnCall::dense(q, &k, &v).causal(s.causal)
    } else {
        AttnCall::paged(q, &k, &v, &cu_q, &bt, max_blocks, &sl).causal(s.causal)
    };
    let mut out = be.alloc(q.shape(), s.dtype)?;
    let mut medians = Vec::new();
    for be in bes {
        be.forward(&call, Some(&mut out), None)?; // warm-up: compile, allocate scratch
        be.synchronize()?;
        let t0 = Instant::now();
        be.forward(&call, Some(&mut out), None)?;
        be.synchronize()?;
        let once = t0.elapsed().as_secs_f64();
        let iters = ((0.3 / once) as usize).clamp(1, 200);
        let mut reps = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..iters {
                be.forward(&call, Some(&mut out), None)?;
            }
            be.synchronize()?;
            reps.push(t0.elapsed().as_secs_f64() / iters as f64);
        }
        reps.sort_by(|a, b| a.partial_cmp(b).unwrap());
        medians.push(reps[2]);
    }
    Ok(medians)
}

#[test]
#[ignore]
fn bench() {
    let quick = std::env::var("ATTNKIT_BENCH_QUICK").is_ok();
    let div = if quick { 16 } else { 1 };
    let prefill = |dtype, causal| Shape {
        dtype,
        b: 4,
        hq: 16,
        hkv: 16,
        sq: 4096 / div,
        sk: 4096 / div,
        d: 128,
        causal,
        block: 0,
    };
    let decode =
        |hkv| Shape { dtype: DType::F16, b: 16, hq: 32, hkv, sq: 1, sk: 4096 / div, d: 128, causal: true, block: 16 };
    // Prefill from a paged cache (blocks of 16, shuffled): the dense prefill's work.
    let paged = |dtype| Shape { block: 16, ..prefill(dtype, false) };
    let shapes = [
        prefill(DType::F16, false),
        prefill(DType::BF16, false),
        prefill(DType::F32, false),
        prefill(DType::F16, true),
        paged(DType::F16),
        paged(DType::BF16),
        decode(32),
        decode(8),
    ];
    let wgpu = attnkit::wgpu::WgpuBackend::new().expect("wgpu adapter");
    eprintln!(
        "wgpu adapter: {}, workgroup memory {} bytes, head dims {}",
        wgpu.adapter_name(),
        wgpu.limits().max_compute_workgroup_storage_size,
        wgpu.capabilities().head_dims
    );
    let cuda = attnkit::by_name("cuda").ok();
    // The other kernel variants on the prefill and MHA decode shapes, for the notes.
    let mut mt = wgpu.clone();
    mt.set_kernel(Some(attnkit::wgpu::Kernel::MicroTile));
    let mut packed = wgpu.clone();
    packed.set_kernel(Some(attnkit::wgpu::Kernel::Packed));
    let mut rng = Rng::new(1);
    eprintln!("| shape | wgpu ms | wgpu TFLOP/s | wgpu KV GB/s | cuda ms | wgpu/cuda time | other wgpu kernels ms |");
    eprintln!("|---|---|---|---|---|---|---|");
    // `ATTNKIT_BENCH_ONLY=text`: only the shapes whose name contains it (for tuning sweeps).
    let only = std::env::var("ATTNKIT_BENCH_ONLY").unwrap_or_default();
    // `ATTNKIT_BENCH_LEAN=1`: the default kernel alone, no other kernel or backend (A/B sweeps).
    let lean = std::env::var("ATTNKIT_BENCH_LEAN").is_ok_and(|v| v == "1");
    for s in shapes.iter().filter(|s| s.name().contains(&only)) {
        // Prefill (non-causal f16 and bf16, dense or paged): the portable kernels, packed and
        // micro-tile, where the default is another one; decode: the micro-tile kernel; timed on
        // the same inputs as the default (same device).
        let mut bes: Vec<&dyn AttentionBackend> = vec![&wgpu];
        if !lean {
            if s.block != 0 && s.hkv == 32 {
                bes.push(&mt);
            } else if s.sq > 1 && !s.causal && s.dtype != DType::F32 {
                if s.dtype == DType::F16 && wgpu.has_cooperative_matrices() {
                    bes.push(&packed);
                }
                bes.push(&mt);
            }
        }
        let (tw, to) = match time_each(&bes, s, &mut rng) {
            Ok(t) => (
                t[0],
                (t.len() > 1).then(|| t[1..].iter().map(|x| format!("{:.3}", x * 1e3)).collect::<Vec<_>>().join(" / ")),
            ),
            Err(e) => {
                eprintln!("| {} | error: {e} |", s.name());
                continue;
            }
        };
        let tc = cuda.as_ref().filter(|_| !lean).and_then(|c| time(&**c, s, &mut rng).ok());
        eprintln!(
            "| {} | {:.3} | {:.2} | {:.0} | {} | {} | {} |",
            s.name(),
            tw * 1e3,
            s.flops() / tw / 1e12,
            s.kv_bytes() / tw / 1e9,
            tc.map(|t| format!("{:.3}", t * 1e3)).unwrap_or("-".into()),
            tc.map(|t| format!("{:.2}", tw / t)).unwrap_or("-".into()),
            to.unwrap_or("-".into()),
        );
    }
}

/// A tuning sweep of the `Rows` kernel on the bench's paged decode shapes: each
/// [`attnkit::wgpu::RowsTuning`] on the same inputs in one process, the default timed first and
/// last (the drift of the run). `ATTNKIT_BENCH_ONLY=text` picks shapes as in `bench`.
#[test]
#[ignore]
fn sweep_decode() {
    use attnkit::wgpu::RowsTuning;
    let quick = std::env::var("ATTNKIT_BENCH_QUICK").is_ok();
    let div = if quick { 16 } else { 1 };
    let only = std::env::var("ATTNKIT_BENCH_ONLY").unwrap_or_default();
    let base = RowsTuning::default();
    let mut tunings = vec![base];
    for prefetch in [false, true] {
        for k in [2, 4, 8] {
            for parts_per_key in [2, 4, 8] {
                tunings.push(RowsTuning { prefetch, keys_per_slot: [k, k, 4], parts_per_key, ..base });
            }
        }
    }
    for parts_per_key in [2, 4] {
        tunings.push(RowsTuning { threads: 256, keys_per_slot: [2, 2, 4], parts_per_key, ..base });
    }
    for min_keys_per_split in [64, 128, 512] {
        for target_workgroups in [4096, 8192] {
            tunings.push(RowsTuning { min_keys_per_split, target_workgroups, ..base });
        }
    }
    tunings.push(base);
    let wgpu = attnkit::wgpu::WgpuBackend::new().expect("wgpu adapter");
    eprintln!("wgpu adapter: {}", wgpu.adapter_name());
    let bes: Vec<_> = tunings
        .iter()
        .map(|t| {
            let mut be = wgpu.clone();
            be.set_rows_tuning(Some(*t));
            be
        })
        .collect();
    let refs: Vec<&dyn AttentionBackend> = bes.iter().map(|b| b as &dyn AttentionBackend).collect();
    let mut rng = Rng::new(2);
    for hkv in [32, 8] {
        let s = Shape { dtype: DType::F16, b: 16, hq: 32, hkv, sq: 1, sk: 4096 / div, d: 128, causal: true, block: 16 };
        if !s.name().contains(&only) {
            continue;
        }
        let times = time_each(&refs, &s, &mut rng).expect("timing");
        eprintln!("{}", s.name());
        eprintln!("| prefetch | keys/slot (1-2, 4, 8-16 rows) | threads | parts/key | target wgs | min keys/split | ms | KV GB/s | default / this |");
        eprintln!("|---|---|---|---|---|---|---|---|---|");
        for (t, &tm) in tunings.iter().zip(&times) {
            eprintln!(
                "| {} | {:?} | {} | {} | {} | {} | {:.3} | {:.0} | {:.2} |",
                t.prefetch,
                t.keys_per_slot,
                t.threads,
                t.parts_per_key,
                t.target_workgroups,
                t.min_keys_per_split,
                tm * 1e3,
                s.kv_bytes() / tm / 1e9,
                times[0] / tm
            );
        }
    }
    // The per-call floor: a decode call with almost no work (one sequence of 256 keys).
    let tiny = Shape { dtype: DType::F16, b: 1, hq: 32, hkv: 8, sq: 1, sk: 256, d: 128, causal: true, block: 16 };
    let t = time_each(&refs[..1], &tiny, &mut rng).expect("timing")[0];
    eprintln!("per-call floor ({}): {:.3} ms", tiny.name(), t * 1e3);
}

/// What the Vulkan driver says of each kernel the bench times: its statistics (on NVIDIA the
/// register count and code size) and any internal representation it offers, through
/// `VK_KHR_pipeline_executable_properties`, on the first non-CPU Vulkan device (else the first).
/// The modules are naga's SPIR-V of the kernels ([`attnkit::wgpu::bench_kernel_modules`]).
/// `ATTNKIT_STATS_DIR=dir` writes each internal representation to a file there;
/// `ATTNKIT_STATS_ONLY=text` keeps the modules whose name contains the text. Fails when the device
/// lacks the extension or a pipeline cannot be built.
#[test]
#[ignore]
fn kernel_statistics() {
    let mut modules = attnkit::wgpu::bench_kernel_modules().expect("kernel modules");
    if let Ok(only) = std::env::var("ATTNKIT_STATS_ONLY") {
        modules.retain(|(name, _)| name.contains(&only));
    }
    let stats = driver_statistics(&modules, std::env::var("ATTNKIT_STATS_DIR").ok());
    assert!(stats, "the device lacks VK_KHR_pipeline_executable_properties: no statistics");
}

/// Builds a pipeline of each SPIR-V module on the first non-CPU Vulkan device (else the first) and
/// prints the driver's statistics of each; false when the device has no statistics to give (the
/// pipelines are still built, so that a software driver checks the modules). Panics when a
/// pipeline cannot be built.
fn driver_statistics(modules: &[(String, Vec<u32>)], out_dir: Option<String>) -> bool {
    use ash::vk;
    use std::ffi::CStr;
    // SAFETY: every Vulkan call below follows its valid-usage rules: handles are created here,
    // used only while alive and destroyed in reverse order, every create-info is built with
    // ash's builders (lengths and pointers from live slices), and the extension's entry points
    // are used only after the device was created with the extension enabled.
    unsafe {
        let entry = ash::Entry::load().expect("the Vulkan loader (libvulkan.so.1)");
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
        let instance = entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None).unwrap();
        let pds = instance.enumerate_physical_devices().unwrap();
        let pd = *pds
            .iter()
            .find(|&&p| instance.get_physical_device_properties(p).device_type != vk::PhysicalDeviceType::CPU)
            .unwrap_or_else(|| pds.first().expect("no Vulkan device"));
        let props = instance.get_physical_device_properties(pd);
        eprintln!(
            "device: {} (driver {:#x}, api {}.{})",
            props.device_name_as_c_str().unwrap().to_string_lossy(),
            props.driver_version,
            vk::api_version_major(props.api_version),
            vk::api_version_minor(props.api_version)
        );
        let exts: Vec<String> = instance
            .enumerate_device_extension_properties(pd)
            .unwrap()
            .iter()
            .map(|e| e.extension_name_as_c_str().unwrap().to_string_lossy().into_owned())
            .collect();
        let has = |n: &CStr| exts.iter().any(|e| e.as_bytes() == n.to_bytes());
        let pep = ash::khr::pipeline_executable_properties::NAME;
        // Without the extension the pipelines are still built (so that a software driver checks
        // the modules), and the test fails at the end.
        let stats = has(pep);
        let coop = has(ash::khr::cooperative_matrix::NAME);
        let mut names = vec![];
        if stats {
            names.push(pep.as_ptr());
        }
        if coop {
            names.push(ash::khr::cooperative_matrix::NAME.as_ptr());
        }
        // Every feature the device has is enabled (the modules use f16, 8/16-bit storage,
        // subgroups, the Vulkan memory model and cooperative matrices).
        let mut f11 = vk::PhysicalDeviceVulkan11Features::default();
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f13 = vk::PhysicalDeviceVulkan13Features::default();
        let mut fpe = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
        let mut fcm = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut f11).push_next(&mut f12).push_next(&mut f13);
        if stats {
            f2 = f2.push_next(&mut fpe);
        }
        if coop {
            f2 = f2.push_next(&mut fcm);
        }
        instance.get_physical_device_features2(pd, &mut f2);
        let family = instance
            .get_physical_device_queue_family_properties(pd)
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .expect("a compute queue") as u32;
        let prio = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(family).queue_priorities(&prio)];
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&names)
            .push_next(&mut f2);
        let device = instance.create_device(pd, &info, None).unwrap();
        let pe = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        // A superset of every kernel's bindings: 8 storage buffers.
        let bindings: Vec<_> = (0..8)
            .map(|i| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let dsl = device
            .create_descriptor_set_layout(&vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings), None)
            .unwrap();
        let layouts = [dsl];
        let layout = device
            .create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().set_layouts(&layouts), None)
            .unwrap();
        let mut built = 0;
        for (name, words) in modules {
            if name.starts_with("coop") && !coop {
                eprintln!("{name}: skipped, no cooperative matrices on this device");
                continue;
            }
            let module = device.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(words), None).unwrap();
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(module)
                .name(c"main");
            let flags = if stats {
                vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
                    | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR
            } else {
                vk::PipelineCreateFlags::empty()
            };
            let ci = [vk::ComputePipelineCreateInfo::default().flags(flags).stage(stage).layout(layout)];
            let pipeline =
                device.create_compute_pipelines(vk::PipelineCache::null(), &ci, None).map_err(|(_, e)| e).unwrap()[0];
            built += 1;
            if !stats {
                eprintln!("{name}: pipeline built ({} words)", words.len());
                device.destroy_pipeline(pipeline, None);
                device.destroy_shader_module(module, None);
                continue;
            }
            let execs =
                pe.get_pipeline_executable_properties(&vk::PipelineInfoKHR::default().pipeline(pipeline)).unwrap();
            for (i, ex) in execs.iter().enumerate() {
                let info = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(i as u32);
                let stats = pe.get_pipeline_executable_statistics(&info).unwrap();
                let text: Vec<String> = stats
                    .iter()
                    .map(|s| {
                        let stat = s.name_as_c_str().unwrap().to_string_lossy();
                        let v = match s.format {
                            vk::PipelineExecutableStatisticFormatKHR::BOOL32 => format!("{}", s.value.b32),
                            vk::PipelineExecutableStatisticFormatKHR::INT64 => format!("{}", s.value.i64),
                            // NVIDIA's driver (580) reports "Local Memory Size" as 2^36 plus the
                            // bytes a thread: the low word is the figure.
                            vk::PipelineExecutableStatisticFormatKHR::UINT64 if s.value.u64 >> 32 != 0 => {
                                format!("{} (raw {:#x})", s.value.u64 & 0xffff_ffff, s.value.u64)
                            }
                            vk::PipelineExecutableStatisticFormatKHR::UINT64 => format!("{}", s.value.u64),
                            _ => format!("{}", s.value.f64),
                        };
                        format!("{stat} = {v}")
                    })
                    .collect();
                eprintln!(
                    "{name} [{} / subgroup {}]: {}",
                    ex.name_as_c_str().unwrap().to_string_lossy(),
                    ex.subgroup_size,
                    text.join(", ")
                );
                // Internal representations: count, sizes, then the data.
                let fp = pe.fp();
                let mut n = 0u32;
                let _ = (fp.get_pipeline_executable_internal_representations_khr)(
                    device.handle(),
                    &info,
                    &mut n,
                    std::ptr::null_mut(),
                );
                let mut reps = vec![vk::PipelineExecutableInternalRepresentationKHR::default(); n as usize];
                let _ = (fp.get_pipeline_executable_internal_representations_khr)(
                    device.handle(),
                    &info,
                    &mut n,
                    reps.as_mut_ptr(),
                );
                let mut bufs: Vec<Vec<u8>> = reps.iter().map(|r| vec![0u8; r.data_size]).collect();
                for (r, b) in reps.iter_mut().zip(bufs.iter_mut()) {
                    r.p_data = b.as_mut_ptr().cast();
                }
                let _ = (fp.get_pipeline_executable_internal_representations_khr)(
                    device.handle(),
                    &info,
                    &mut n,
                    reps.as_mut_ptr(),
                );
                for (r, b) in reps.iter().zip(&bufs) {
                    let rname = r.name_as_c_str().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
                    eprintln!("  representation {rname}: {} bytes, text {}", b.len(), r.is_text);
                    if let Some(dir) = &out_dir {
                        let file = format!("{name} {rname}").replace(|c: char| !c.is_ascii_alphanumeric(), "_");
                        std::fs::write(format!("{dir}/{file}.txt"), b).unwrap();
                    }
                }
            }
            device.destroy_pipeline(pipeline, None);
            device.destroy_shader_module(module, None);
        }
        device.destroy_pipeline_layout(layout, None);
        device.destroy_descriptor_set_layout(dsl, None);
        device.destroy_device(None);
        instance.destroy_instance(None);
        assert!(built > 0, "no pipeline was built");
        stats
    }
}

/// One inner-loop probe: a workgroup of `wg` threads (`nx` along the columns) multiplies an
/// A tile (f32, in workgroup memory, `kd` deep) by a B tile (f32, or 16-bit pairs unpacked in
/// registers) `reps` times, each thread owning a `tm` x `tn` block of f32 accumulators: the shape
/// of the portable kernels' q.k and p.v loops, without their global loads, barriers or softmax.
#[derive(Clone, Copy)]
struct Probe {
    wg: u32,
    nx: u32,
    tm: u32,
    tn: u32,
    kd: u32,
    /// B's storage: 0 f32 (vec4), 1 f16 pairs, 2 bf16 pairs (vec2<u32> a vec4).
    bf: u32,
    /// Operands loaded once before the loop (the FMA rate alone).
    regs_only: bool,
    /// Extra workgroup memory (bytes), to hold the workgroups an SM to a kernel's count.
    pad: u32,
    /// Steps of k a loop iteration (a power of two dividing `kd`; 4 unless said); with
    /// `regs_only`, `ku / 4` copies of the FMA block an iteration: the cost of an iteration.
    ku: u32,
}

impl Probe {
    fn name(&self) -> String {
        format!(
            "{}x{} wg{} nx{} kd{} {}{}{}{}",
            self.tm,
            self.tn,
            self.wg,
            self.nx,
            self.kd,
            ["f32", "f16", "bf16"][self.bf as usize],
            if self.regs_only { " regs" } else { "" },
            if self.pad > 0 { format!(" pad{}", self.pad) } else { String::new() },
            if self.ku != 4 { format!(" ku{}", self.ku) } else { String::new() }
        )
    }

    fn wgsl(&self) -> String {
        let (wg, nx, tm, tn, kd) = (self.wg, self.nx, self.tm, self.tn, self.kd);
        let ny = wg / nx;
        let (tm4, tn4) = (tm / 4, tn / 4);
        let am = ny * tm4; // A vec4s a k
        let bn = nx * tn4; // B vec4s a k
        let bty = if self.bf == 0 { "vec4<f32>" } else { "vec2<u32>" };
        let padn = (self.pad / 4).max(wg);
        let mut s = String::new();
        s += "@group(0) @binding(0) var<storage, read> src: array<u32>;\n";
        s += "@group(0) @binding(1) var<storage, read_write> dst: array<f32>;\n";
        s += &format!("var<workgroup> wa: array<vec4<f32>, {}>;\n", kd * am);
        s += &format!("var<workgroup> wb: array<{bty}, {}>;\n", kd * bn);
        s += &format!("var<workgroup> pad: array<u32, {padn}>;\n");
        s += "fn val(i: u32) -> f32 { return f32(src[1u + (i & 1023u)] & 0xffffu) * 1.5e-5 - 0.49; }\n";
        s += "fn v4(i: u32) -> vec4<f32> { return vec4<f32>(val(4u * i), val(4u * i + 1u), val(4u * i + 2u), val(4u * i + 3u)); }\n";
        s += match self.bf {
            0 => "fn pk(x: vec4<f32>) -> vec4<f32> { return x; }\nfn up(w: vec4<f32>) -> vec4<f32> { return w; }\n",
            1 => "fn pk(x: vec4<f32>) -> vec2<u32> { return vec2<u32>(pack2x16float(x.xy), pack2x16float(x.zw)); }\nfn up(w: vec2<u32>) -> vec4<f32> { return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)); }\n",
            _ => "fn pk(x: vec4<f32>) -> vec2<u32> { let b = bitcast<vec4<u32>>(x); return vec2<u32>((b.x >> 16u) | (b.y & 0xffff0000u), (b.z >> 16u) | (b.w & 0xffff0000u)); }\nfn up(w: vec2<u32>) -> vec4<f32> { return vec4<f32>(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u), bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u)); }\n",
        };
        s += &format!("@compute @workgroup_size({wg})\n");
        s += "fn main(@builtin(local_invocation_index) tid: u32, @builtin(global_invocation_id) gid: vec3<u32>) {\n";
        s += &format!("  let tx = tid % {nx}u;\n  let ty = tid / {nx}u;\n");
        s += &format!("  for (var i = tid; i < {}u; i += {wg}u) {{ wa[i] = v4(i); }}\n", kd * am);
        s += &format!("  for (var i = tid; i < {}u; i += {wg}u) {{ wb[i] = pk(v4(i + 77u)); }}\n", kd * bn);
        s += &format!("  for (var i = tid; i < {padn}u; i += {wg}u) {{ pad[i] = i; }}\n");
        s += "  workgroupBarrier();\n  let reps = src[0];\n";
        for i in 0..tm {
            for j in 0..tn4 {
                s += &format!("  var c{i}_{j} = vec4<f32>(0.0);\n");
            }
        }
        let loads = |k: &str| {
            let mut t = String::new();
            for q in 0..tm4 {
                t += &format!("    let a{q} = wa[({k}) * {am}u + ty * {tm4}u + {q}u];\n");
            }
            for j in 0..tn4 {
                t += &format!("    let b{j} = up(wb[({k}) * {bn}u + tx + {}u]);\n", j * nx);
            }
            t
        };
        let mut fmas = String::new();
        for i in 0..tm {
            for j in 0..tn4 {
                fmas += &format!("      c{i}_{j} += a{}.{} * b{j};\n", i / 4, ["x", "y", "z", "w"][i as usize % 4]);
            }
        }
        if self.regs_only {
            s += &loads("tid % 4u");
            // `ku / 4` copies of the block an iteration (the same FMAs in all).
            let copies = (self.ku / 4).max(1);
            s += &format!("  for (var r = 0u; r < reps * {kd}u; r += {copies}u) {{\n");
            for _ in 0..copies {
                s += &fmas;
            }
            s += "  }\n";
        } else {
            s += "  for (var r = 0u; r < reps; r++) {\n";
            s += &format!("   for (var k = 0u; k < {kd}u; k += {}u) {{\n", self.ku);
            for u in 0..self.ku {
                s += "    {\n";
                s += &loads(&format!("k + {u}u"));
                s += &fmas;
                s += "    }\n";
            }
            s += "   }\n  }\n";
        }
        s += "  var t = vec4<f32>(0.0);\n";
        for i in 0..tm {
            for j in 0..tn4 {
                s += &format!("  t += c{i}_{j};\n");
            }
        }
        s += &format!("  dst[gid.x] = dot(t, vec4<f32>(1.0)) + f32(pad[(tid + 1u) % {padn}u]);\n}}\n");
        s
    }

    fn spirv(&self) -> Vec<u32> {
        let src = self.wgsl();
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{}: {}", self.name(), e.emit_to_string(&src)));
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}: {}", self.name(), e.emit_to_string(&src)));
        let unchecked = naga::proc::BoundsCheckPolicy::Unchecked;
        let options = naga::back::spv::Options {
            lang_version: (1, 3),
            flags: naga::back::spv::WriterFlags::empty(),
            bounds_check_policies: naga::proc::BoundsCheckPolicies {
                index: unchecked,
                buffer: unchecked,
                image_load: unchecked,
                binding_array: unchecked,
            },
            zero_initialize_workgroup_memory: naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
            force_loop_bounding: false,
            ..Default::default()
        };
        let pipeline =
            naga::back::spv::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: "main".into() };
        naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline)).expect("SPIR-V")
    }
}

/// The portable kernels' inner loops, alone: TFLOP/s of [`Probe`]s (f32 FMAs, 2 FLOPs each) on
/// the wgpu adapter, and the Vulkan driver's statistics of each (registers). A diagnosis of what
/// the shader compiler makes of register-tiled loops over workgroup memory, not a figure of
/// attnkit's kernels. `ATTNKIT_BENCH_QUICK=1` shrinks the grid for a software adapter.
#[test]
#[ignore]
fn inner_loops() {
    let quick = std::env::var("ATTNKIT_BENCH_QUICK").is_ok();
    let p = |wg, nx, tm, tn, kd, bf| Probe { wg, nx, tm, tn, kd, bf, regs_only: false, pad: 0, ku: 4 };
    let mut probes = vec![
        Probe { regs_only: true, ..p(128, 16, 8, 8, 16, 0) },
        Probe { regs_only: true, ..p(256, 16, 4, 4, 16, 0) },
        // The cost of a loop iteration: the same FMAs, 4 and 16 copies of the block an iteration.
        Probe { regs_only: true, ku: 16, ..p(256, 16, 4, 4, 16, 0) },
        Probe { regs_only: true, ku: 64, ..p(256, 16, 4, 4, 16, 0) },
        Probe { regs_only: true, ku: 16, ..p(128, 16, 8, 8, 16, 0) },
        // The packed kernel's loops with 8 and 16 steps of k an iteration.
        Probe { ku: 8, ..p(128, 16, 4, 4, 128, 1) },
        Probe { ku: 16, ..p(128, 16, 4, 4, 128, 1) },
        Probe { ku: 8, ..p(128, 16, 4, 8, 64, 1) },
        Probe { ku: 16, ..p(128, 16, 4, 8, 64, 1) },
        // q.k and p.v of the packed kernel's 4-row blocks (4x4 and 4x8, 128 threads, 16-bit K/V).
        p(128, 16, 4, 4, 128, 1),
        p(128, 16, 4, 8, 64, 1),
        p(128, 16, 4, 4, 128, 0),
        // q.k of the packed kernel's first version (8x4, 64 threads, 16-bit K), alone and at its
        // 4 workgroups an SM.
        p(64, 16, 8, 4, 128, 1),
        Probe { pad: 14336, ..p(64, 16, 8, 4, 128, 1) },
        p(64, 16, 8, 4, 128, 2),
        p(64, 16, 8, 4, 128, 0),
        p(128, 16, 8, 4, 128, 1),
        p(256, 16, 8, 4, 64, 1),
        // p.v of the packed kernel's first version (8 rows x 8 columns: two vec4 columns a thread).
        p(64, 16, 8, 8, 64, 1),
        p(128, 16, 8, 8, 64, 1),
        p(256, 16, 8, 8, 32, 1),
        p(128, 16, 8, 8, 32, 0),
        p(256, 16, 8, 8, 32, 0),
        // the micro-tile kernel's 4x4.
        p(64, 16, 4, 4, 128, 0),
        p(256, 16, 4, 4, 64, 0),
        p(256, 16, 4, 4, 128, 1),
        // 16x4.
        p(128, 8, 16, 4, 64, 1),
    ];
    if let Ok(only) = std::env::var("ATTNKIT_PROBE_ONLY") {
        probes.retain(|p| p.name().contains(&only));
    }
    let modules: Vec<(String, Vec<u32>)> = probes.iter().map(|p| (p.name(), p.spirv())).collect();
    if !driver_statistics(&modules, None) {
        eprintln!("(no driver statistics on this device)");
    }

    let wgpu = attnkit::wgpu::WgpuBackend::new().expect("wgpu adapter");
    let (device, queue) = (wgpu.wgpu_device(), wgpu.wgpu_queue());
    eprintln!("wgpu adapter: {}", wgpu.adapter_name());
    let mut rng = Rng::new(3);
    let mut words = vec![0u32; 1025];
    for w in &mut words[1..] {
        *w = rng.next_u64() as u32;
    }
    let threads: u32 = if quick { 4096 } else { 132 * 2048 * 2 };
    let src = device.create_buffer(&::wgpu::BufferDescriptor {
        label: Some("probe src"),
        size: 4 * 1025,
        usage: ::wgpu::BufferUsages::STORAGE | ::wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let dst = device.create_buffer(&::wgpu::BufferDescriptor {
        label: Some("probe dst"),
        size: 4 * threads as u64,
        usage: ::wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    eprintln!("| probe | TFLOP/s | ms | reps |");
    eprintln!("|---|---|---|---|");
    for pr in &probes {
        let src_text = pr.wgsl();
        // SAFETY: every loop of a probe is counted (a counter that only increases toward a bound
        // read before the loop) and every index is in range by construction (tiles sized from
        // the same constants that index them).
        let module = unsafe {
            device.create_shader_module_trusted(
                ::wgpu::ShaderModuleDescriptor {
                    label: Some("probe"),
                    source: ::wgpu::ShaderSource::Wgsl(src_text.into()),
                },
                ::wgpu::ShaderRuntimeChecks::unchecked(),
            )
        };
        let pipeline = device.create_compute_pipeline(&::wgpu::ComputePipelineDescriptor {
            label: Some("probe"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: ::wgpu::PipelineCompilationOptions {
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            },
            cache: None,
        });
        let bind = device.create_bind_group(&::wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                ::wgpu::BindGroupEntry { binding: 0, resource: src.as_entire_binding() },
                ::wgpu::BindGroupEntry { binding: 1, resource: dst.as_entire_binding() },
            ],
        });
        // Seconds of one dispatch of `reps` repetitions (the 4 KiB write of `src` rides on the
        // same submission).
        let mut run = |reps: u32| -> f64 {
            words[0] = reps;
            queue.write_buffer(&src, 0, bytemuck::cast_slice(&words));
            let t0 = Instant::now();
            let mut enc = device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &bind, &[]);
                pass.dispatch_workgroups(threads / pr.wg, 1, 1);
            }
            queue.submit([enc.finish()]);
            device.poll(::wgpu::PollType::wait_indefinitely()).unwrap();
            t0.elapsed().as_secs_f64()
        };
        // A warm-up, then reps for about 20 ms a dispatch in two steps (the first is mostly
        // launch overhead).
        run(2);
        let t1 = run(2);
        let r1 = ((0.002 / t1 * 2.0) as u32).clamp(2, 1 << 14);
        let t2 = run(r1);
        let reps = ((0.02 / t2 * r1 as f64) as u32).clamp(2, 1 << 16);
        let mut ts: Vec<f64> = (0..5).map(|_| run(reps)).collect();
        ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let t = ts[2];
        let flops = 2.0 * threads as f64 * reps as f64 * (pr.kd * pr.tm * pr.tn) as f64;
        eprintln!("| {} | {:.2} | {:.3} | {reps} |", pr.name(), flops / t / 1e12, t * 1e3);
    }
}
