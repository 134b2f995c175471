//! A `forward` with caller buffers captured in a CUDA graph (through cudarc, on the backend's
//! stream) and replayed gives the eager result bit for bit, also after the inputs change in place.
#![cfg(feature = "cuda")]

use attnkit::cuda::CudaBackend;
use attnkit::{AttentionBackend, AttnCall, DType, Error, Tensor};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

/// Both tests capture in the global mode, where any other thread's stream-unsafe call (a free,
/// say) invalidates the capture: they must not overlap, whatever the harness's thread count.
static CAPTURE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn backend() -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e @ Error::NoDevice { .. }) => {
            let skip = std::env::var("ATTNKIT_SKIP").unwrap_or_default();
            if skip.split(',').any(|s| s.trim() == "cuda" || s.trim() == "all") {
                eprintln!("!!! SKIPPING the CUDA graph test because ATTNKIT_SKIP={skip}: {e}");
                None
            } else {
                panic!("cuda backend compiled in but cannot run: {e} (set ATTNKIT_SKIP=cuda to skip)");
            }
        }
        Err(e) => panic!("{e}"),
    }
}

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 3.0 - 1.5) as f32
        })
        .collect()
}

fn bytes(be: &CudaBackend, t: &Tensor) -> Vec<u8> {
    be.download(t).unwrap().host().unwrap().to_le_bytes()
}

/// cu_seqlens_q, block_table, max_blocks, seq_lens.
type PagedMeta = (Vec<i32>, Vec<i32>, usize, Vec<i32>);

struct Case {
    name: &'static str,
    dtype: DType,
    q_shape: Vec<usize>,
    kv_shape: Vec<usize>,
    paged: Option<PagedMeta>,
    causal: bool,
}

fn cases() -> Vec<Case> {
    // Paged decode, GQA 8/2, one long sequence: split-KV plus the combine kernel.
    let bs = 16;
    let len = 3000;
    let nblk = len / bs + 1;
    let table: Vec<i32> = (0..nblk as i32).rev().collect();
    vec![
        Case {
            name: "dense bf16 causal d128 (tensor cores)",
            dtype: DType::BF16,
            q_shape: vec![2, 300, 4, 128],
            kv_shape: vec![2, 300, 2, 128],
            paged: None,
            causal: true,
        },
        Case {
            name: "dense f32 d64 (CUDA cores)",
            dtype: DType::F32,
            q_shape: vec![1, 70, 2, 64],
            kv_shape: vec![1, 90, 2, 64],
            paged: None,
            causal: false,
        },
        Case {
            name: "paged f16 decode GQA d128 (split-KV)",
            dtype: DType::F16,
            q_shape: vec![1, 8, 128],
            kv_shape: vec![nblk, bs, 2, 128],
            paged: Some((vec![0, 1], table, nblk, vec![len as i32])),
            causal: true,
        },
    ]
}

