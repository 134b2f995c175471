//! CPU-only: every `shaders/*.wgsl` parses and validates with naga, as written (with the shared
//! text of `shaders/include/` in place) and specialised for every dtype, a spread of head dims and
//! every key tile the backend may pick. Needs no GPU.

use std::path::Path;

/// The backend's host-side loop unrolling (the same file).
#[path = "../backends/wgpu/unroll.rs"]
#[allow(dead_code)]
mod unroll;

/// The backend's `@include` expansion and `@spec` substitution, repeated here (includes read from
/// shaders/include/) so this test needs no feature, then its loop unrolling.
fn specialize(src: &str, values: &[(&str, usize)]) -> String {
    let mut out = String::new();
    for line in src.lines() {
        if let Some(name) = line.strip_prefix("// @include ") {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/include").join(name.trim());
            out.push_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
            out.push('\n');
            continue;
        }
        match values.iter().find(|(n, _)| line.starts_with(&format!("const {n}: u32 =")) && line.contains("@spec")) {
            Some((n, v)) => out.push_str(&format!("const {n}: u32 = {v}u; // @spec")),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    unroll::unroll(&out).unwrap_or_else(|e| panic!("unroll: {e}"))
}

fn validate(name: &str, src: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| format!("{name}: parse: {}", e.emit_to_string(src)))?;
    // The coop kernel branches around cooperative operations on values uniform in a subgroup,
    // which naga's uniformity analysis (workgroup uniformity only) cannot see; the backend
    // validates it without that analysis too (backends/wgpu/spirv.rs).
    let mut flags = naga::valid::ValidationFlags::all();
    if name.contains("_coop") {
        flags -= naga::valid::ValidationFlags::CONTROL_FLOW_UNIFORMITY;
    }
    let mut v = naga::valid::Validator::new(flags, naga::valid::Capabilities::all());
    v.validate(&module).map_err(|e| format!("{name}: validate: {}", e.emit_to_string(src)))?;
    Ok(())
}

fn shaders() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut v: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("shaders/ exists")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn every_shader_validates_as_written() {
    let all = shaders();
    assert!(
        all.len() >= 2,
        "expected the flash and combine shaders, found {:?}",
        all.iter().map(|s| &s.0).collect::<Vec<_>>()
    );
    // As written, with the shared text of shaders/include/ in place of the `@include` lines.
    let errors: Vec<String> = all.iter().filter_map(|(n, s)| validate(n, &specialize(s, &[])).err()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn every_specialisation_validates() {
    let mut errors = Vec::new();
    for (name, src) in shaders() {
        if name.contains("_coop") {
            // f16 only; head dims that are multiples of the key tile; (subgroups, key tile).
            for d in [32, 64, 96, 128] {
                for (nw, bk) in [(4, 32), (2, 32), (4, 64), (2, 16)] {
                    if d % bk != 0 || bk < 8 * nw {
                        continue;
                    }
                    let s = specialize(&src, &[("D", d), ("NW", nw), ("BK", bk)]);
                    if let Err(e) = validate(&format!("{name} (D {d}, NW {nw}, BK {bk})"), &s) {
                        errors.push(e);
                    }
                    // The diagnosis stages (ATTNKIT_WGPU_COOP_DEBUG) on one tile.
                    if (d, nw, bk) == (64, 4, 32) {
                        for stage in 2..=7 {
                            let s = specialize(&src, &[("D", d), ("NW", nw), ("BK", bk), ("DEBUG", stage)]);
                            if let Err(e) = validate(&format!("{name} (debug stage {stage})"), &s) {
                                errors.push(e);
                            }
                        }
                    }
                }
            }
            continue;
        }
        if name.contains("_packed") {
            // f16 and bf16 only, head dims up to 128, the tiles the backend may pick.
            for dt in 1..3 {
                for d in [4, 8, 12, 20, 64, 96, 128] {
                    for (bq, bk) in [(64, 64), (32, 64), (16, 64), (32, 32), (16, 32)] {
                        // Q^T and P^T 16-bit in the 64-row tile (the backend's `packed_half`).
                        let half = usize::from(bq == 64);
                        let s = specialize(&src, &[("D", d), ("DT", dt), ("BQ", bq), ("BK", bk), ("HALF", half)]);
                        if let Err(e) = validate(&format!("{name} (DT {dt}, D {d}, BQ {bq}, BK {bk})"), &s) {
                            errors.push(e);
                        }
                    }
                }
            }
            continue;
        }
        for dt in 0..3 {
            for d in [4, 8, 12, 20, 64, 128, 132, 256] {
                // (rows, keys, key slots) the backend may pick for this file.
                let nks = (128 / (d / 4)).clamp(1, 8);
                let rows_tiles: Vec<(usize, usize, usize)> = [1, 2, 4, 8, 16]
                    .into_iter()
                    .flat_map(|bq| [16, 8, 4, 1].into_iter().map(move |kps| (bq, kps * nks, nks)))
                    .collect();
                let tiles: &[(usize, usize, usize)] = if name.contains("_mt") {
                    &[(32, 32, 0), (16, 32, 0), (32, 16, 0), (16, 16, 0)]
                } else {
                    &rows_tiles
                };
                for &(bq, bk, nks) in tiles {
                    let s = specialize(&src, &[("D", d), ("DT", dt), ("BQ", bq), ("BK", bk), ("NKS", nks)]);
                    if let Err(e) = validate(&format!("{name} (DT {dt}, D {d}, BQ {bq}, BK {bk}, NKS {nks})"), &s) {
                        errors.push(e);
                    }
                }
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn specialisation_replaces_only_marked_lines() {
    let src = "const D: u32 = 128u; // @spec head dim\nconst D4: u32 = D / 4u;\nconst DT: u32 = 0u;\n";
    let s = specialize(src, &[("D", 64), ("DT", 2)]);
    assert!(s.contains("const D: u32 = 64u;"));
    assert!(s.contains("const D4: u32 = D / 4u;"));
    assert!(s.contains("const DT: u32 = 0u;"), "an unmarked line was replaced");
}

#[test]
fn every_include_is_used_and_leaves_no_directive() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders/include");
    let all = shaders();
    for e in std::fs::read_dir(&dir).expect("shaders/include exists") {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        let line = format!("// @include {name}");
        assert!(all.iter().any(|(_, s)| s.lines().any(|l| l == line)), "no shader includes {name}");
    }
    for (n, s) in &all {
        let left = specialize(s, &[]).lines().any(|l| l.starts_with("// @include "));
        assert!(!left, "{n}: an include left after expansion");
    }
}
