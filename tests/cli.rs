//! The `attnkit` command on case files this test writes itself, straight from the SPEC's case-file
//! section (with the safetensors crate, not attnkit's own writer), checked against an f64
//! implementation of the SPEC's formula written here independently of `attnkit::reference`.
//! Malformed files must give a clear error and a non-zero exit, never a panic.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// A tensor to write: name, dtype, shape, little-endian bytes.
type Named = (String, Dtype, Vec<usize>, Vec<u8>);

const BIN: &str = env!("CARGO_BIN_EXE_attnkit");

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("attnkit-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn attnkit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("the attnkit binary runs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Deterministic values in [-1, 1).
fn vals(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect()
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Ty {
    F32,
    F16,
    BF16,
}

impl Ty {
    fn st(self) -> Dtype {
        match self {
            Ty::F32 => Dtype::F32,
            Ty::F16 => Dtype::F16,
            Ty::BF16 => Dtype::BF16,
        }
    }
    /// Round to the dtype (the file holds the rounded values; the expected result uses them too).
    fn round(self, x: f64) -> f64 {
        match self {
            Ty::F32 => x as f32 as f64,
            Ty::F16 => f16::from_f64(x).to_f64(),
            Ty::BF16 => bf16::from_f64(x).to_f64(),
        }
    }
    fn bytes(self, v: &[f64]) -> Vec<u8> {
        match self {
            Ty::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
            Ty::F16 => v.iter().flat_map(|&x| f16::from_f64(x).to_le_bytes()).collect(),
            Ty::BF16 => v.iter().flat_map(|&x| bf16::from_f64(x).to_le_bytes()).collect(),
        }
    }
    /// SPEC tolerances (atol, rtol).
    fn tol(self) -> (f64, f64) {
        match self {
            Ty::F32 => (2e-5, 1e-4),
            Ty::F16 => (2e-3, 5e-3),
            Ty::BF16 => (1.6e-2, 2e-2),
        }
    }
}

fn from_bytes(dt: Dtype, b: &[u8]) -> Vec<f64> {
    match dt {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64()).collect(),
        other => panic!("unexpected dtype {other:?} in a result file"),
    }
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A case as the SPEC describes it, plus what is needed to compute its expected result.
struct Spec {
    layout: &'static str,
    ty: Ty,
    hq: usize,
    hkv: usize,
    d: usize,
    /// (q_len, k_len) per sequence.
    lens: Vec<(usize, usize)>,
    causal: bool,
    window_left: Option<usize>,
    window_right: Option<usize>,
    softcap: Option<f64>,
    scale: Option<f64>,
    alibi: Option<Vec<f32>>,
    block_size: usize,
}

/// What was written: tensors (name, dtype, shape, bytes), metadata, and per-token rows of q/k/v in
/// f64 for the expected result.
struct Written {
    tensors: Vec<Named>,
    meta: HashMap<String, String>,
    /// q rows `[token][h][d]` per sequence; k and v rows `[token][hkv][d]` per sequence.
    q: Vec<Vec<f64>>,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

impl Spec {
    fn base(layout: &'static str, ty: Ty, hq: usize, hkv: usize, d: usize, lens: Vec<(usize, usize)>) -> Spec {
        Spec {
            layout,
            ty,
            hq,
            hkv,
            d,
            lens,
            causal: false,
            window_left: None,
            window_right: None,
            softcap: None,
            scale: None,
            alibi: None,
            block_size: 4,
        }
    }

    fn write(&self, seed: u64) -> Written {
        let (hq, hkv, d, ty) = (self.hq, self.hkv, self.d, self.ty);
        let b = self.lens.len();
        let mut q = Vec::new();
        let mut k = Vec::new();
        let mut v = Vec::new();
        for (s, &(lq, lk)) in self.lens.iter().enumerate() {
            let r = |x: Vec<f64>, amp: f64| x.into_iter().map(|y| ty.round(y * amp)).collect::<Vec<_>>();
            q.push(r(vals(seed + 10 * s as u64, lq * hq * d), 2.0));
            k.push(r(vals(seed + 10 * s as u64 + 1, lk * hkv * d), 2.0));
            v.push(r(vals(seed + 10 * s as u64 + 2, lk * hkv * d), 1.0));
        }
        let mut t = Vec::new();
        let cat = |x: &[Vec<f64>]| x.concat();
        let tq: usize = self.lens.iter().map(|l| l.0).sum();
        let tk: usize = self.lens.iter().map(|l| l.1).sum();
        let mut cu_q = vec![0i32];
        let mut cu_k = vec![0i32];
        for &(lq, lk) in &self.lens {
            cu_q.push(cu_q.last().unwrap() + lq as i32);
            cu_k.push(cu_k.last().unwrap() + lk as i32);
        }
        match self.layout {
            "dense" => {
                let (sq, sk) = self.lens[0];
                t.push(("q".into(), ty.st(), vec![b, sq, hq, d], ty.bytes(&cat(&q))));
                t.push(("k".into(), ty.st(), vec![b, sk, hkv, d], ty.bytes(&cat(&k))));
                t.push(("v".into(), ty.st(), vec![b, sk, hkv, d], ty.bytes(&cat(&v))));
            }
            "varlen" => {
                t.push(("q".into(), ty.st(), vec![tq, hq, d], ty.bytes(&cat(&q))));
                t.push(("k".into(), ty.st(), vec![tk, hkv, d], ty.bytes(&cat(&k))));
                t.push(("v".into(), ty.st(), vec![tk, hkv, d], ty.bytes(&cat(&v))));
                t.push(("cu_seqlens_q".into(), Dtype::I32, vec![b + 1], i32_bytes(&cu_q)));
                t.push(("cu_seqlens_k".into(), Dtype::I32, vec![b + 1], i32_bytes(&cu_k)));
            }
            "paged" => {
                let bs = self.block_size;
                let need: Vec<usize> = self.lens.iter().map(|l| l.1.div_ceil(bs)).collect();
                let max_blocks = need.iter().max().unwrap() + 2;
                let num_blocks = need.iter().sum::<usize>() + 3;
                let row = hkv * d;
                // Blocks handed out from the top down; NaN wherever no token lives.
                let mut kc = vec![f64::NAN; num_blocks * bs * row];
                let mut vc = vec![f64::NAN; num_blocks * bs * row];
                let mut table = vec![-1i32; b * max_blocks];
                let mut next = num_blocks;
                for (s, &(_, lk)) in self.lens.iter().enumerate() {
                    for j in 0..need[s] {
                        next -= 1;
                        table[s * max_blocks + j] = next as i32;
                    }
                    for tok in 0..lk {
                        let slot = table[s * max_blocks + tok / bs] as usize * bs + tok % bs;
                        kc[slot * row..(slot + 1) * row].copy_from_slice(&k[s][tok * row..(tok + 1) * row]);
                        vc[slot * row..(slot + 1) * row].copy_from_slice(&v[s][tok * row..(tok + 1) * row]);
                    }
                    // An unused entry pointing at a real block must not matter either.
                    table[s * max_blocks + need[s]] = 0;
                }
                t.push(("q".into(), ty.st(), vec![tq, hq, d], ty.bytes(&cat(&q))));
                t.push(("k_cache".into(), ty.st(), vec![num_blocks, bs, hkv, d], ty.bytes(&kc)));
                t.push(("v_cache".into(), ty.st(), vec![num_blocks, bs, hkv, d], ty.bytes(&vc)));
                t.push(("cu_seqlens_q".into(), Dtype::I32, vec![b + 1], i32_bytes(&cu_q)));
                t.push(("block_table".into(), Dtype::I32, vec![b, max_blocks], i32_bytes(&table)));
                let sl: Vec<i32> = self.lens.iter().map(|l| l.1 as i32).collect();
                t.push(("seq_lens".into(), Dtype::I32, vec![b], i32_bytes(&sl)));
            }
            other => panic!("no layout {other}"),
        }
        if let Some(a) = &self.alibi {
            t.push((
                "alibi_slopes".into(),
                Dtype::F32,
                vec![a.len()],
                a.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ));
        }
        let mut meta = HashMap::new();
        meta.insert("layout".to_string(), self.layout.to_string());
        meta.insert("causal".to_string(), self.causal.to_string());
        if let Some(w) = self.window_left {
            meta.insert("window_left".into(), w.to_string());
        }
        if let Some(w) = self.window_right {
            meta.insert("window_right".into(), w.to_string());
        }
        if let Some(x) = self.softcap {
            meta.insert("softcap".into(), x.to_string());
        }
        if let Some(x) = self.scale {
            meta.insert("scale".into(), x.to_string());
        }
        Written { tensors: t, meta, q, k, v }
    }

    /// The SPEC's function in f64: out in token order `[T, Hq, D]`, lse in `[Hq, T]` order per
    /// sequence (the caller lays it out).
    fn expected(&self, w: &Written) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let (hq, hkv, d) = (self.hq, self.hkv, self.d);
        let scale = self.scale.unwrap_or(1.0 / (d as f64).sqrt());
        let mut outs = Vec::new();
        let mut lses = Vec::new();
        for (s, &(sq, sk)) in self.lens.iter().enumerate() {
            let mut out = vec![0.0; sq * hq * d];
            let mut lse = vec![f64::NEG_INFINITY; hq * sq];
            for h in 0..hq {
                let kh = h / (hq / hkv);
                for i in 0..sq {
                    let ip = i as i64 + sk as i64 - sq as i64;
                    let mut sc: Vec<(usize, f64)> = Vec::new();
                    for j in 0..sk {
                        let jj = j as i64;
                        let vis = (!self.causal || jj <= ip)
                            && self.window_left.is_none_or(|wl| jj >= ip - wl as i64)
                            && self.window_right.is_none_or(|wr| jj <= ip + wr as i64);
                        if !vis {
                            continue;
                        }
                        let qi = &w.q[s][(i * hq + h) * d..][..d];
                        let kj = &w.k[s][(j * hkv + kh) * d..][..d];
                        let mut x = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                        if let Some(c) = self.softcap {
                            x = c * (x / c).tanh();
                        }
                        if let Some(a) = &self.alibi {
                            x -= a[h] as f64 * (ip - jj).abs() as f64;
                        }
                        sc.push((j, x));
                    }
                    if sc.is_empty() {
                        continue;
                    }
                    let m = sc.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
                    let l = m + sc.iter().map(|p| (p.1 - m).exp()).sum::<f64>().ln();
                    lse[h * sq + i] = l;
                    for &(j, x) in &sc {
                        let p = (x - l).exp();
                        for e in 0..d {
                            out[(i * hq + h) * d + e] += p * w.v[s][(j * hkv + kh) * d + e];
                        }
                    }
                }
            }
            outs.push(out);
            lses.push(lse);
        }
        (outs, lses)
    }
}

fn write_file(path: &Path, tensors: &[Named], meta: Option<HashMap<String, String>>) {
    let views: Vec<(&str, TensorView<'_>)> =
        tensors.iter().map(|(n, dt, s, b)| (n.as_str(), TensorView::new(*dt, s.clone(), b).unwrap())).collect();
    std::fs::write(path, safetensors::serialize(views, meta).unwrap()).unwrap();
}

fn close(what: &str, got: f64, want: f64, atol: f64, rtol: f64) {
    if want.is_infinite() {
        assert_eq!(got, want, "{what}");
    } else {
        assert!((got - want).abs() <= atol + rtol * want.abs(), "{what}: got {got}, want {want}");
    }
}

/// Write the case, run `attnkit run` on `backend`, compare with the expected result.
fn run_and_compare(name: &str, spec: &Spec, backend: &str) {
    // A folder per case and backend: the tests of several backends run the same cases at once in
    // this process, and a shared case file could be read while another test rewrites it.
    let dir = tmpdir(&format!("{name}-{backend}"));
    let case = dir.join(format!("{name}.safetensors"));
    let res = dir.join(format!("{name}.{backend}.out.safetensors"));
    let w = spec.write(7 + name.len() as u64);
    write_file(&case, &w.tensors, Some(w.meta.clone()));
    let o = attnkit(&["run", "--backend", backend, case.to_str().unwrap(), "-o", res.to_str().unwrap()]);
    assert!(o.status.success(), "{name} on {backend}: {}", text(&o));
    let bytes = std::fs::read(&res).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let out = st.tensor("out").unwrap();
    let lse = st.tensor("lse").unwrap();
    assert_eq!(out.dtype(), spec.ty.st(), "out has the dtype of q");
    assert_eq!(lse.dtype(), Dtype::F32, "lse is F32");
    let (hq, d) = (spec.hq, spec.d);
    let tq: usize = spec.lens.iter().map(|l| l.0).sum();
    let dense = spec.layout == "dense";
    if dense {
        assert_eq!(out.shape(), &[spec.lens.len(), spec.lens[0].0, hq, d]);
        assert_eq!(lse.shape(), &[spec.lens.len(), hq, spec.lens[0].0]);
    } else {
        assert_eq!(out.shape(), &[tq, hq, d]);
        assert_eq!(lse.shape(), &[hq, tq]);
    }
    let got_out = from_bytes(out.dtype(), out.data());
    let got_lse = from_bytes(Dtype::F32, lse.data());
    let (want_out, want_lse) = spec.expected(&w);
    let (atol, rtol) = spec.ty.tol();
    let mut q0 = 0;
    for (s, &(sq, _)) in spec.lens.iter().enumerate() {
        for (x, &want) in want_out[s].iter().enumerate() {
            close(&format!("{name}/{backend}: out seq {s} elem {x}"), got_out[q0 * hq * d + x], want, atol, rtol);
        }
        for h in 0..hq {
            for i in 0..sq {
                // lse is [B, Hq, Sq] dense and [Hq, Tq] otherwise.
                let idx = if dense { (s * hq + h) * sq + i } else { h * tq + q0 + i };
                let what = format!("{name}/{backend}: lse seq {s} head {h} query {i}");
                close(&what, got_lse[idx], want_lse[s][h * sq + i], 1e-3, 1e-4);
            }
        }
        q0 += sq;
    }
    assert!(got_out.iter().all(|x| x.is_finite()), "{name}/{backend}: non-finite output");
}

fn cases() -> Vec<(&'static str, Spec)> {
    let mut v = Vec::new();
    let mut s = Spec::base("dense", Ty::F32, 4, 2, 16, vec![(5, 9), (5, 9)]);
    s.causal = true;
    v.push(("dense_gqa_causal_sq_lt_sk", s));
    let mut s = Spec::base("dense", Ty::BF16, 6, 1, 32, vec![(12, 12)]);
    s.window_left = Some(3);
    s.window_right = Some(1);
    s.softcap = Some(7.5);
    s.scale = Some(0.2);
    v.push(("dense_mqa_window_softcap_scale", s));
    let mut s = Spec::base("dense", Ty::F16, 2, 2, 8, vec![(7, 3)]);
    s.causal = true; // the first 4 queries see nothing: 0 and -inf
    v.push(("dense_fully_masked_rows", s));
    let mut s = Spec::base("varlen", Ty::F16, 4, 2, 24, vec![(3, 7), (0, 4), (6, 6), (2, 0)]);
    s.causal = true;
    s.alibi = Some(vec![0.5, 0.25, 0.125, 0.0625]);
    v.push(("varlen_causal_alibi_empty_seqs", s));
    let mut s = Spec::base("paged", Ty::F32, 4, 1, 16, vec![(1, 10), (3, 5), (2, 2)]);
    s.causal = true;
    s.window_left = Some(4);
    s.block_size = 4;
    v.push(("paged_nan_slots_window", s));
    let mut s = Spec::base("paged", Ty::BF16, 2, 2, 64, vec![(1, 33), (1, 1)]);
    s.softcap = Some(20.0);
    s.alibi = Some(vec![0.3, 0.1]);
    s.block_size = 16;
    v.push(("paged_decode_softcap_alibi", s));
    v
}

#[test]
fn run_matches_the_spec_on_reference() {
    for (name, spec) in cases() {
        run_and_compare(name, &spec, "reference");
    }
}

#[cfg(feature = "cpu")]
#[test]
fn run_matches_the_spec_on_cpu() {
    for (name, spec) in cases() {
        run_and_compare(name, &spec, "cpu");
    }
}

#[test]
fn run_on_best_picks_a_backend_and_matches() {
    let (name, spec) = cases().remove(3);
    run_and_compare(name, &spec, "best");
}

/// A malformed run must exit non-zero with an error naming `words`, never panic, write nothing.
fn rejects(name: &str, tensors: &[Named], meta: Option<HashMap<String, String>>, words: &[&str]) {
    let dir = tmpdir("bad");
    let case = dir.join(format!("{name}.safetensors"));
    write_file(&case, tensors, meta);
    rejects_path(name, &case, words);
}

fn rejects_path(name: &str, case: &Path, words: &[&str]) {
    let res = case.with_extension("out.safetensors");
    let _ = std::fs::remove_file(&res);
    for backend in ["reference", "best"] {
        let o = attnkit(&["run", "--backend", backend, case.to_str().unwrap(), "-o", res.to_str().unwrap()]);
        let t = text(&o);
        assert!(!o.status.success(), "{name}: a malformed file was accepted: {t}");
        assert!(!t.contains("panicked"), "{name}: panicked: {t}");
        assert!(t.contains("error"), "{name}: no error message: {t}");
        for w in words {
            assert!(t.contains(w), "{name}: the error does not mention {w:?}: {t}");
        }
        assert!(!res.exists(), "{name}: a result file was written for a bad case");
    }
}

fn good() -> (Vec<Named>, HashMap<String, String>) {
    let mut s = Spec::base("varlen", Ty::F32, 2, 1, 8, vec![(2, 3), (1, 4)]);
    s.causal = true;
    let w = s.write(3);
    (w.tensors, w.meta)
}

fn replace(t: &mut Vec<Named>, name: &str, dt: Dtype, shape: Vec<usize>, bytes: Vec<u8>) {
    t.retain(|x| x.0 != name);
    t.push((name.to_string(), dt, shape, bytes));
}

#[test]
fn malformed_case_files_give_clear_errors() {
    // The good file runs.
    let (t, m) = good();
    let dir = tmpdir("good");
    write_file(&dir.join("g.safetensors"), &t, Some(m.clone()));
    let o = attnkit(&[
        "run",
        "--backend",
        "reference",
        dir.join("g.safetensors").to_str().unwrap(),
        "-o",
        dir.join("g.out").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));

    let (mut t, m) = good();
    t.retain(|x| x.0 != "k");
    rejects("missing_k", &t, Some(m), &["`k`", "missing", "varlen"]);

    let (mut t, m) = good();
    replace(
        &mut t,
        "cu_seqlens_q",
        Dtype::F32,
        vec![3],
        [0f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
    );
    rejects("cu_seqlens_float", &t, Some(m), &["cu_seqlens_q", "F32", "I32"]);

    let (mut t, m) = good();
    replace(&mut t, "cu_seqlens_k", Dtype::I64, vec![3], [0i64, 3, 7].iter().flat_map(|x| x.to_le_bytes()).collect());
    rejects("cu_seqlens_i64", &t, Some(m), &["cu_seqlens_k", "I64"]);

    let (mut t, m) = good();
    replace(&mut t, "q", Dtype::F64, vec![3, 2, 8], vec![0x11; 3 * 2 * 8 * 8]);
    rejects("q_f64", &t, Some(m), &["q", "F64"]);

    for (key, value) in [("layout", "ragged"), ("causal", "yes"), ("window_left", "-1"), ("softcap", "big")] {
        let (t, mut m) = good();
        m.insert(key.into(), value.into());
        rejects(&format!("meta_{key}"), &t, Some(m), &[key, value]);
    }

    let (t, mut m) = good();
    m.remove("layout");
    rejects("no_layout", &t, Some(m), &["layout", "missing"]);

    // Files that read but break the contract: caught by validation, named.
    let (mut t, m) = good();
    replace(&mut t, "cu_seqlens_k", Dtype::I32, vec![3], i32_bytes(&[0, 5, 3]));
    rejects("cu_seqlens_not_monotone", &t, Some(m), &["cu_seqlens_k[2]", "3"]);

    let (mut t, m) = good();
    replace(&mut t, "k", Dtype::F32, vec![7, 3, 8], vec![0; 7 * 3 * 8 * 4]);
    replace(&mut t, "v", Dtype::F32, vec![7, 3, 8], vec![0; 7 * 3 * 8 * 4]);
    rejects("hq_not_multiple_of_hkv", &t, Some(m), &["Hkv", "3"]);

    // Not a safetensors file at all, an empty file, a missing file.
    let dir = tmpdir("junk");
    std::fs::write(dir.join("text.safetensors"), "q,k,v\n1,2,3\n").unwrap();
    rejects_path("text", &dir.join("text.safetensors"), &["not a safetensors file"]);
    std::fs::write(dir.join("empty.safetensors"), b"").unwrap();
    rejects_path("empty", &dir.join("empty.safetensors"), &["not a safetensors file"]);
    rejects_path("absent", &dir.join("absent.safetensors"), &["absent.safetensors", "cannot read"]);
}

#[test]
fn bad_backend_names_and_usage_exit_non_zero() {
    let (t, m) = good();
    let dir = tmpdir("names");
    let case = dir.join("g.safetensors");
    write_file(&case, &t, Some(m));
    let out = dir.join("o.safetensors");
    let o = attnkit(&["run", "--backend", "tpu", case.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unknown backend `tpu`"), "{}", text(&o));
    for (b, feature) in [("wgpu", "wgpu"), ("cuda", "cuda")] {
        if attnkit_lib_has(b) {
            continue;
        }
        let o = attnkit(&["run", "--backend", b, case.to_str().unwrap(), "-o", out.to_str().unwrap()]);
        assert!(!o.status.success());
        assert!(text(&o).contains(&format!("feature `{feature}`")), "{}", text(&o));
    }
    let o = attnkit(&["run", case.to_str().unwrap()]);
    assert!(!o.status.success(), "run without -o must fail");
    let o = attnkit(&["frobnicate"]);
    assert!(!o.status.success());
}

fn attnkit_lib_has(backend: &str) -> bool {
    attnkit::is_compiled(backend)
}

#[test]
fn info_lists_the_backends() {
    let o = attnkit(&["info"]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for b in attnkit::compiled() {
        assert!(t.contains(b), "info does not mention {b}: {t}");
    }
    assert!(t.contains("reference") && t.contains("f32,f16,bf16"), "{t}");
}

#[cfg(feature = "cpu")]
#[test]
fn check_passes_on_this_machine() {
    let o = attnkit(&["check", "--backend", "cpu", "--cases", "25", "--seed", "11"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("check passed") && t.contains("cpu"), "{t}");
}

#[cfg(feature = "cpu")]
#[test]
fn bench_prints_json_for_a_small_shape() {
    let o = attnkit(&[
        "bench",
        "--backend",
        "cpu",
        "--shapes",
        "prefill:1,2,64,16,decode:2,4,2,40,8",
        "--dtype",
        "f16",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
    ]);
    let t = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_str(&t).unwrap_or_else(|e| panic!("not JSON ({e}): {t}"));
    let rows = v["rows"].as_array().unwrap();
    // Prefill twice (causal and not), decode once.
    assert_eq!(rows.len(), 3, "{t}");
    for r in rows {
        assert!(r["median_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["dtype"], "f16");
    }
    assert!(rows.iter().any(|r| r["kind"] == "decode" && r["kv_gbps"].as_f64().unwrap() > 0.0), "{t}");
    assert!(v["cpu_fma_peak_gflops"].as_f64().unwrap() > 0.0, "{t}");
    // A bad shape is a clear error.
    let o = attnkit(&["bench", "--backend", "cpu", "--shapes", "prefill:1,2,x,16"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("`x` is not a number"), "{}", text(&o));
}
