//! attnkit's candle glue: the candle functions against the f64 reference over random shapes,
//! dtypes, parameters and candle layouts; the caller-buffer rules (aliasing, contiguity, nothing
//! written on error); the paged KV cache; and the Llama example's check, a few steps on the CPU.

#[path = "../examples/common/llama.rs"]
mod llama;

use attnkit::candle::{reshape_and_cache, Attn, PagedKvCache};
use attnkit::{reference, validate, AttnCall, DType, Device, Error, Layout, LayoutKind, Params, Tensor};
use candle_core as cc;

type Res<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// splitmix64.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, amp: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform() * amp).collect()
    }
}

fn cdt(d: DType) -> cc::DType {
    match d {
        DType::F32 => cc::DType::F32,
        DType::F16 => cc::DType::F16,
        DType::BF16 => cc::DType::BF16,
        DType::I32 => cc::DType::I32,
    }
}

/// `(atol, rtol)` of the contract.
fn tol(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (2e-5, 1e-4),
        DType::F16 => (2e-3, 5e-3),
        _ => (1.6e-2, 2e-2),
    }
}

/// How a candle input is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mem {
    /// Its own contiguous storage.
    Contiguous,
    /// Contiguous, at a start offset inside a larger storage (a `narrow` on dim 0).
    Offset,
    /// A column slice of a wider tensor: strided, so the glue makes it contiguous.
    Strided,
}

/// A candle tensor of `shape` holding exactly `data` (already rounded to `dtype`), laid out as `mem`.
fn to_candle(data: &[f64], shape: &[usize], dtype: DType, mem: Mem, dev: &cc::Device) -> cc::Result<cc::Tensor> {
    let t = cc::Tensor::from_vec(data.to_vec(), shape, &cc::Device::Cpu)?.to_dtype(cdt(dtype))?.to_device(dev)?;
    if t.elem_count() == 0 && !dev.is_cpu() {
        // candle 0.11 cannot fill an empty CUDA tensor (`Tensor::full` launches an empty grid and
        // gets CUDA_ERROR_INVALID_VALUE); an empty tensor has no layout to vary anyway.
        return Ok(t);
    }
    match mem {
        Mem::Contiguous => Ok(t),
        Mem::Offset => {
            let mut pad_shape = shape.to_vec();
            pad_shape[0] = 2;
            let pad = cc::Tensor::full(f32::NAN, pad_shape, dev)?.to_dtype(cdt(dtype))?;
            let big = cc::Tensor::cat(&[&pad, &t], 0)?;
            let v = big.narrow(0, 2, shape[0])?;
            assert!(v.is_contiguous() && (v.layout().start_offset() > 0 || v.elem_count() == 0));
            Ok(v)
        }
        Mem::Strided => {
            let last = shape.len() - 1;
            let junk = cc::Tensor::full(f32::NAN, shape, dev)?.to_dtype(cdt(dtype))?;
            let wide = cc::Tensor::cat(&[&junk, &t], last)?;
            let v = wide.narrow(last, shape[last], shape[last])?;
            assert!(!v.is_contiguous() || shape.iter().product::<usize>() == 0);
            Ok(v)
        }
    }
}

