//! Random inputs for `bench` and `check`: never zeros, deterministic from a seed.

use attnkit::casefile::Case;
use attnkit::{DType, HostData, LayoutKind, Params, Tensor};
use half::{bf16, f16};

/// splitmix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
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
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn coin(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// `n` uniform values in [-amp, amp) of `dtype`, built without an f64 copy (decode caches are large).
pub fn random(rng: &mut Rng, dtype: DType, n: usize, amp: f32) -> HostData {
    match dtype {
        DType::F32 => HostData::F32((0..n).map(|_| rng.uniform() * amp).collect()),
        DType::F16 => HostData::F16((0..n).map(|_| f16::from_f32(rng.uniform() * amp)).collect()),
        DType::BF16 => HostData::BF16((0..n).map(|_| bf16::from_f32(rng.uniform() * amp)).collect()),
        DType::I32 => HostData::I32((0..n).map(|_| rng.below(1000) as i32).collect()),
    }
}

pub fn tensor(rng: &mut Rng, shape: &[usize], dtype: DType, amp: f32) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_host(shape, random(rng, dtype, n, amp)).expect("shape and data agree")
}

/// Prefix sums of lengths, first 0.
pub fn prefix(lens: impl Iterator<Item = usize>) -> Vec<i32> {
    let mut v = vec![0i32];
    for l in lens {
        v.push(v.last().copied().unwrap_or(0) + l as i32);
    }
    v
}

/// A random problem of the contract, for `check`.
#[derive(Clone, Debug)]
pub struct Spec {
    pub layout: LayoutKind,
    pub dtype: DType,
    /// (q_len, k_len) per sequence; dense uses the first for all.
    pub lens: Vec<(usize, usize)>,
    pub hkv: usize,
    pub group: usize,
    pub d: usize,
    pub params: Params,
    pub alibi: bool,
    pub block_size: usize,
    pub seed: u64,
}

impl Spec {
    pub fn hq(&self) -> usize {
        self.hkv * self.group
    }

    /// Draw a random problem with head dim from `dims`.
    pub fn draw(rng: &mut Rng, dims: &[usize], seed: u64) -> Spec {
        let layout = LayoutKind::ALL[rng.below(3)];
        let dtype = DType::FLOATS[rng.below(3)];
        let b = 1 + rng.below(3);
        let mut lens: Vec<(usize, usize)> = (0..b).map(|_| (rng.below(48), rng.below(80))).collect();
        if layout == LayoutKind::Dense {
            let l0 = (lens[0].0.max(1), lens[0].1.max(1));
            lens.iter_mut().for_each(|l| *l = l0);
        }
        let maybe = |rng: &mut Rng, p: f64, n: usize| if rng.coin(p) { Some(rng.below(n)) } else { None };
        let params = Params {
            causal: rng.coin(0.5),
            window_left: maybe(rng, 0.25, 32),
            window_right: maybe(rng, 0.25, 32),
            softcap: if rng.coin(0.25) { Some(1.0 + 29.0 * (rng.uniform() + 1.0) / 2.0) } else { None },
            scale: if rng.coin(0.25) { Some(0.05 + 0.4 * (rng.uniform() + 1.0) / 2.0) } else { None },
        };
        Spec {
            layout,
            dtype,
            lens,
            hkv: 1 + rng.below(3),
            group: [1, 2, 4, 8][rng.below(4)],
            d: dims[rng.below(dims.len())],
            params,
            alibi: rng.coin(0.25),
            block_size: [1, 3, 8, 16, 32][rng.below(5)],
            seed,
        }
    }

    /// The host tensors. Paged caches hold NaN in every slot no sequence uses.
    pub fn build(&self) -> Case {
        let mut rng = Rng::new(self.seed);
        let (hq, hkv, d, b) = (self.hq(), self.hkv, self.d, self.lens.len());
        let amp = 1.5;
        let cu_q = prefix(self.lens.iter().map(|l| l.0));
        let cu_k = prefix(self.lens.iter().map(|l| l.1));
        let tq = *cu_q.last().unwrap_or(&0) as usize;
        let tk = *cu_k.last().unwrap_or(&0) as usize;
        let mut case = match self.layout {
            LayoutKind::Dense => {
                let (sq, sk) = self.lens[0];
                Case::dense(
                    tensor(&mut rng, &[b, sq, hq, d], self.dtype, amp),
                    tensor(&mut rng, &[b, sk, hkv, d], self.dtype, amp),
                    tensor(&mut rng, &[b, sk, hkv, d], self.dtype, 1.0),
                    self.params,
                )
            }
            LayoutKind::Varlen => {
                let mut c = Case::dense(
                    tensor(&mut rng, &[tq, hq, d], self.dtype, amp),
                    tensor(&mut rng, &[tk, hkv, d], self.dtype, amp),
                    tensor(&mut rng, &[tk, hkv, d], self.dtype, 1.0),
                    self.params,
                );
                c.layout = LayoutKind::Varlen;
                c.cu_seqlens_q = cu_q.clone();
                c.cu_seqlens_k = cu_k;
                c
            }
            LayoutKind::Paged => {
                let bs = self.block_size;
                let q = tensor(&mut rng, &[tq, hq, d], self.dtype, amp);
                let (kc, vc, table, max_blocks, num_blocks) = paged_cache(&mut rng, &self.lens, bs, hkv * d, amp);
                let mut c = Case::dense(
                    q,
                    Tensor::from_f64(&[num_blocks, bs, hkv, d], self.dtype, &kc).expect("cache shape"),
                    Tensor::from_f64(&[num_blocks, bs, hkv, d], self.dtype, &vc).expect("cache shape"),
                    self.params,
                );
                c.layout = LayoutKind::Paged;
                c.cu_seqlens_q = cu_q.clone();
                c.block_table = table;
                c.max_blocks = max_blocks;
                c.seq_lens = self.lens.iter().map(|l| l.1 as i32).collect();
                c
            }
        };
        if self.alibi {
            case.alibi_slopes = Some((0..hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect());
        }
        case
    }
}

/// Shuffled blocks for sequences of `lens` (k lengths), one spare column and two spare blocks;
/// unused slots hold NaN and unused table entries point anywhere, in range or not.
#[allow(clippy::type_complexity)]
fn paged_cache(
    rng: &mut Rng,
    lens: &[(usize, usize)],
    bs: usize,
    row: usize,
    amp: f32,
) -> (Vec<f64>, Vec<f64>, Vec<i32>, usize, usize) {
    let need: Vec<usize> = lens.iter().map(|l| l.1.div_ceil(bs)).collect();
    let max_blocks = need.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks = need.iter().sum::<usize>() + 2;
    let mut perm: Vec<usize> = (0..num_blocks).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let mut kc = vec![f64::NAN; num_blocks * bs * row];
    let mut vc = vec![f64::NAN; num_blocks * bs * row];
    let mut table = vec![-1i32; lens.len() * max_blocks];
    let mut next = 0;
    for (s, l) in lens.iter().enumerate() {
        for blk in 0..need[s] {
            table[s * max_blocks + blk] = perm[next] as i32;
            next += 1;
        }
        for t in 0..l.1 {
            let p = table[s * max_blocks + t / bs] as usize * bs + t % bs;
            for x in 0..row {
                kc[p * row + x] = (rng.uniform() * amp) as f64;
                vc[p * row + x] = rng.uniform() as f64;
            }
        }
        for blk in need[s]..max_blocks {
            table[s * max_blocks + blk] = if rng.coin(0.5) { -7 } else { perm[rng.below(num_blocks)] as i32 };
        }
    }
    (kc, vc, table, max_blocks, num_blocks)
}
