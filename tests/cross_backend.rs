//! Every backend present against every other on the same random cases. Each is within the SPEC's
//! tolerance of the f64 reference, so any two agree within twice it.

mod common;

use attnkit::{DType, LayoutKind, Params};
use common::*;
use proptest::prelude::*;

fn present() -> Vec<(&'static str, std::sync::Arc<dyn attnkit::AttentionBackend>)> {
    attnkit::BACKENDS.into_iter().filter_map(|n| backend(n).map(|b| (n, b))).collect()
}

fn arb() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(LayoutKind::Dense), Just(LayoutKind::Varlen), Just(LayoutKind::Paged)],
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        prop::collection::vec((1usize..33, 1usize..65), 1..3),
        1usize..3,
        prop_oneof![Just(1usize), Just(4)],
        prop_oneof![Just(8usize), Just(32), Just(64), Just(128)],
        any::<bool>(),
        prop::option::of(0usize..16),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(layout, dtype, mut lens, hkv, group, d, causal, window_left, alibi, seed)| {
            if layout == LayoutKind::Dense {
                let l0 = lens[0];
                lens.iter_mut().for_each(|l| *l = l0);
            }
            let params = Params { causal, window_left, ..Params::default() };
            Case { layout, dtype, lens, hkv, group, d, params, alibi, block_size: 16, lse: true, seed }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Direct("proptest-regressions/cross_backend.txt"))), ..ProptestConfig::default() })]
    #[test]
    fn backends_agree_with_each_other(case in arb()) {
        let all = present();
        let built = case.build();
        let mut results = Vec::new();
        for (name, be) in &all {
            if be.supports(&attnkit::Problem { dtype: case.dtype, head_dim: case.d, ..attnkit::Problem::new(case.dtype, case.d) }).is_err() {
                continue;
            }
            results.push((*name, run_on(&**be, &case, &built).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?));
        }
        prop_assert!(results.len() >= 2 || all.len() < 2, "fewer than two backends ran");
        let (atol, rtol) = tol(case.dtype);
        for (i, (a, ra)) in results.iter().enumerate() {
            for (b, rb) in &results[i + 1..] {
                check_close(&format!("{a} vs {b} out"), &ra.out, &rb.out, 2.0 * atol, 2.0 * rtol)
                    .map_err(|e| TestCaseError::fail(format!("{e}\ncase {case:?}")))?;
                check_close(&format!("{a} vs {b} lse"), ra.lse.as_ref().unwrap(), rb.lse.as_ref().unwrap(), 2e-3, 2e-4)
                    .map_err(|e| TestCaseError::fail(format!("{e}\ncase {case:?}")))?;
            }
        }
    }
}

#[test]
fn at_least_two_backends_are_compared() {
    let names: Vec<_> = present().into_iter().map(|(n, _)| n).collect();
    eprintln!("cross-backend check over: {names:?}");
    assert!(names.len() >= 2 || !cfg!(feature = "cpu"), "only {names:?} present");
}
