//! cuda-specific checks beyond the conformance suite: split-KV forced on random long-key cases,
//! for the decode kernel and for the tensor-core kernel (which takes GQA decode), against the
//! f64 reference and against the unsplit result.
#![cfg(feature = "cuda")]

mod common;

use attnkit::cuda::CudaBackend;
use attnkit::{AttentionBackend, DType, LayoutKind, Params};
use common::*;

/// The backend, or `None` when `ATTNKIT_SKIP` names cuda and there is no device.
fn be() -> Option<CudaBackend> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            backend("cuda")?; // fails the test unless ATTNKIT_SKIP names cuda
            panic!("cuda: {e}");
        }
    }
}

/// A random case, long in keys and short in queries so that every split has work (or none).
fn random_case(rng: &mut Rng, seed: u64, dtypes: &[DType]) -> Case {
    let layout = [LayoutKind::Dense, LayoutKind::Varlen, LayoutKind::Paged][rng.below(3)];
    let dtype = dtypes[rng.below(dtypes.len())];
    let b = 1 + rng.below(3);
    let mut lens: Vec<(usize, usize)> = (0..b).map(|_| (rng.below(3), rng.below(700))).collect();
    if layout == LayoutKind::Dense {
        let l0 = (lens[0].0.max(1), lens[0].1.max(1));
        lens.iter_mut().for_each(|l| *l = l0);
    }
    let opt = |rng: &mut Rng, n: usize| if rng.below(3) == 0 { Some(rng.below(n)) } else { None };
    let params = Params {
        causal: rng.below(2) == 0,
        window_left: opt(rng, 300),
        window_right: opt(rng, 40),
        softcap: if rng.below(4) == 0 { Some(1.0 + rng.below(30) as f32) } else { None },
        scale: None,
    };
    Case {
        layout,
        dtype,
        lens,
        hkv: 1 + rng.below(2),
        group: [1, 2, 4, 8][rng.below(4)],
        d: [8, 24, 64, 128, 256][rng.below(5)],
        params,
        alibi: rng.below(3) == 0,
        // Powers of two take the shift path, the others the division.
        block_size: [1 + rng.below(20), 16, 32][rng.below(3)],
        lse: true,
        seed,
    }
}

const SPLITS: [usize; 4] = [2, 3, 7, 64];

/// `kernel` forced, splits cycling through [`SPLITS`], every random case against the reference.
fn split_kv_matches_reference(kernel: &str, seed: u64, dtypes: &[DType]) {
    let Some(mut be) = be() else { return };
    let mut rng = Rng::new(seed);
    be.set_kernel(Some(kernel));
    for n in 0..case_count() {
        let seed = rng.next_u64();
        let case = random_case(&mut rng, seed, dtypes);
        be.set_kv_splits(Some(SPLITS[n % 4]));
        check_against_reference(&be, &case).unwrap_or_else(|e| panic!("{kernel}, splits {}: {e}", SPLITS[n % 4]));
    }
}

#[test]
fn split_kv_decode_kernel_matches_reference() {
    split_kv_matches_reference("decode", 0x5eed, &DType::FLOATS);
}

#[test]
fn split_kv_tensor_core_kernel_matches_reference() {
    split_kv_matches_reference("mma", 0xbeef, &[DType::F16, DType::BF16]);
}

#[test]
fn split_and_unsplit_agree() {
    let Some(mut be) = be() else { return };
    let mut rng = Rng::new(99);
    for n in 0..case_count().div_ceil(2) {
        let seed = rng.next_u64();
        let case = random_case(&mut rng, seed, &[DType::F16, DType::BF16]);
        let built = case.build();
        be.set_kernel(Some(["decode", "mma"][n % 2]));
        be.set_kv_splits(Some(1));
        let one = run_on(&be, &case, &built).unwrap();
        be.set_kv_splits(Some(5));
        let five = run_on(&be, &case, &built).unwrap();
        let (atol, rtol) = tol(case.dtype);
        check_close("split 5 vs 1", &five.out, &one.out, atol, rtol).unwrap_or_else(|e| panic!("{e}\n{case:?}"));
        check_close("lse split 5 vs 1", &five.lse.unwrap(), &one.lse.unwrap(), 1e-4, 1e-5)
            .unwrap_or_else(|e| panic!("{e}\n{case:?}"));
    }
}