fn to_f64(t: &cc::Tensor) -> cc::Result<Vec<f64>> {
    if t.elem_count() == 0 {
        // candle 0.11's CUDA `to_dtype` launches an empty grid on an empty tensor and gets
        // CUDA_ERROR_INVALID_VALUE: there is nothing to read.
        return Ok(Vec::new());
    }
    t.to_dtype(cc::DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// One random problem and its tensors.
struct Case {
    kind: LayoutKind,
    dtype: DType,
    q_shape: Vec<usize>,
    kv_shape: Vec<usize>,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    block_table: Vec<i32>,
    max_blocks: usize,
    seq_lens: Vec<i32>,
    slopes: Vec<f32>,
    params: Params,
    alibi: bool,
}

impl Case {
    fn random(seed: u64) -> Case {
        let mut r = Rng(seed);
        let kind = LayoutKind::ALL[seed as usize % 3];
        let dtype = DType::FLOATS[(seed as usize / 3) % 3];
        let b = 1 + r.below(3);
        let (hkv, group) = (1 + r.below(2), 1 + r.below(3));
        let hq = hkv * group;
        let d = [8, 16, 24, 32, 64, 80][r.below(6)];
        let mut lens: Vec<(usize, usize)> = (0..b)
            .map(|_| {
                let sq = r.below(10);
                (sq, sq + r.below(24))
            })
            .collect();
        if kind == LayoutKind::Dense {
            let l = lens[0];
            lens.iter_mut().for_each(|x| *x = l);
        }
        let mut params = Params { causal: r.below(2) == 0, ..Params::default() };
        if r.below(4) == 0 {
            params.window_left = Some(r.below(8));
            params.window_right = (r.below(2) == 0).then(|| r.below(4));
        }
        if r.below(4) == 0 {
            params.softcap = Some(2.0 + 10.0 * r.uniform().abs() as f32);
        }
        if r.below(5) == 0 {
            params.scale = Some(0.3);
        }
        let alibi = r.below(5) == 0;
        let round = |x: Vec<f64>, shape: &[usize]| Tensor::from_f64(shape, dtype, &x).unwrap().to_f64_vec().unwrap();
        let tq: usize = lens.iter().map(|l| l.0).sum();
        let tk: usize = lens.iter().map(|l| l.1).sum();
        let (q_shape, mut kv_shape) = match kind {
            LayoutKind::Dense => (vec![b, lens[0].0, hq, d], vec![b, lens[0].1, hkv, d]),
            _ => (vec![tq, hq, d], vec![tk, hkv, d]),
        };
        let q = round(r.vec(q_shape.iter().product(), 1.5), &q_shape);
        let mut k = round(r.vec(kv_shape.iter().product(), 1.5), &kv_shape);
        let mut v = round(r.vec(kv_shape.iter().product(), 1.0), &kv_shape);
        let prefix = |f: &dyn Fn(&(usize, usize)) -> usize| {
            let mut c = vec![0i32];
            for l in &lens {
                c.push(c[c.len() - 1] + f(l) as i32);
            }
            c
        };
        let (cu_q, cu_k) = (prefix(&|l| l.0), prefix(&|l| l.1));
        let (mut block_table, mut max_blocks) = (vec![], 0);
        let seq_lens: Vec<i32> = lens.iter().map(|l| l.1 as i32).collect();
        if kind == LayoutKind::Paged {
            // Scatter each sequence's keys over shuffled blocks; NaN everywhere else.
            let bs = [1, 3, 4, 16][r.below(4)];
            let need: Vec<usize> = lens.iter().map(|l| l.1.div_ceil(bs)).collect();
            let nb: usize = need.iter().sum::<usize>() + 2;
            let mut ids: Vec<i32> = (0..nb as i32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, r.below(i + 1));
            }
            max_blocks = need.iter().max().copied().unwrap_or(0) + 1;
            block_table = vec![9999; b * max_blocks]; // unused entries hold anything
            let row = hkv * d;
            let (mut kc, mut vc) = (vec![f64::NAN; nb * bs * row], vec![f64::NAN; nb * bs * row]);
            let mut next = 0;
            for (s, l) in lens.iter().enumerate() {
                for j in 0..need[s] {
                    block_table[s * max_blocks + j] = ids[next];
                    next += 1;
                }
                for t in 0..l.1 {
                    let slot = block_table[s * max_blocks + t / bs] as usize * bs + t % bs;
                    let src = (cu_k[s] as usize + t) * row;
                    kc[slot * row..][..row].copy_from_slice(&k[src..src + row]);
                    vc[slot * row..][..row].copy_from_slice(&v[src..src + row]);
                }
            }
            kv_shape = vec![nb, bs, hkv, d];
            (k, v) = (kc, vc);
        }
        let slopes = (0..hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect();
        Case {
            kind,
            dtype,
            q_shape,
            kv_shape,
            q,
            k,
            v,
            cu_q,
            cu_k,
            block_table,
            max_blocks,
            seq_lens,
            slopes,
            params,
            alibi,
        }
    }

    fn layout(&self) -> Layout<'_> {
        match self.kind {
            LayoutKind::Dense => Layout::Dense,
            LayoutKind::Varlen => Layout::Varlen { cu_seqlens_q: &self.cu_q, cu_seqlens_k: &self.cu_k },
            LayoutKind::Paged => Layout::Paged {
                cu_seqlens_q: &self.cu_q,
                block_table: &self.block_table,
                max_blocks: self.max_blocks,
                seq_lens: &self.seq_lens,
            },
        }
    }

    fn attn(&self) -> Attn<'_> {
        Attn { layout: self.layout(), params: self.params, alibi_slopes: self.alibi.then_some(&self.slopes[..]) }
    }

    /// The f64 reference (out, lse).
    fn reference(&self) -> attnkit::Result<(Vec<f64>, Vec<f64>)> {
        let q = Tensor::from_f64(&self.q_shape, self.dtype, &self.q)?;
        let k = Tensor::from_f64(&self.kv_shape, self.dtype, &self.k)?;
        let v = Tensor::from_f64(&self.kv_shape, self.dtype, &self.v)?;
        let mut call = AttnCall::with_layout(&q, &k, &v, self.layout());
        call.params = self.params;
        call.alibi_slopes = self.alibi.then_some(&self.slopes[..]);
        reference::attention_f64(&validate(&call, Device::Host, "reference", None, None)?)
    }

    fn inputs(&self, mem: Mem, dev: &cc::Device) -> cc::Result<[cc::Tensor; 3]> {
        Ok([
            to_candle(&self.q, &self.q_shape, self.dtype, mem, dev)?,
            to_candle(&self.k, &self.kv_shape, self.dtype, mem, dev)?,
            to_candle(&self.v, &self.kv_shape, self.dtype, mem, dev)?,
        ])
    }
}

