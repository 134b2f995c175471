//! The conformance suite: written once, instantiated for every backend compiled in. Test names
//! carry the backend (`cpu::matches_reference`, `wgpu::paged_equals_varlen`, ...).

mod common;

use attnkit::{AttentionBackend, DType, LayoutKind, Params, Tensor};
use common::*;
use proptest::prelude::*;

/// Head dims drawn for random cases, filtered by what each backend declares.
const HEAD_DIMS: [usize; 16] = [1, 2, 3, 4, 7, 8, 16, 24, 32, 40, 64, 80, 96, 128, 192, 256];

fn arb_params() -> impl Strategy<Value = Params> {
    (
        any::<bool>(),
        prop::option::weighted(0.3, 0usize..24),
        prop::option::weighted(0.3, 0usize..24),
        prop::option::weighted(0.3, 1.0f32..30.0),
        prop::option::weighted(0.3, 0.05f32..0.5),
    )
        .prop_map(|(causal, window_left, window_right, softcap, scale)| Params {
            causal,
            window_left,
            window_right,
            softcap,
            scale,
        })
}

/// Random cases for a backend's declared head dims; `big` allows longer sequences.
pub fn arb_case(head_dims: Vec<usize>, max_len: usize) -> impl Strategy<Value = Case> {
    let layout = prop_oneof![Just(LayoutKind::Dense), Just(LayoutKind::Varlen), Just(LayoutKind::Paged)];
    let dtype = prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)];
    (
        layout,
        dtype,
        prop::collection::vec((0..max_len, 0..max_len + 30), 1..4),
        1usize..4,
        prop_oneof![Just(1usize), Just(2), Just(4)],
        prop::sample::select(head_dims),
        arb_params(),
        any::<bool>(),
        1usize..20,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(layout, dtype, mut lens, hkv, group, d, params, alibi, block_size, lse, seed)| {
            if layout == LayoutKind::Dense {
                let l0 = (lens[0].0.max(1), lens[0].1.max(1));
                lens.iter_mut().for_each(|l| *l = l0);
            }
            Case { layout, dtype, lens, hkv, group, d, params, alibi, block_size, lse, seed }
        })
}

pub fn head_dims_of(be: &dyn AttentionBackend) -> Vec<usize> {
    HEAD_DIMS.iter().copied().filter(|&d| be.capabilities().head_dims.contains(d)).collect()
}

/// A plain case for the fixed tests.
pub fn case(layout: LayoutKind, dtype: DType, lens: Vec<(usize, usize)>, hkv: usize, group: usize, d: usize) -> Case {
    Case {
        layout,
        dtype,
        lens,
        hkv,
        group,
        d,
        params: Params::default(),
        alibi: false,
        block_size: 16,
        lse: true,
        seed: 7,
    }
}