/// Paged bf16 decode with GQA 8/2 (a group of 4), d 128, blocks of 16: the tensor-core decode tile.
fn gqa_decode_case(lens: Vec<(usize, usize)>, lse: bool, seed: u64) -> Case {
    Case {
        layout: LayoutKind::Paged,
        dtype: DType::BF16,
        lens,
        hkv: 2,
        group: 4,
        d: 128,
        params: Params::default(),
        alibi: false,
        block_size: 16,
        lse,
        seed,
    }
}

#[test]
fn gqa_decode_plan_uses_bulk_copies_on_hopper() {
    // The bulk-copy tile is the Hopper default for GQA decode: the split-KV tests above run it
    // only if the planner picks it, so check that it does (and that other GPUs never get it).
    let Some(be) = be() else { return };
    let case = gqa_decode_case(vec![(1, 600); 2], false, 7);
    let built = case.build();
    let (q, k, v) = (be.upload(&built.q).unwrap(), be.upload(&built.k).unwrap(), be.upload(&built.v).unwrap());
    let call = built.call(&case, &q, &k, &v);
    let plan = be.plan(&attnkit::validate(&call, be.device(), "cuda", None, None).unwrap());
    let bulk = match plan {
        attnkit::cuda::Plan::Mma { t, .. } => t.bulk,
        other => panic!("GQA decode should run on the tensor cores, planned {other:?}"),
    };
    let off = be.tuning().gqa_bulk == Some(0);
    if be.arch() == "sm_90" && !off {
        assert!(bulk >= 2, "sm_90 GQA decode should use bulk copies, planned {plan:?}");
    } else {
        assert_eq!(bulk, 0, "{}: {plan:?}", be.arch());
    }
    eprintln!("{}: GQA decode tile {plan:?}", be.arch());
}

#[test]
fn caller_owned_workspace_gives_the_backends_result() {
    // Split-KV partials in the caller's workspace (poisoned with NaN first) give bit for bit what
    // the backend's own workspace gives, for the tensor-core and the CUDA-core decode kernels; a
    // workspace too small or of another dtype is a typed error that leaves `out` alone.
    let Some(mut be) = be() else { return };
    let case = gqa_decode_case(vec![(1, 3000), (1, 1700)], true, 11);
    let built = case.build();
    let (q, k, v) = (be.upload(&built.q).unwrap(), be.upload(&built.k).unwrap(), be.upload(&built.v).unwrap());
    let n_out: usize = built.q.shape().iter().product();
    let sentinel = attnkit::Tensor::from_f32(built.q.shape(), DType::BF16, &vec![-7.0; n_out]).unwrap();
    for kernel in ["mma", "decode"] {
        be.set_kernel(Some(kernel));
        be.set_kv_splits(Some(7));
        let call = built.call(&case, &q, &k, &v);
        let need = be.workspace_bytes(&attnkit::validate(&call, be.device(), "cuda", None, None).unwrap());
        assert!(need > 0, "{kernel}: a split call needs a workspace");
        let mut own = be.alloc(built.q.shape(), DType::BF16).unwrap();
        be.forward(&call, Some(&mut own), None).unwrap();
        let own = be.download(&own).unwrap().to_f64_vec().unwrap();

        let mut ws =
            be.upload(&attnkit::Tensor::from_f32(&[need / 4], DType::F32, &vec![f32::NAN; need / 4]).unwrap()).unwrap();
        let mut out = be.upload(&sentinel).unwrap();
        be.forward_with_workspace(&call, &mut out, None, &mut ws).unwrap();
        let got = be.download(&out).unwrap().to_f64_vec().unwrap();
        assert!(got == own, "{kernel}: the caller's workspace gave another result");

        for (shape, dtype, what) in [(need / 4 - 1, DType::F32, "workspace"), (need / 2, DType::F16, "dtype")] {
            let mut small = be.alloc(&[shape], dtype).unwrap();
            let mut out = be.upload(&sentinel).unwrap();
            let e = be.forward_with_workspace(&call, &mut out, None, &mut small).expect_err("a bad workspace");
            assert!(e.to_string().contains("workspace") && e.to_string().contains(what), "{kernel}: {e}");
            let left = be.download(&out).unwrap().to_f64_vec().unwrap();
            assert!(left.iter().all(|&x| x == -7.0), "{kernel}: a refused call wrote into out");
        }
    }
}