fn check_close(what: &str, got: &[f64], want: &[f64], (atol, rtol): (f64, f64), seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}: length (seed {seed})");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY { g == w } else { (g - w).abs() <= atol + rtol * w.abs() };
        assert!(
            ok,
            "{what}[{i}]: got {g}, reference {w}, |diff| {} > {atol} + {rtol} * |ref| (seed {seed})",
            (g - w).abs()
        );
    }
}

#[test]
fn random_cases_match_the_reference_in_every_layout_and_dtype() -> Res {
    random_cases(&cc::Device::Cpu)
}

fn random_cases(dev: &cc::Device) -> Res {
    let mut counted = [0usize; 3];
    let t0 = std::time::Instant::now();
    for seed in 0..72u64 {
        eprintln!("random case {seed} on {dev:?} at {:.1} s", t0.elapsed().as_secs_f64());
        let case = Case::random(seed);
        let (want_out, want_lse) = case.reference()?;
        let mem = [Mem::Contiguous, Mem::Offset, Mem::Strided][(seed as usize / 9) % 3];
        let [q, k, v] = case.inputs(mem, dev)?;
        assert!(q.device().same_device(dev));
        let attn = case.attn();
        let what = format!("{} {} {mem:?} {:?}", case.kind, case.dtype, case.params);

        let (out, lse) = attn.forward_lse(&q, &k, &v)?;
        assert_eq!(out.dims(), case.q_shape.as_slice(), "{what}");
        assert_eq!(out.dtype(), cdt(case.dtype), "{what}");
        assert_eq!(lse.dims(), attn.lse_shape(&q)?.as_slice(), "{what}");
        assert!(out.device().same_device(dev) && lse.device().same_device(dev), "{what}");
        check_close(&format!("out ({what})"), &to_f64(&out)?, &want_out, tol(case.dtype), seed);
        check_close(&format!("lse ({what})"), &to_f64(&lse)?, &want_lse, (1e-3, 1e-4), seed);
        let plain = attn.forward(&q, &k, &v)?;
        assert_eq!(to_f64(&plain)?, to_f64(&out)?, "forward and forward_lse differ ({what})");

        // Into caller buffers that sit at an offset inside larger tensors: bit-identical, and
        // the elements around them untouched.
        let n: usize = case.q_shape.iter().product();
        // At an odd offset on the CPU; on a GPU at 16 bytes (its kernels store 16-byte vectors,
        // and a misaligned output is refused, checked below).
        let at = if dev.is_cpu() { 3 } else { 16 / cdt(case.dtype).size_in_bytes() };
        let big = cc::Tensor::full(7f32, n + at + 2, dev)?.to_dtype(cdt(case.dtype))?;
        let buf = big.narrow(0, at, n)?.reshape(case.q_shape.as_slice())?;
        let lse_n: usize = lse.dims().iter().product();
        let lse_big = cc::Tensor::full(7f32, lse_n + 2, dev)?;
        let lse_buf = lse_big.narrow(0, 1, lse_n)?.reshape(lse.dims())?;
        attn.forward_into(&q, &k, &v, &buf, Some(&lse_buf))?;
        assert_eq!(to_f64(&buf)?, to_f64(&out)?, "forward_into differs from forward ({what})");
        let lse_a = to_f64(&lse_buf)?;
        let lse_b = to_f64(&lse)?;
        assert!(lse_a.iter().zip(&lse_b).all(|(a, b)| a == b || (a.is_nan() && b.is_nan())), "lse buffer ({what})");
        let all = to_f64(&big)?;
        assert!(all[..at].iter().chain(&all[at + n..]).all(|&x| x == 7.0), "wrote outside out ({what})");
        if !dev.is_cpu() && n > 0 {
            let odd = big.narrow(0, 1, n)?.reshape(case.q_shape.as_slice())?;
            assert_value_err(attn.forward_into(&q, &k, &v, &odd, None), "out", "16-byte");
            assert_eq!(to_f64(&big)?, all, "a refused call wrote ({what})");
        }
        let all = to_f64(&lse_big)?;
        assert!(all[0] == 7.0 && all[lse_n + 1] == 7.0, "wrote outside lse ({what})");
        counted[case.kind as usize] += 1;
    }
    assert_eq!(counted, [24, 24, 24]);
    Ok(())
}