#[test]
fn graph_replay_equals_eager() {
    let _serial = CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = backend() else { return };
    for c in cases() {
        let nq: usize = c.q_shape.iter().product();
        let nk: usize = c.kv_shape.iter().product();
        let host = |shape: &[usize], n: usize, seed: u64| Tensor::from_f32(shape, c.dtype, &data(n, seed)).unwrap();
        let mut q = be.upload(&host(&c.q_shape, nq, 1)).unwrap();
        let k = be.upload(&host(&c.kv_shape, nk, 2)).unwrap();
        let v = be.upload(&host(&c.kv_shape, nk, 3)).unwrap();
        let make = |q: &Tensor| -> (Vec<u8>, Vec<u8>) {
            let call = match &c.paged {
                None => AttnCall::dense(q, &k, &v),
                Some((cu, bt, mb, sl)) => AttnCall::paged(q, &k, &v, cu, bt, *mb, sl),
            }
            .causal(c.causal)
            .with_lse(true);
            let o = be.forward(&call, None, None).unwrap();
            (bytes(&be, o.out.as_ref().unwrap()), bytes(&be, o.lse.as_ref().unwrap()))
        };
        let (eager_out, eager_lse) = make(&q);
        let lse_shape: Vec<usize> = if c.paged.is_some() {
            vec![c.q_shape[1], c.q_shape[0]]
        } else {
            vec![c.q_shape[0], c.q_shape[2], c.q_shape[1]]
        };
        let mut out = be.alloc(&c.q_shape, c.dtype).unwrap();
        let mut lse = be.alloc(&lse_shape, DType::F32).unwrap();
        let sentinel = Tensor::from_f32(&c.q_shape, c.dtype, &vec![-7.0; nq]).unwrap();
        {
            let call = match &c.paged {
                None => AttnCall::dense(&q, &k, &v),
                Some((cu, bt, mb, sl)) => AttnCall::paged(&q, &k, &v, cu, bt, *mb, sl),
            }
            .causal(c.causal);
            // Once eagerly: kernels loaded, metadata on the device, workspace sized.
            be.forward(&call, Some(&mut out), Some(&mut lse)).unwrap();
            be.synchronize().unwrap();
            be.stream().begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
            let r = be.forward(&call, Some(&mut out), Some(&mut lse));
            let graph =
                be.stream().end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            r.unwrap_or_else(|e| panic!("{}: forward during capture: {e}", c.name));
            let graph = graph.unwrap().expect("a graph");
            be.write(&mut out, &sentinel).unwrap();
            graph.launch().unwrap();
            be.synchronize().unwrap();
            assert_eq!(bytes(&be, &out), eager_out, "{}: replay out differs from eager", c.name);
            assert_eq!(bytes(&be, &lse), eager_lse, "{}: replay lse differs from eager", c.name);
            // New queries written in place: the replay reads them.
            let q2 = host(&c.q_shape, nq, 99);
            be.write(&mut q, &q2).unwrap();
            be.write(&mut out, &sentinel).unwrap();
            graph.launch().unwrap();
            be.synchronize().unwrap();
        }
        let (eager2_out, eager2_lse) = make(&q);
        assert_ne!(eager2_out, eager_out, "{}: new inputs gave the old result", c.name);
        assert_eq!(bytes(&be, &out), eager2_out, "{}: replay after an in-place update differs", c.name);
        assert_eq!(bytes(&be, &lse), eager2_lse, "{}: replay lse after an in-place update differs", c.name);
        eprintln!("{}: graph replay == eager (bitwise)", c.name);
    }
}

#[test]
fn metadata_change_during_capture_is_an_error() {
    let _serial = CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(be) = backend() else { return };
    let (bs, d) = (16, 64);
    let kc = be.upload(&Tensor::from_f32(&[8, bs, 1, d], DType::F16, &data(8 * bs * d, 5)).unwrap()).unwrap();
    let vc = be.upload(&Tensor::from_f32(&[8, bs, 1, d], DType::F16, &data(8 * bs * d, 6)).unwrap()).unwrap();
    let q = be.upload(&Tensor::from_f32(&[1, 1, d], DType::F16, &data(d, 7)).unwrap()).unwrap();
    let mut out = be.alloc(&[1, 1, d], DType::F16).unwrap();
    let table = vec![3, 1, 4, 0];
    let (a, b) = (vec![40], vec![41]);
    be.forward(&AttnCall::paged(&q, &kc, &vc, &[0, 1], &table, 4, &a), Some(&mut out), None).unwrap();
    be.synchronize().unwrap();
    be.stream().begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
    let r = be.forward(&AttnCall::paged(&q, &kc, &vc, &[0, 1], &table, 4, &b), Some(&mut out), None);
    let _ = be.stream().end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    let e = r.expect_err("a metadata change inside a capture must not be silently baked in");
    assert!(e.to_string().contains("capture"), "{e}");
}