macro_rules! conformance {
    ($module:ident, $name:literal) => {
        mod $module {
            use super::*;

            fn be() -> Option<std::sync::Arc<dyn AttentionBackend>> {
                backend($name)
            }

            fn cases() -> u32 {
                std::env::var("ATTNKIT_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64)
            }

            proptest! {
                #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Direct("proptest-regressions/conformance.txt"))), ..ProptestConfig::default() })]
                #[test]
                fn matches_reference(case in arb_case(be().map(|b| head_dims_of(&*b)).unwrap_or(vec![8]), 40)) {
                    let Some(be) = be() else { return Ok(()) };
                    check_against_reference(&*be, &case).map_err(TestCaseError::fail)?;
                }

                #[test]
                fn buffer_equals_alloc(case in arb_case(be().map(|b| head_dims_of(&*b)).unwrap_or(vec![8]), 24)) {
                    let Some(be) = be() else { return Ok(()) };
                    let mut case = case;
                    case.lse = true;
                    let built = case.build();
                    let (q, k, v) = (be.upload(&built.q).unwrap(), be.upload(&built.k).unwrap(), be.upload(&built.v).unwrap());
                    let call = built.call(&case, &q, &k, &v);
                    let alloc = be.forward(&call, None, None).unwrap();
                    let mut out = be.upload(&sentinel(q.shape(), q.dtype())).unwrap();
                    let lse_shape = alloc.lse.as_ref().unwrap().shape().to_vec();
                    let mut lse = be.upload(&sentinel(&lse_shape, DType::F32)).unwrap();
                    let none = be.forward(&call, Some(&mut out), Some(&mut lse)).unwrap();
                    prop_assert!(none.out.is_none() && none.lse.is_none(), "forward allocated despite buffers");
                    prop_assert_eq!(bytes(&*be, alloc.out.as_ref().unwrap()), bytes(&*be, &out), "out differs with a caller buffer");
                    prop_assert_eq!(bytes(&*be, alloc.lse.as_ref().unwrap()), bytes(&*be, &lse), "lse differs with a caller buffer");
                }

                #[test]
                fn malformed_calls_error_and_leave_buffers(case in arb_case(be().map(|b| head_dims_of(&*b)).unwrap_or(vec![8]), 12), which in 0usize..12, seed in any::<u64>()) {
                    let Some(be) = be() else { return Ok(()) };
                    let built = case.build();
                    let mut rng = common::Rng::new(seed);
                    let (mut q, mut k, mut v) = (built.q.try_clone_host().unwrap(), built.k.try_clone_host().unwrap(), built.v.try_clone_host().unwrap());
                    let (mut cu_q, mut cu_k, mut bt, mut sl) = (built.cu_q.clone(), built.cu_k.clone(), built.block_table.clone(), built.seq_lens.clone());
                    let mut max_blocks = built.max_blocks;
                    let mut out_shape = q.shape().to_vec();
                    let mut out_dtype = q.dtype();
                    let mut params = case.params;
                    let mut slopes = built.slopes.clone();
                    let mut alibi = case.alibi;
                    let b = case.batch();
                    // One corruption per case; each must be caught by validation.
                    let reshape = |t: &mut Tensor, s: Vec<usize>| { *t = Tensor::zeros(&s, t.dtype()) };
                    match which {
                        0 => { let mut s = q.shape().to_vec(); let n = s.len(); s[n - 1] += 1; reshape(&mut q, s) }
                        1 => { let mut s = k.shape().to_vec(); let n = s.len(); s[n - 2] = case.hq() + 1; reshape(&mut k, s.clone()); reshape(&mut v, s) }
                        2 => { k = Tensor::zeros(k.shape(), if k.dtype() == DType::F32 { DType::F16 } else { DType::F32 }) }
                        3 => { out_shape.push(1) }
                        4 => { out_dtype = if out_dtype == DType::BF16 { DType::F16 } else { DType::BF16 } }
                        5 => { params.softcap = Some(if rng.below(2) == 0 { -1.0 } else { f32::NAN }) }
                        6 => { params.scale = Some(f32::INFINITY) }
                        7 => { alibi = true; slopes.push(0.1) }
                        8 => match case.layout {
                            LayoutKind::Dense => { let s = q.shape().to_vec(); reshape(&mut q, s[1..].to_vec()) }
                            LayoutKind::Varlen => { if b >= 1 { cu_k[1] = cu_k[b] + 1 } else { cu_k.push(1) } }
                            LayoutKind::Paged => { cu_q[0] = 1 }
                        },
                        9 => match case.layout {
                            LayoutKind::Dense => { let mut s = v.shape().to_vec(); s[1] += 1; reshape(&mut v, s) }
                            LayoutKind::Varlen => { cu_q.push(*cu_q.last().unwrap() + 1) }
                            LayoutKind::Paged => { sl[0] = (max_blocks * case.block_size + 1) as i32 }
                        },
                        10 => match case.layout {
                            LayoutKind::Paged => { sl[0] = sl[0].max(1); bt[0] = k.shape()[0] as i32 + rng.below(5) as i32 }
                            _ => { let mut s = v.shape().to_vec(); s[0] += 1; reshape(&mut v, s) }
                        },
                        _ => match case.layout {
                            LayoutKind::Paged => { max_blocks += 1 }
                            _ => { let mut s = q.shape().to_vec(); s[0] += 1; reshape(&mut q, s) }
                        },
                    }
                    let (qd, kd, vd) = (be.upload(&q).unwrap(), be.upload(&k).unwrap(), be.upload(&v).unwrap());
                    let mut call = match case.layout {
                        LayoutKind::Dense => attnkit::AttnCall::dense(&qd, &kd, &vd),
                        LayoutKind::Varlen => attnkit::AttnCall::varlen(&qd, &kd, &vd, &cu_q, &cu_k),
                        LayoutKind::Paged => attnkit::AttnCall::paged(&qd, &kd, &vd, &cu_q, &bt, max_blocks, &sl),
                    };
                    call.params = params;
                    call.alibi_slopes = if alibi { Some(&slopes) } else { None };
                    let mut out = be.upload(&sentinel(&out_shape, out_dtype)).unwrap();
                    let before = bytes(&*be, &out);
                    let r = be.forward(&call, Some(&mut out), None);
                    prop_assert!(r.is_err(), "corruption {} was accepted: {:?}", which, case);
                    prop_assert_eq!(before, bytes(&*be, &out), "a failed call wrote into the buffer");
                }

                #[test]
                fn gqa_equals_mha_with_repeated_kv(case in arb_case(be().map(|b| head_dims_of(&*b)).unwrap_or(vec![8]), 24)) {
                    let Some(be) = be() else { return Ok(()) };
                    let mut case = case;
                    case.layout = LayoutKind::Varlen;
                    if case.group == 1 { case.group = 2 }
                    let built = case.build();
                    let g = case.group;
                    // Repeat each kv head `g` times.
                    let rep = |t: &Tensor| -> Tensor {
                        let s = t.shape();
                        let (rows, hkv, d) = (s[0], s[1], s[2]);
                        let x = t.to_f64_vec().unwrap();
                        let mut y = Vec::with_capacity(rows * hkv * g * d);
                        for r in 0..rows { for h in 0..hkv { for _ in 0..g { y.extend_from_slice(&x[(r * hkv + h) * d..][..d]) } } }
                        Tensor::from_f64(&[rows, hkv * g, d], t.dtype(), &y).unwrap()
                    };
                    let (k2, v2) = (rep(&built.k), rep(&built.v));
                    let mut mha = case.clone();
                    mha.hkv = case.hq();
                    mha.group = 1;
                    let gq = run_on(&*be, &case, &built).unwrap();
                    let built2 = common::Built { k: k2, v: v2, q: built.q.try_clone_host().unwrap(), cu_q: built.cu_q.clone(), cu_k: built.cu_k.clone(), block_table: vec![], max_blocks: 0, seq_lens: vec![], slopes: built.slopes.clone() };
                    let mh = run_on(&*be, &mha, &built2).unwrap();
                    let (atol, rtol) = tol(case.dtype);
                    check_close("gqa vs mha", &gq.out, &mh.out, atol, rtol).map_err(TestCaseError::fail)?;
                }

                #[test]
                fn paged_equals_varlen_over_gathered_cache(case in arb_case(be().map(|b| head_dims_of(&*b)).unwrap_or(vec![8]), 40)) {
                    let Some(be) = be() else { return Ok(()) };
                    let mut case = case;
                    case.layout = LayoutKind::Paged;
                    let built = case.build();
                    // Gather each sequence's tokens out of the cache into a packed k/v.
                    let (hkv, d, bs) = (case.hkv, case.d, case.block_size);
                    let gather = |t: &Tensor| -> Tensor {
                        let x = t.to_f64_vec().unwrap();
                        let mut y = Vec::new();
                        for (s, l) in case.lens.iter().enumerate() {
                            for tok in 0..l.1 {
                                let p = built.block_table[s * built.max_blocks + tok / bs] as usize * bs + tok % bs;
                                y.extend_from_slice(&x[p * hkv * d..][..hkv * d]);
                            }
                        }
                        let n = y.len() / (hkv * d);
                        Tensor::from_f64(&[n, hkv, d], t.dtype(), &y).unwrap()
                    };
                    let mut vcase = case.clone();
                    vcase.layout = LayoutKind::Varlen;
                    let vb = common::Built { k: gather(&built.k), v: gather(&built.v), q: built.q.try_clone_host().unwrap(), cu_q: built.cu_q.clone(), cu_k: built.cu_k.clone(), block_table: vec![], max_blocks: 0, seq_lens: vec![], slopes: built.slopes.clone() };
                    let paged = run_on(&*be, &case, &built).unwrap();
                    let varlen = run_on(&*be, &vcase, &vb).unwrap();
                    prop_assert!(paged.out.iter().all(|x| !x.is_nan()), "NaN from unused cache slots leaked");
                    let (atol, rtol) = tol(case.dtype);
                    check_close("paged vs varlen", &paged.out, &varlen.out, atol, rtol).map_err(TestCaseError::fail)?;
                }

                #[test]
                fn varlen_equals_dense_per_sequence_and_is_batch_independent(case in arb_case(be().map(|b| head_dims_of(&*b)).unwrap_or(vec![8]), 24)) {
                    let Some(be) = be() else { return Ok(()) };
                    let mut case = case;
                    case.layout = LayoutKind::Varlen;
                    let built = case.build();
                    let whole = run_on(&*be, &case, &built).unwrap();
                    let (hq, hkv, d) = (case.hq(), case.hkv, case.d);
                    let (atol, rtol) = tol(case.dtype);
                    let q = built.q.to_f64_vec().unwrap();
                    let k = built.k.to_f64_vec().unwrap();
                    let v = built.v.to_f64_vec().unwrap();
                    for (s, &(lq, lk)) in case.lens.iter().enumerate() {
                        if lq == 0 || lk == 0 { continue }
                        let (q0, k0) = (built.cu_q[s] as usize, built.cu_k[s] as usize);
                        // The same sequence alone, as a dense batch of one.
                        let mut dcase = case.clone();
                        dcase.layout = LayoutKind::Dense;
                        dcase.lens = vec![(lq, lk)];
                        let db = common::Built {
                            q: Tensor::from_f64(&[1, lq, hq, d], case.dtype, &q[q0 * hq * d..(q0 + lq) * hq * d]).unwrap(),
                            k: Tensor::from_f64(&[1, lk, hkv, d], case.dtype, &k[k0 * hkv * d..(k0 + lk) * hkv * d]).unwrap(),
                            v: Tensor::from_f64(&[1, lk, hkv, d], case.dtype, &v[k0 * hkv * d..(k0 + lk) * hkv * d]).unwrap(),
                            cu_q: vec![], cu_k: vec![], block_table: vec![], max_blocks: 0, seq_lens: vec![], slopes: built.slopes.clone(),
                        };
                        let alone = run_on(&*be, &dcase, &db).unwrap();
                        check_close(&format!("sequence {s} in batch vs alone"), &whole.out[q0 * hq * d..(q0 + lq) * hq * d], &alone.out, atol, rtol).map_err(TestCaseError::fail)?;
                    }
                }
            }

            #[test]
            fn fixed_fully_masked_rows_are_zero_and_neg_inf() {
                let Some(be) = be() else { return };
                let d = head_dims_of(&*be)[0].max(*head_dims_of(&*be).iter().find(|&&d| d >= 8).unwrap_or(&1));
                // Sq > Sk with causal: the first Sq - Sk queries see nothing.
                let mut c = case(LayoutKind::Dense, DType::F32, vec![(9, 4)], 2, 2, d);
                c.params.causal = true;
                let built = c.build();
                let r = run_on(&*be, &c, &built).unwrap();
                let hq = c.hq();
                for i in 0..5 {
                    assert!(r.out[i * hq * d..(i + 1) * hq * d].iter().all(|&x| x == 0.0), "row {i} not zero");
                    for h in 0..hq {
                        assert_eq!(r.lse.as_ref().unwrap()[h * 9 + i], f64::NEG_INFINITY);
                    }
                }
                check_against_reference(&*be, &c).unwrap();
                // A window that leaves a gap, and an empty sequence in varlen.
                let mut c = case(LayoutKind::Varlen, DType::F16, vec![(3, 10), (0, 5), (4, 0)], 1, 3, d);
                c.params.window_left = Some(0);
                c.params.window_right = Some(0);
                c.params.causal = false;
                check_against_reference(&*be, &c).unwrap();
            }

            #[test]
            fn fixed_cases_match_reference() {
                let Some(be) = be() else { return };
                let dims = head_dims_of(&*be);
                let big = *dims.iter().filter(|&&d| d <= 128).max().unwrap();
                let mut cases = vec![
                    case(LayoutKind::Dense, DType::F32, vec![(1, 1)], 1, 1, dims[0]),
                    case(LayoutKind::Dense, DType::BF16, vec![(64, 64); 2], 2, 4, big),
                    case(LayoutKind::Dense, DType::F16, vec![(17, 130)], 1, 8, big),
                    case(LayoutKind::Varlen, DType::F32, vec![(5, 300), (1, 77), (33, 33)], 2, 2, big),
                    case(LayoutKind::Paged, DType::F16, vec![(1, 257), (1, 16), (7, 40)], 2, 4, big),
                    case(LayoutKind::Paged, DType::BF16, vec![(1, 1000)], 1, 4, big),
                    // Non-causal, 600 rows of one kv head: several of the cpu backend's
                    // 256-row tasks, the last one partial.
                    case(LayoutKind::Varlen, DType::F32, vec![(300, 310), (45, 45)], 1, 2, big),
                    // Causal with a left window, 600 rows of each kv head: several 256-row
                    // masked tasks, tiles skipped above the diagonal and left of the window.
                    case(LayoutKind::Dense, DType::F32, vec![(600, 640)], 2, 1, big),
                ];
                let n = cases.len();
                for (i, c) in cases.iter_mut().enumerate() {
                    c.params.causal = i % 2 == 1;
                    c.block_size = [16, 1, 5, 32, 16, 16, 16, 16][i % n];
                    c.seed = 1000 + i as u64;
                }
                cases[3].params.softcap = Some(5.0);
                cases[3].alibi = true;
                cases[4].params.window_left = Some(20);
                cases[2].params.window_right = Some(3);
                cases[7].params.window_left = Some(300);
                for c in &cases {
                    check_against_reference(&*be, c).unwrap_or_else(|e| panic!("backend {}: {e}", $name));
                }
            }

            #[test]
            fn nan_in_a_visible_value_stays_in_its_rows() {
                let Some(be) = be() else { return };
                let d = *head_dims_of(&*be).iter().find(|&&d| d >= 8).unwrap();
                let c = case(LayoutKind::Varlen, DType::F32, vec![(4, 4), (4, 4)], 1, 1, d);
                let mut built = c.build();
                let mut v = built.v.to_f64_vec().unwrap();
                v[0] = f64::NAN; // token 0 of sequence 0
                built.v = Tensor::from_f64(built.v.shape(), DType::F32, &v).unwrap();
                let r = run_on(&*be, &c, &built).unwrap();
                assert!(r.out[4 * d..].iter().all(|x| x.is_finite()), "NaN crossed into sequence 1");
            }
        }
    };
}

#[test]
fn report_backends() {
    eprintln!("attnkit conformance: backends compiled in: {:?}", attnkit::compiled());
    for name in attnkit::BACKENDS {
        match attnkit::by_name(name) {
            Ok(b) => eprintln!("  {name}: RUNS on {} (head dims {})", b.device(), b.capabilities().head_dims),
            Err(e) => eprintln!("  {name}: NOT RUN: {e}"),
        }
    }
    assert!(attnkit::compiled().contains(&"reference"));
}

conformance!(reference, "reference");
#[cfg(feature = "cpu")]
conformance!(cpu, "cpu");
#[cfg(feature = "wgpu")]
conformance!(wgpu, "wgpu");
#[cfg(feature = "cuda")]
conformance!(cuda, "cuda");