/// A simple GQA decode problem for the buffer-rule tests.
fn small(dev: &cc::Device) -> cc::Result<(cc::Tensor, cc::Tensor, cc::Tensor)> {
    let q = cc::Tensor::randn(0f32, 1.0, (2, 5, 4, 16), dev)?;
    let k = cc::Tensor::randn(0f32, 1.0, (2, 9, 2, 16), dev)?;
    let v = cc::Tensor::randn(0f32, 1.0, (2, 9, 2, 16), dev)?;
    Ok((q, k, v))
}

fn snapshot(t: &cc::Tensor) -> Vec<f64> {
    to_f64(t).unwrap()
}

fn assert_value_err(r: attnkit::Result<()>, arg: &str, mentions: &str) {
    match r {
        Err(Error::Value { arg: a, value, msg }) => {
            assert_eq!(a, arg, "{value}: {msg}");
            assert!(value.contains(mentions) || msg.contains(mentions), "`{value}: {msg}` does not mention {mentions}");
        }
        other => panic!("expected a Value error on `{arg}`, got {other:?}"),
    }
}

#[test]
fn an_output_aliasing_an_input_is_rejected_before_anything_runs() -> Res {
    aliasing(&cc::Device::Cpu)
}

fn aliasing(dev: &cc::Device) -> Res {
    let (q, k, v) = small(dev)?;
    let attn = Attn::dense().causal(true);
    let before = snapshot(&q);
    // out is q itself.
    assert_value_err(attn.forward_into(&q, &k, &v, &q, None), "out", "`q`");
    assert_eq!(snapshot(&q), before);

    // out and k are disjoint views of one storage: still refused (one rule, no overlap maths).
    let both = cc::Tensor::randn(0f32, 1.0, (2 * 9 * 2 * 16 + 2 * 5 * 4 * 16,), dev)?;
    let k2 = both.narrow(0, 0, 2 * 9 * 2 * 16)?.reshape((2, 9, 2, 16))?;
    let out2 = both.narrow(0, 2 * 9 * 2 * 16, 2 * 5 * 4 * 16)?.reshape((2, 5, 4, 16))?;
    let before = snapshot(&both);
    assert_value_err(attn.forward_into(&q, &k2, &v, &out2, None), "out", "`k`");
    assert_eq!(snapshot(&both), before);

    // lse aliasing v or out.
    let out = cc::Tensor::zeros((2, 5, 4, 16), cc::DType::F32, dev)?;
    let lse_v = v.flatten_all()?.narrow(0, 0, 2 * 4 * 5)?.reshape((2, 4, 5))?;
    assert_value_err(attn.forward_into(&q, &k, &v, &out, Some(&lse_v)), "lse", "`v`");
    let lse_o = out.flatten_all()?.narrow(0, 0, 2 * 4 * 5)?.reshape((2, 4, 5))?;
    assert_value_err(attn.forward_into(&q, &k, &v, &out, Some(&lse_o)), "lse", "`out`");
    assert!(snapshot(&out).iter().all(|&x| x == 0.0));

    // The error converts into candle's error for `?` in model code.
    let e: cc::Error = attn.forward_into(&q, &k, &v, &q, None).unwrap_err().into();
    assert!(e.to_string().contains("alias"), "{e}");
    Ok(())
}

#[test]
fn a_non_contiguous_output_is_an_error_and_non_contiguous_inputs_are_made_contiguous() -> Res {
    non_contiguous(&cc::Device::Cpu)
}

