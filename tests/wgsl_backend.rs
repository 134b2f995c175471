//! wgpu-specific checks beyond the conformance suite: the split-KV path forced on random cases,
//! a caller-provided device and queue, caller buffers reused across calls.
#![cfg(feature = "wgpu")]

mod common;

use attnkit::wgpu::{Kernel, WgpuBackend};
use attnkit::{AttentionBackend, DType, LayoutKind, Params};
use common::*;

/// The backend, or `None` when `ATTNKIT_SKIP` names wgpu and there is no adapter.
fn be() -> Option<WgpuBackend> {
    match WgpuBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            backend("wgpu")?; // fails the test unless ATTNKIT_SKIP names wgpu
            panic!("wgpu: {e}");
        }
    }
}

/// A random case, long in keys and short in queries so that every split has work (or none).
fn random_case(rng: &mut Rng, seed: u64) -> Case {
    let layout = [LayoutKind::Dense, LayoutKind::Varlen, LayoutKind::Paged][rng.below(3)];
    let dtype = DType::FLOATS[rng.below(3)];
    let b = 1 + rng.below(3);
    let mut lens: Vec<(usize, usize)> = (0..b).map(|_| (rng.below(6), rng.below(300))).collect();
    if layout == LayoutKind::Dense {
        let l0 = (lens[0].0.max(1), lens[0].1.max(1));
        lens.iter_mut().for_each(|l| *l = l0);
    }
    let opt = |rng: &mut Rng, n: usize| if rng.below(3) == 0 { Some(rng.below(n)) } else { None };
    let params = Params {
        causal: rng.below(2) == 0,
        window_left: opt(rng, 100),
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
        d: [4, 8, 24, 64, 128, 256][rng.below(6)],
        params,
        alibi: rng.below(3) == 0,
        block_size: 1 + rng.below(20),
        lse: true,
        seed,
    }
}

#[test]
fn split_kv_matches_reference() {
    let Some(mut be) = be() else { return };
    let mut rng = Rng::new(0x5eed);
    for n in 0..case_count() {
        let seed = rng.next_u64();
        let case = random_case(&mut rng, seed);
        be.set_kv_splits(Some([2, 3, 7, 64][n % 4]));
        be.set_kernel(Some([Kernel::Rows, Kernel::MicroTile][n % 2]));
        check_against_reference(&be, &case).unwrap_or_else(|e| panic!("splits {:?}: {e}", [2, 3, 7, 64][n % 4]));
    }
}

#[test]
fn both_kernels_match_reference() {
    let Some(mut be) = be() else { return };
    let mut rng = Rng::new(0xbeef);
    for n in 0..case_count() {
        let seed = rng.next_u64();
        let mut case = random_case(&mut rng, seed);
        // Longer query sequences too, so that micro-tiles are full and ragged.
        for l in case.lens.iter_mut() {
            l.0 = (l.0 * 13) % 70;
        }
        if case.layout == LayoutKind::Dense {
            let l0 = (case.lens[0].0.max(1), case.lens[0].1.max(1));
            case.lens.iter_mut().for_each(|l| *l = l0);
        }
        let kernel = [Kernel::Rows, Kernel::MicroTile][n % 2];
        be.set_kernel(Some(kernel));
        be.set_kv_splits(if n % 3 == 0 { Some(3) } else { None });
        check_against_reference(&be, &case).unwrap_or_else(|e| panic!("{kernel:?}: {e}"));
    }
}

