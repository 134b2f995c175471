//! Shared by the conformance suite: random cases, tensor builders, tolerance checks, and backend
//! acquisition that fails (not skips) when a compiled-in backend finds no device.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use attnkit::{AttentionBackend, AttnCall, DType, Error, HostData, LayoutKind, Params, Tensor};

/// Environment variable listing backends to skip when they find no device (`wgpu,cuda`).
pub const SKIP_VAR: &str = "ATTNKIT_SKIP";

/// The backend `name`, or `None` if it is not compiled in, or compiled in without a device while
/// `ATTNKIT_SKIP` names it. Compiled in, no device, not named: the test fails. One instance per
/// name per test binary (device backends compile kernels and open contexts once).
pub fn backend(name: &str) -> Option<Arc<dyn AttentionBackend>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<dyn AttentionBackend>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(b) = cache.lock().unwrap().get(name) {
        return Some(b.clone());
    }
    match attnkit::by_name(name) {
        Ok(b) => {
            let b: Arc<dyn AttentionBackend> = Arc::from(b);
            cache.lock().unwrap().insert(name.to_string(), b.clone());
            Some(b)
        }
        Err(Error::NotCompiled { .. }) => None,
        Err(e) => {
            if skipped(name) {
                eprintln!("!!! SKIPPING backend `{name}` because {SKIP_VAR} names it: {e}");
                None
            } else {
                panic!("backend `{name}` is compiled in but cannot run: {e}\n(set {SKIP_VAR}={name} to skip it explicitly)");
            }
        }
    }
}

/// Whether `ATTNKIT_SKIP` names backend `name` (or `all`).
pub fn skipped(name: &str) -> bool {
    let skip = std::env::var(SKIP_VAR).unwrap_or_default();
    skip.split(',').any(|s| s.trim() == name || s.trim() == "all")
}

/// splitmix64: deterministic data from a seed, no extra crates.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn vec(&mut self, n: usize, amp: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform() * amp).collect()
    }
}

/// One random problem of the contract.
#[derive(Clone, Debug)]
pub struct Case {
    pub layout: LayoutKind,
    pub dtype: DType,
    /// Per sequence (q_len, k_len). Dense uses the first pair for every sequence.
    pub lens: Vec<(usize, usize)>,
    pub hkv: usize,
    pub group: usize,
    pub d: usize,
    pub params: Params,
    pub alibi: bool,
    pub block_size: usize,
    pub lse: bool,
    pub seed: u64,
}

/// The host tensors and metadata of a case.
pub struct Built {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub cu_q: Vec<i32>,
    pub cu_k: Vec<i32>,
    pub block_table: Vec<i32>,
    pub max_blocks: usize,
    pub seq_lens: Vec<i32>,
    pub slopes: Vec<f32>,
}

impl Case {
    pub fn hq(&self) -> usize {
        self.hkv * self.group
    }
    pub fn batch(&self) -> usize {
        self.lens.len()
    }
    /// Build host tensors. Scores have a spread of a few units so the softmax is neither flat nor one-hot.
    pub fn build(&self) -> Built {
        let mut rng = Rng::new(self.seed);
        let (hq, hkv, d, b) = (self.hq(), self.hkv, self.d, self.batch());
        let amp = 1.5;
        let cu = |f: &dyn Fn(&(usize, usize)) -> usize| -> Vec<i32> {
            let mut v = vec![0i32];
            for l in &self.lens {
                v.push(v.last().unwrap() + f(l) as i32);
            }
            v
        };
        let cu_q = cu(&|l| l.0);
        let cu_k = cu(&|l| l.1);
        let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect();
        let mut block_table = Vec::new();
        let mut max_blocks = 0;
        let seq_lens: Vec<i32> = self.lens.iter().map(|l| l.1 as i32).collect();
        let (q, k, v) = match self.layout {
            LayoutKind::Dense => {
                let (sq, sk) = self.lens[0];
                let q = Tensor::from_f64(&[b, sq, hq, d], self.dtype, &rng.vec(b * sq * hq * d, amp)).unwrap();
                let k = Tensor::from_f64(&[b, sk, hkv, d], self.dtype, &rng.vec(b * sk * hkv * d, amp)).unwrap();
                let v = Tensor::from_f64(&[b, sk, hkv, d], self.dtype, &rng.vec(b * sk * hkv * d, 1.0)).unwrap();
                (q, k, v)
            }
            LayoutKind::Varlen => {
                let (tq, tk) = (*cu_q.last().unwrap() as usize, *cu_k.last().unwrap() as usize);
                let q = Tensor::from_f64(&[tq, hq, d], self.dtype, &rng.vec(tq * hq * d, amp)).unwrap();
                let k = Tensor::from_f64(&[tk, hkv, d], self.dtype, &rng.vec(tk * hkv * d, amp)).unwrap();
                let v = Tensor::from_f64(&[tk, hkv, d], self.dtype, &rng.vec(tk * hkv * d, 1.0)).unwrap();
                (q, k, v)
            }
            LayoutKind::Paged => {
                let bs = self.block_size;
                let tq = *cu_q.last().unwrap() as usize;
                let q = Tensor::from_f64(&[tq, hq, d], self.dtype, &rng.vec(tq * hq * d, amp)).unwrap();
                let need: Vec<usize> = self.lens.iter().map(|l| l.1.div_ceil(bs)).collect();
                max_blocks = need.iter().copied().max().unwrap_or(0) + 1;
                let used: usize = need.iter().sum();
                let num_blocks = used + 2;
                // Shuffled physical blocks; unused slots and spare blocks hold NaN.
                let mut perm: Vec<usize> = (0..num_blocks).collect();
                for i in (1..perm.len()).rev() {
                    let j = rng.below(i + 1);
                    perm.swap(i, j);
                }
                let row = hkv * d;
                let mut kc = vec![f64::NAN; num_blocks * bs * row];
                let mut vc = vec![f64::NAN; num_blocks * bs * row];
                block_table = vec![i32::MIN; b * max_blocks];
                let mut next = 0;
                for (s, l) in self.lens.iter().enumerate() {
                    for blk in 0..need[s] {
                        block_table[s * max_blocks + blk] = perm[next] as i32;
                        next += 1;
                    }
                    for t in 0..l.1 {
                        let p = block_table[s * max_blocks + t / bs] as usize * bs + t % bs;
                        for x in 0..row {
                            kc[p * row + x] = rng.uniform() * amp;
                            vc[p * row + x] = rng.uniform();
                        }
                    }
                    // Unused table entries point anywhere, in range or not.
                    for blk in need[s]..max_blocks {
                        block_table[s * max_blocks + blk] =
                            if rng.below(2) == 0 { -7 } else { perm[rng.below(num_blocks)] as i32 };
                    }
                }
                let k = Tensor::from_f64(&[num_blocks, bs, hkv, d], self.dtype, &kc).unwrap();
                let v = Tensor::from_f64(&[num_blocks, bs, hkv, d], self.dtype, &vc).unwrap();
                (q, k, v)
            }
        };
        Built { q, k, v, cu_q, cu_k, block_table, max_blocks, seq_lens, slopes }
    }
}