fn non_contiguous(dev: &cc::Device) -> Res {
    let (q, k, v) = small(dev)?;
    let attn = Attn::dense();
    let want = attn.forward(&q, &k, &v)?;
    // out as a transposed view: refused, untouched.
    let t = cc::Tensor::zeros((2, 4, 5, 16), cc::DType::F32, dev)?;
    let out = t.transpose(1, 2)?;
    assert!(!out.is_contiguous());
    assert_value_err(attn.forward_into(&q, &k, &v, &out, None), "out", "contiguous");
    assert!(snapshot(&t).iter().all(|&x| x == 0.0));
    // q, k, v as transposed views of differently ordered storage: same result as contiguous.
    let (qt, kt, vt) =
        (q.transpose(1, 2)?.contiguous()?, k.transpose(1, 2)?.contiguous()?, v.transpose(1, 2)?.contiguous()?);
    let (qv, kv, vv) = (qt.transpose(1, 2)?, kt.transpose(1, 2)?, vt.transpose(1, 2)?);
    assert!(!qv.is_contiguous() && !kv.is_contiguous());
    let got = attn.forward(&qv, &kv, &vv)?;
    assert_eq!(snapshot(&got), snapshot(&want));
    let buf = cc::Tensor::zeros((2, 5, 4, 16), cc::DType::F32, dev)?;
    attn.forward_into(&qv, &kv, &vv, &buf, None)?;
    assert_eq!(snapshot(&buf), snapshot(&want));
    Ok(())
}

#[test]
fn bad_inputs_get_typed_errors_and_leave_the_buffer_untouched() -> Res {
    bad_inputs(&cc::Device::Cpu)
}

fn bad_inputs(dev: &cc::Device) -> Res {
    let (q, k, v) = small(dev)?;
    let out = cc::Tensor::full(3f32, (2, 5, 4, 16), dev)?;
    let attn = Attn::dense();
    // Wrong out shape.
    let short = cc::Tensor::full(3f32, (2, 5, 4, 8), dev)?;
    assert!(matches!(attn.forward_into(&q, &k, &v, &short, None), Err(Error::Shape { arg: "out", .. })));
    // Wrong out dtype.
    let half = out.to_dtype(cc::DType::F16)?;
    assert!(matches!(attn.forward_into(&q, &k, &v, &half, None), Err(Error::DType { arg: "out", .. })));
    // Hq not a multiple of Hkv.
    let k3 = cc::Tensor::randn(0f32, 1.0, (2, 9, 3, 16), dev)?;
    assert!(matches!(attn.forward_into(&q, &k3, &k3.clone(), &out, None), Err(Error::Value { .. })));
    // A dtype attention does not take.
    let q64 = q.to_dtype(cc::DType::F64)?;
    assert!(matches!(attn.forward(&q64, &k, &v), Err(Error::Value { .. })));
    // softcap <= 0.
    assert!(matches!(attn.softcap(Some(0.0)).forward_into(&q, &k, &v, &out, None), Err(Error::Value { .. })));
    // Paged: a block index out of range.
    let qp = cc::Tensor::randn(0f32, 1.0, (3, 4, 16), dev)?;
    let cache = cc::Tensor::randn(0f32, 1.0, (4, 4, 2, 16), dev)?;
    let outp = cc::Tensor::full(3f32, (3, 4, 16), dev)?;
    let (cu, table, lens) = ([0, 3], [0, 4], [6]);
    match Attn::paged(&cu, &table, 2, &lens).forward_into(&qp, &cache, &cache.clone(), &outp, None) {
        Err(Error::Value { arg, value, .. }) => assert_eq!((arg.as_str(), value.as_str()), ("block_table[0][1]", "4")),
        other => panic!("{other:?}"),
    }
    assert!(snapshot(&outp).iter().all(|&x| x == 3.0));
    assert!(snapshot(&out).iter().all(|&x| x == 3.0));
    Ok(())
}

#[test]
fn reshape_and_cache_writes_by_slot_skips_minus_one_and_checks_first() -> Res {
    reshape_and_cache_rules(&cc::Device::Cpu)
}

