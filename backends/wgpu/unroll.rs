//! Loops unrolled on the host, before a shader goes to naga.
//!
//! A loop marked `// @unroll` (on the line before it) must read
//! `for (var X = 0u; X < N; X++) {`, with `N` a `u32` literal or a constant of the module, and
//! end at its own `}` line; it becomes N blocks, the k-th `{ let X = ku; <body> }`. Marked loops
//! may nest. So a per-thread array indexed by X is indexed by constants only, which a driver's
//! compiler keeps in registers whether or not it would have unrolled the loop itself: the NVIDIA
//! Vulkan driver left three such arrays of the micro-tile kernel in local memory (768 bytes a
//! thread, read by its own statistics, `wgsl_bench kernel_statistics`).
//!
//! Unexpanded, a marked loop is an ordinary WGSL loop with the same meaning.

use std::collections::HashMap;

/// The shader `src` with every marked loop unrolled, or what is wrong with a marked loop.
pub(crate) fn unroll(src: &str) -> Result<String, String> {
    if !src.contains("// @unroll") {
        return Ok(src.to_string());
    }
    let consts = constants(src)?;
    let lines: Vec<&str> = src.lines().collect();
    let mut out = String::with_capacity(src.len() * 4);
    expand(&lines, &consts, &mut out)?;
    Ok(out)
}

/// The value of every `u32` (or abstract-integer) constant of the module, by name.
fn constants(src: &str) -> Result<HashMap<String, u32>, String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let mut out = HashMap::new();
    for (_, c) in module.constants.iter() {
        let value = match module.global_expressions[c.init] {
            naga::Expression::Literal(naga::Literal::U32(v)) => Some(v),
            naga::Expression::Literal(naga::Literal::AbstractInt(v)) => u32::try_from(v).ok(),
            _ => None,
        };
        if let (Some(name), Some(v)) = (&c.name, value) {
            out.insert(name.clone(), v);
        }
    }
    Ok(out)
}

fn expand(lines: &[&str], consts: &HashMap<String, u32>, out: &mut String) -> Result<(), String> {
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != "// @unroll" {
            out.push_str(lines[i]);
            out.push('\n');
            i += 1;
            continue;
        }
        let head = lines.get(i + 1).ok_or("`// @unroll` on the last line")?;
        let (var, bound) = parse_head(head).ok_or_else(|| format!("`// @unroll` before `{}`", head.trim()))?;
        let n = match bound.strip_suffix('u').and_then(|b| b.parse::<u32>().ok()) {
            Some(v) => v,
            None => *consts.get(bound).ok_or_else(|| format!("unroll bound `{bound}` is not a u32 constant"))?,
        };
        // The loop's closing line: where the braces opened from its head are all closed.
        let mut depth = 0i64;
        let mut end = None;
        for (j, line) in lines.iter().enumerate().skip(i + 1) {
            depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
            if depth == 0 {
                end = Some(j);
                break;
            }
        }
        let end = end.ok_or_else(|| format!("unclosed loop `{}`", head.trim()))?;
        if lines[end].trim() != "}" {
            return Err(format!("loop `{}` must end on a line of its own `}}`", head.trim()));
        }
        let indent = &head[..head.len() - head.trim_start().len()];
        let mut body = String::new();
        expand(&lines[i + 2..end], consts, &mut body)?;
        for k in 0..n {
            out.push_str(&format!("{indent}{{ let {var} = {k}u;\n"));
            out.push_str(&body);
            out.push_str(indent);
            out.push_str("}\n");
        }
        i = end + 1;
    }
    Ok(())
}

/// `for (var X = 0u; X < N; X++) {` as (X, N).
fn parse_head(line: &str) -> Option<(&str, &str)> {
    let rest = line.trim().strip_prefix("for (var ")?;
    let (var, rest) = rest.split_once(" = 0u; ")?;
    let rest = rest.strip_prefix(var)?.strip_prefix(" < ")?;
    let (bound, rest) = rest.split_once("; ")?;
    (rest == format!("{var}++) {{")).then_some((var, bound))
}

#[cfg(test)]
mod tests {
    use super::unroll;

    #[test]
    fn unrolls_nested_marked_loops_with_constant_bounds() {
        let src = "const N: u32 = 2u * 1u;\nfn f() {\n    var a: array<u32, 4>;\n    // @unroll\n    for (var i = 0u; i < N; i++) {\n        // @unroll\n        for (var j = 0u; j < 2u; j++) {\n            a[i * 2u + j] = i;\n        }\n    }\n    for (var k = 0u; k < N; k++) {\n        a[k] = 0u;\n    }\n}\n";
        let out = unroll(src).unwrap();
        assert_eq!(out.matches("let i = ").count(), 2, "{out}");
        assert_eq!(out.matches("let j = 1u;").count(), 2, "{out}");
        assert_eq!(out.matches("a[i * 2u + j] = i;").count(), 4, "{out}");
        assert!(out.contains("for (var k = 0u; k < N; k++) {"), "an unmarked loop stays: {out}");
        assert!(!out.contains("@unroll"), "{out}");
        naga::front::wgsl::parse_str(&out).unwrap();
    }

    #[test]
    fn a_marked_loop_of_another_form_is_an_error() {
        let src = "fn f() {\n    // @unroll\n    for (var i = 1u; i < 2u; i++) {\n    }\n}\n";
        assert!(unroll(src).is_err());
        let src = "const X: f32 = 1.0;\nfn f() {\n    // @unroll\n    for (var i = 0u; i < X; i++) {\n    }\n}\n";
        assert!(unroll(src).is_err());
    }
}