#[test]
fn split_and_unsplit_agree() {
    let Some(mut be) = be() else { return };
    let mut rng = Rng::new(99);
    for _ in 0..case_count().div_ceil(4) {
        let seed = rng.next_u64();
        let case = random_case(&mut rng, seed);
        let built = case.build();
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

#[test]
fn caller_device_and_buffers() {
    let Some(shared) = be() else { return };
    // A second backend over the same wgpu device and queue, as a model would build it.
    let be = WgpuBackend::from_device(shared.wgpu_device().clone(), shared.wgpu_queue().clone());
    assert_ne!(be.device(), shared.device(), "each backend over a caller device gets its own id");
    eprintln!("wgpu adapter: {}", shared.adapter_name());
    let mut case = case_of(LayoutKind::Paged, DType::BF16, vec![(1, 700), (3, 40)]);
    case.params.causal = true;
    let built = case.build();
    let (q, k, v) = (be.upload(&built.q).unwrap(), be.upload(&built.k).unwrap(), be.upload(&built.v).unwrap());
    // A tensor of the other backend is refused with a typed error.
    let foreign = shared.upload(&built.q).unwrap();
    let call = built.call(&case, &foreign, &k, &v);
    assert!(matches!(be.forward(&call, None, None), Err(attnkit::Error::Device { arg: "q", .. })));
    // The same caller buffers, three calls: the same bits each time, matching the reference.
    let call = built.call(&case, &q, &k, &v);
    let mut out = be.alloc(q.shape(), q.dtype()).unwrap();
    let lse_shape = [case.hq(), q.shape()[0]];
    let mut lse = be.alloc(&lse_shape, DType::F32).unwrap();
    let mut first = None;
    for _ in 0..3 {
        let o = be.forward(&call, Some(&mut out), Some(&mut lse)).unwrap();
        assert!(o.out.is_none() && o.lse.is_none());
        let got = bytes(&be, &out);
        assert_eq!(first.get_or_insert_with(|| got.clone()), &got);
    }
    let (want, _) = reference(&case, &built);
    let got = be.download(&out).unwrap().to_f64_vec().unwrap();
    let (atol, rtol) = tol(case.dtype);
    check_close("out", &got, &want, atol, rtol).unwrap();
}

/// The cooperative-matrix kernel, forced, against the reference on random f16 cases (queries
/// long enough for full and ragged 64-row tiles, every layout and mask). On an adapter without
/// cooperative matrices (lavapipe) it checks that forcing the kernel is a typed error, and says
/// loudly that the kernel itself was not run; `ATTNKIT_REQUIRE_COOP=1` (set where the GPU has
/// them) makes that absence a failure.
#[test]
fn coop_kernel_matches_reference() {
    let Some(mut be) = be() else { return };
    let mut rng = Rng::new(0xc00b);
    let mut case = random_case(&mut rng, 11);
    case.dtype = DType::F16;
    case.d = 64;
    be.set_kernel(Some(Kernel::Coop));
    if !be.has_cooperative_matrices() {
        let required = std::env::var("ATTNKIT_REQUIRE_COOP").is_ok_and(|v| v == "1");
        assert!(!required, "ATTNKIT_REQUIRE_COOP=1, but adapter {} has no cooperative matrices", be.adapter_name());
        let built = case.build();
        let err = run_on(&be, &case, &built).err().expect("Kernel::Coop without cooperative matrices must fail");
        assert!(err.to_string().contains("Kernel::Coop"), "unexpected error: {err}");
        eprintln!(
            "\n*** wgpu: cooperative-matrix kernel NOT RUN: adapter {} has no cooperative matrices \
             (forcing it gave a typed error, as it should) ***\n",
            be.adapter_name()
        );
        return;
    }
    eprintln!("wgpu: cooperative-matrix kernel on {}", be.adapter_name());
    for n in 0..case_count() {
        let seed = rng.next_u64();
        let mut case = random_case(&mut rng, seed);
        case.dtype = DType::F16;
        case.d = [32, 64, 96, 128, 256][n % 5];
        for l in case.lens.iter_mut() {
            l.0 = (l.0 * 37 + rng.below(40)) % 200;
        }
        if case.layout == LayoutKind::Dense {
            let l0 = (case.lens[0].0.max(1), case.lens[0].1.max(1));
            case.lens.iter_mut().for_each(|l| *l = l0);
        }
        be.set_kv_splits(if n % 4 == 3 { Some(3) } else { None });
        check_against_reference(&be, &case).unwrap_or_else(|e| panic!("coop: {e}"));
    }
}

fn case_of(layout: LayoutKind, dtype: DType, lens: Vec<(usize, usize)>) -> Case {
    Case {
        layout,
        dtype,
        lens,
        hkv: 2,
        group: 4,
        d: 64,
        params: Params::default(),
        alibi: false,
        block_size: 16,
        lse: true,
        seed: 3,
    }
}