fn reshape_and_cache_rules(dev: &cc::Device) -> Res {
    let kc = cc::Tensor::zeros((3, 2, 1, 4), cc::DType::F32, dev)?;
    let vc = cc::Tensor::zeros((3, 2, 1, 4), cc::DType::F32, dev)?;
    let key = cc::Tensor::arange(1f32, 13.0, dev)?.reshape((3, 1, 4))?;
    let value = (&key * 10.0)?;
    reshape_and_cache(&key, &value, &kc, &vc, &[5, -1, 0])?;
    let k = kc.reshape((6, 4))?.to_vec2::<f32>()?;
    assert_eq!(k[5], [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(k[0], [9.0, 10.0, 11.0, 12.0]);
    assert!(k[1..5].iter().all(|r| r.iter().all(|&x| x == 0.0)));
    assert_eq!(vc.reshape((6, 4))?.to_vec2::<f32>()?[5], [10.0, 20.0, 30.0, 40.0]);
    // A slot out of range: an error, and neither cache changes.
    let before = (snapshot(&kc), snapshot(&vc));
    match reshape_and_cache(&key, &value, &kc, &vc, &[1, 6, 2]) {
        Err(Error::Value { arg, .. }) => assert_eq!(arg, "slot_mapping[1]"),
        other => panic!("{other:?}"),
    }
    assert!(reshape_and_cache(&key, &value, &kc, &kc, &[1, 2, 3]).is_err()); // one storage for both caches
    assert_eq!((snapshot(&kc), snapshot(&vc)), before);
    Ok(())
}

#[test]
fn paged_cache_steps_match_varlen_attention_over_the_whole_history() -> Res {
    for dtype in DType::FLOATS {
        paged_cache_steps(dtype, &cc::Device::Cpu)?;
    }
    Ok(())
}

fn paged_cache_steps(dtype: DType, dev: &cc::Device) -> Res {
    let (hkv, hq, d, bs) = (2, 6, 32, 4);
    let mut rng = Rng(11);
    let mut cache = PagedKvCache::new(1, 24, bs, hkv, d, cdt(dtype), dev)?;
    let ids: Vec<usize> = (0..3).map(|_| cache.add_sequence()).collect();
    // Every sequence's keys and values so far (as the cache holds them), to check against.
    let mut hist: Vec<(Vec<f64>, Vec<f64>)> = vec![(vec![], vec![]); 3];
    for step in 0..6 {
        let news: Vec<usize> = (0..3).map(|s| if step == 0 { 3 + 4 * s } else { rng.below(3) }).collect();
        let batch = cache.step(&ids.iter().copied().zip(news.iter().copied()).collect::<Vec<_>>())?;
        let t: usize = news.iter().sum();
        assert_eq!(batch.num_tokens(), t);
        let mut tensor = |n: usize, amp: f64| -> cc::Result<cc::Tensor> {
            let x: Vec<f32> = rng.vec(t * n * d, amp).iter().map(|&x| x as f32).collect();
            cc::Tensor::from_vec(x, (t, n, d), dev)?.to_dtype(cdt(dtype))
        };
        let (k, v, q) = (tensor(hkv, 1.5)?, tensor(hkv, 1.0)?, tensor(hq, 1.5)?);
        cache.append(0, &k, &v, &batch)?;
        let out = batch.attn().causal(true).forward(&q, cache.k_cache(0), cache.v_cache(0))?;
        assert_eq!(out.dtype(), cdt(dtype));

        // The reference: varlen over each sequence's whole history, queries = the new tokens.
        let row = hkv * d;
        let (kd, vd, qd) = (to_f64(&k)?, to_f64(&v)?, to_f64(&q)?);
        let mut row0 = 0;
        for (s, &n) in news.iter().enumerate() {
            hist[s].0.extend(&kd[row0 * row..(row0 + n) * row]);
            hist[s].1.extend(&vd[row0 * row..(row0 + n) * row]);
            row0 += n;
            assert_eq!(cache.seq_len(ids[s]), Some(hist[s].0.len() / row));
        }
        let kall: Vec<f64> = hist.iter().flat_map(|h| h.0.clone()).collect();
        let vall: Vec<f64> = hist.iter().flat_map(|h| h.1.clone()).collect();
        let tk = kall.len() / row;
        let mut cu_k = vec![0i32];
        for h in &hist {
            cu_k.push(cu_k[cu_k.len() - 1] + (h.0.len() / row) as i32);
        }
        let qr = Tensor::from_f64(&[t, hq, d], dtype, &qd)?;
        let kr = Tensor::from_f64(&[tk, hkv, d], dtype, &kall)?;
        let vr = Tensor::from_f64(&[tk, hkv, d], dtype, &vall)?;
        let call = AttnCall::varlen(&qr, &kr, &vr, &batch.cu_seqlens_q, &cu_k).causal(true);
        let (want, _) = reference::attention_f64(&validate(&call, Device::Host, "reference", None, None)?)?;
        check_close(&format!("paged {dtype} step {step}"), &to_f64(&out)?, &want, tol(dtype), step);
    }
    // Out of blocks: an error, nothing changes; freeing a sequence returns its blocks.
    let free = cache.free_blocks();
    let before = (0..3).map(|s| cache.seq_len(ids[s])).collect::<Vec<_>>();
    assert!(cache.step(&[(ids[0], 1000)]).is_err());
    assert_eq!(cache.free_blocks(), free);
    assert_eq!((0..3).map(|s| cache.seq_len(ids[s])).collect::<Vec<_>>(), before);
    assert!(cache.step(&[(ids[0], 1), (ids[0], 1)]).is_err());
    let held = before[1].unwrap().div_ceil(bs);
    cache.free_sequence(ids[1])?;
    assert_eq!(cache.free_blocks(), free + held);
    assert!(cache.step(&[(ids[1], 1)]).is_err());
    Ok(())
}

#[test]
fn llama_decoder_with_paged_attnkit_attention_matches_candle_attention() -> Res {
    llama_matches(&cc::Device::Cpu)
}

fn llama_matches(dev: &cc::Device) -> Res {
    let cfg = llama::Config {
        vocab: 512,
        hidden: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate: 320,
        rope_theta: 10_000.0,
        eps: 1e-5,
        max_pos: 512,
    };
    let model = llama::Llama::new(cfg, 3, cc::DType::F32, dev)?;
    let prompts = llama::prompts(&[5, 17, 33], cfg.vocab, 1);
    let steps = 6;
    let (ours, theirs) = llama::compare(&model, &prompts, steps, 4, 1)?;
    assert_eq!(ours.logits.len(), steps + 1);
    assert!(ours.tokens.iter().all(|t| t.len() == steps));
    let (diff, mag) = llama::max_diff(&ours.logits, &theirs.logits)?;
    assert!(mag > 0.1, "logits look degenerate: max |logit| {mag}");
    assert!(diff <= 1e-4 * mag.max(1.0), "logits differ by {diff} (max |logit| {mag})");
    Ok(())
}

#[test]
fn threads_sharing_the_inputs_write_their_own_buffers_without_deadlock() -> Res {
    threads_sharing_inputs(&cc::Device::Cpu)
}

fn threads_sharing_inputs(dev: &cc::Device) -> Res {
    // Two threads read the same k and v (candle read locks) and write their own outputs and lse
    // (write locks): the lock order of the glue must let both proceed, and each result must be
    // what a lone call gives.
    let k = cc::Tensor::randn(0f32, 1.0, (40, 2, 32), dev)?;
    let v = cc::Tensor::randn(0f32, 1.0, (40, 2, 32), dev)?;
    let (cu_q, cu_k) = ([0, 3, 8], [0, 15, 40]);
    let attn = Attn::varlen(&cu_q, &cu_k).causal(true);
    let qs: Vec<cc::Tensor> =
        (0..2).map(|_| cc::Tensor::randn(0f32, 1.0, (8, 4, 32), dev)).collect::<cc::Result<_>>()?;
    let want: Vec<(Vec<f64>, Vec<f64>)> = qs
        .iter()
        .map(|q| -> Res<(Vec<f64>, Vec<f64>)> {
            let (o, l) = attn.forward_lse(q, &k, &v)?;
            Ok((to_f64(&o)?, to_f64(&l)?))
        })
        .collect::<Res<_>>()?;
    std::thread::scope(|s| -> Res {
        let handles: Vec<_> = qs
            .iter()
            .zip(&want)
            .map(|(q, want)| {
                let (k, v) = (&k, &v);
                s.spawn(move || -> std::result::Result<(), String> {
                    let out = cc::Tensor::zeros((8, 4, 32), cc::DType::F32, dev).map_err(|e| e.to_string())?;
                    let lse = cc::Tensor::zeros((4, 8), cc::DType::F32, dev).map_err(|e| e.to_string())?;
                    for _ in 0..200 {
                        attn.forward_into(q, k, v, &out, Some(&lse)).map_err(|e| e.to_string())?;
                    }
                    let got = (to_f64(&out).map_err(|e| e.to_string())?, to_f64(&lse).map_err(|e| e.to_string())?);
                    if &got != want {
                        return Err("a threaded result differs from the lone call".into());
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "thread panicked")??;
        }
        Ok(())
    })?;
    Ok(())
}

#[test]
fn llama_decoder_in_f16_and_bf16_is_within_twice_candles_own_error() -> Res {
    llama_low_precision(&cc::Device::Cpu)
}

fn llama_low_precision(dev: &cc::Device) -> Res {
    let cfg = llama::Config {
        vocab: 256,
        hidden: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        intermediate: 320,
        rope_theta: 10_000.0,
        eps: 1e-5,
        max_pos: 256,
    };
    let model = llama::Llama::new(cfg, 5, cc::DType::F32, dev)?;
    let prompts = llama::prompts(&[7, 21], cfg.vocab, 2);
    for dtype in [cc::DType::F16, cc::DType::BF16] {
        let lp = llama::Llama::new(cfg, 5, dtype, dev)?;
        let (ours, theirs) = llama::low_precision_errors(&model, &lp, &prompts, 4, 4)?;
        assert!(theirs > 0.0, "{dtype:?}: candle's low-precision run equals f32: the check would be empty");
        assert!(ours <= 2.0 * theirs, "{dtype:?}: attnkit error {ours} > 2 x candle's {theirs}");
    }
    Ok(())
}

/// The same checks on CUDA tensors (feature `candle-cuda`): candle's device memory through the
/// `cuda` backend on candle's stream. Without a GPU these fail unless `ATTNKIT_SKIP` names cuda,
/// and then they say so loudly.
#[cfg(feature = "candle-cuda")]
mod common;

#[cfg(feature = "candle-cuda")]
mod on_cuda {
    use super::*;

    fn dev() -> Option<cc::Device> {
        if common::skipped("cuda") {
            eprintln!("!!! SKIPPED: candle CUDA test, ATTNKIT_SKIP names cuda (no GPU here); this is not a pass");
            return None;
        }
        Some(cc::Device::new_cuda(0).expect("no CUDA device, and ATTNKIT_SKIP does not name cuda"))
    }

    macro_rules! on_cuda {
        ($($name:ident => $body:expr;)*) => {$(
            #[test]
            fn $name() -> Res {
                let Some(dev) = dev() else { return Ok(()) };
                $body(&dev)
            }
        )*};
    }

    on_cuda! {
        cuda_random_cases_match_the_reference_in_every_layout_and_dtype => random_cases;
        cuda_an_output_aliasing_an_input_is_rejected => aliasing;
        cuda_non_contiguous_outputs_are_errors_and_inputs_are_made_contiguous => non_contiguous;
        cuda_bad_inputs_get_typed_errors_and_leave_the_buffer_untouched => bad_inputs;
        cuda_reshape_and_cache_writes_by_slot => reshape_and_cache_rules;
        cuda_llama_decoder_matches_candle_attention => llama_matches;
        cuda_llama_decoder_in_f16_and_bf16_within_twice_candles_error => llama_low_precision;
        cuda_inputs_on_two_devices_are_a_typed_error => two_devices;
        cuda_threads_sharing_the_inputs_write_their_own_buffers => threads_sharing_inputs;
    }

    #[test]
    fn cuda_paged_cache_steps_match_varlen_attention() -> Res {
        let Some(dev) = dev() else { return Ok(()) };
        for dtype in DType::FLOATS {
            paged_cache_steps(dtype, &dev)?;
        }
        Ok(())
    }

    /// CUDA results equal the CPU backend's within the contract (the same call on the same data).
    #[test]
    fn cuda_agrees_with_cpu_on_the_same_candle_call() -> Res {
        let Some(dev) = dev() else { return Ok(()) };
        for seed in 100..130u64 {
            let case = Case::random(seed);
            let attn = case.attn();
            let [q, k, v] = case.inputs(Mem::Contiguous, &cc::Device::Cpu)?;
            let [qc, kc, vc] = case.inputs(Mem::Contiguous, &dev)?;
            let (o1, l1) = attn.forward_lse(&q, &k, &v)?;
            let (o2, l2) = attn.forward_lse(&qc, &kc, &vc)?;
            let (a, b) = tol(case.dtype);
            check_close(
                &format!("cuda vs cpu out {}", case.kind),
                &to_f64(&o2)?,
                &to_f64(&o1)?,
                (2.0 * a, 2.0 * b),
                seed,
            );
            check_close(&format!("cuda vs cpu lse {}", case.kind), &to_f64(&l2)?, &to_f64(&l1)?, (2e-3, 2e-4), seed);
        }
        Ok(())
    }

    fn two_devices(dev: &cc::Device) -> Res {
        let (q, k, v) = small(dev)?;
        let k_cpu = k.to_device(&cc::Device::Cpu)?;
        let out = cc::Tensor::full(3f32, (2, 5, 4, 16), dev)?;
        let attn = Attn::dense();
        assert_value_err(attn.forward_into(&q, &k_cpu, &v, &out, None), "k", "device");
        assert!(matches!(attn.forward(&q, &k_cpu, &v), Err(Error::Value { arg, .. }) if arg == "k"));
        let out_cpu = out.to_device(&cc::Device::Cpu)?;
        assert_value_err(attn.forward_into(&q, &k, &v, &out_cpu, None), "out", "device");
        assert!(snapshot(&out).iter().all(|&x| x == 3.0));
        Ok(())
    }
}