impl Built {
    /// The call over these tensors (which may be the uploaded copies).
    pub fn call<'a>(&'a self, case: &Case, q: &'a Tensor, k: &'a Tensor, v: &'a Tensor) -> AttnCall<'a> {
        let mut c = match case.layout {
            LayoutKind::Dense => AttnCall::dense(q, k, v),
            LayoutKind::Varlen => AttnCall::varlen(q, k, v, &self.cu_q, &self.cu_k),
            LayoutKind::Paged => {
                AttnCall::paged(q, k, v, &self.cu_q, &self.block_table, self.max_blocks, &self.seq_lens)
            }
        };
        c.params = case.params;
        c.alibi_slopes = if case.alibi { Some(&self.slopes) } else { None };
        c.return_lse = case.lse;
        c
    }
}

/// Tolerances of the SPEC: (atol, rtol) for out of each dtype.
pub fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 1e-4),
        DType::F16 => (2e-3, 5e-3),
        DType::BF16 => (1.6e-2, 2e-2),
        DType::I32 => (0.0, 0.0),
    }
}

/// `Err` with index, both values, difference and tolerance for the first element out of tolerance.
pub fn check_close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= atol + rtol * w.abs() };
        if !ok {
            return Err(format!(
                "{what}[{i}]: got {g}, want {w}, |diff| {} > tol {} (atol {atol}, rtol {rtol})",
                (g - w).abs(),
                atol + rtol * w.abs()
            ));
        }
    }
    Ok(())
}

/// Everything the backend returned for a case, on the host.
pub struct Result2 {
    pub out: Vec<f64>,
    pub lse: Option<Vec<f64>>,
}

/// Run a case on a backend, uploading inputs and downloading outputs.
pub fn run_on(be: &dyn AttentionBackend, case: &Case, built: &Built) -> Result<Result2, Error> {
    let (q, k, v) = (be.upload(&built.q)?, be.upload(&built.k)?, be.upload(&built.v)?);
    let call = built.call(case, &q, &k, &v);
    let o = be.forward(&call, None, None)?;
    let out = be.download(o.out.as_ref().expect("out allocated"))?.to_f64_vec()?;
    let lse = match o.lse {
        Some(l) => Some(be.download(&l)?.to_f64_vec()?),
        None => None,
    };
    Ok(Result2 { out, lse })
}

/// The reference result of a case.
pub fn reference(case: &Case, built: &Built) -> (Vec<f64>, Vec<f64>) {
    let call = built.call(case, &built.q, &built.k, &built.v);
    let c = attnkit::validate(&call, attnkit::Device::Host, "reference", None, None).expect("valid case");
    attnkit::reference::attention_f64(&c).expect("reference")
}

/// Compare a backend with the f64 reference within the SPEC's tolerances.
pub fn check_against_reference(be: &dyn AttentionBackend, case: &Case) -> Result<(), String> {
    let built = case.build();
    let got = run_on(be, case, &built).map_err(|e| format!("{case:?}: forward failed: {e}"))?;
    let (want, want_lse) = reference(case, &built);
    let (atol, rtol) = tol(case.dtype);
    check_close("out", &got.out, &want, atol, rtol).map_err(|e| format!("{e}\ncase {case:?}"))?;
    if case.lse {
        let lse = got.lse.ok_or("lse missing")?;
        check_close("lse", &lse, &want_lse, 1e-3, 1e-4).map_err(|e| format!("{e}\ncase {case:?}"))?;
    }
    if got.out.iter().any(|x| x.is_nan()) {
        return Err(format!("NaN in out\ncase {case:?}"));
    }
    Ok(())
}

/// Fill a host tensor with a sentinel (NaN is not bit-comparable, so a fixed odd value).
pub fn sentinel(shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product::<usize>();
    Tensor::from_f64(shape, dtype, &vec![-12345.0; n]).unwrap()
}

/// Host bytes, for bitwise comparisons.
pub fn bytes(be: &dyn AttentionBackend, t: &Tensor) -> Vec<u8> {
    be.download(t).unwrap().host().map(HostData::to_le_bytes).unwrap()
}

/// Random cases per property: `ATTNKIT_CASES`, default 64.
#[allow(dead_code)]
pub fn case_count() -> usize {
    std::env::var("ATTNKIT_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64)
}
