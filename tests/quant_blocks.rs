//! Our block decoders against llama.cpp's gguf-py (`gguf.quants.dequantize`) on random valid
//! blocks: `tests/fixtures/quant_blocks.json`, written by `tools/make_fixtures.py --only quant_blocks`.
//!
//! File layout: `types.{NAME}` = { ggml_type, block_size, type_size, rows, blocks_per_row,
//! elements_per_row, bytes (hex of all rows back to back), values (rows * elements_per_row f32s,
//! row-major) }.

mod common;

use nexttoken::quant::{dequantize_block, dequantize_row, GgmlType};
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct Fixture {
    types: BTreeMap<String, Case>,
}

#[derive(Deserialize)]
struct Case {
    ggml_type: u32,
    block_size: usize,
    type_size: usize,
    rows: usize,
    blocks_per_row: usize,
    elements_per_row: usize,
    bytes: String,
    values: Vec<f64>,
}

fn load() -> Fixture {
    let path = common::fixtures().join("quant_blocks.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate with `python3 tools/make_fixtures.py --only quant_blocks`)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// Types whose decode is a single rounding (or none): these must match bit for bit. The K-quants
/// take two products and a difference, where the operation order decides the last bit; we follow
/// ggml's order, so they should match exactly too, but they are only required to within 1e-6
/// relative.
fn must_be_bit_exact(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

fn close(got: f32, want: f32) -> bool {
    got.to_bits() == want.to_bits()
        || (got - want).abs() <= 1e-6 * want.abs().max(f32::MIN_POSITIVE)
}

#[test]
fn fixture_covers_every_type() {
    let f = load();
    for name in ["Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"] {
        assert!(f.types.contains_key(name), "quant_blocks.json has no {name}");
    }
}

#[test]
fn dequantize_row_matches_gguf_py() {
    let f = load();
    let mut report = Vec::new();
    for (name, c) in &f.types {
        let ty = GgmlType::from_id(c.ggml_type)
            .unwrap_or_else(|| panic!("{name}: unsupported ggml type {}", c.ggml_type));
        assert_eq!(ty.name(), name, "type id {} is {}", c.ggml_type, ty.name());
        assert_eq!(ty.block_size(), c.block_size, "{name}: block size");
        assert_eq!(ty.block_bytes(), c.type_size, "{name}: block bytes");
        assert_eq!(
            c.elements_per_row,
            c.blocks_per_row * c.block_size,
            "{name}: fixture is inconsistent"
        );
        let bytes = unhex(&c.bytes);
        let row_bytes = ty.row_bytes(c.elements_per_row);
        assert_eq!(row_bytes, c.blocks_per_row * c.type_size, "{name}: row bytes");
        assert_eq!(bytes.len(), c.rows * row_bytes, "{name}: byte count");
        assert_eq!(c.values.len(), c.rows * c.elements_per_row, "{name}: value count");
        // The JSON doubles hold f32 values exactly. serde_json (without its float_roundtrip
        // feature) may parse a double 1 ulp off, e.g. 9.953037915854457e29, but an f32 value is
        // never near an f32 rounding midpoint, so the cast still recovers it exactly.
        let want: Vec<f32> = c.values.iter().map(|&v| v as f32).collect();
        assert!(
            c.values.iter().zip(&want).all(|(&d, &f)| (d - f as f64).abs() <= d.abs() * 1e-15),
            "{name}: values are not f32"
        );

        let mut bit_exact = 0;
        let mut worst_rel = 0f64;
        for r in 0..c.rows {
            let mut got = vec![f32::NAN; c.elements_per_row];
            dequantize_row(ty, &bytes[r * row_bytes..(r + 1) * row_bytes], &mut got);
            let want = &want[r * c.elements_per_row..(r + 1) * c.elements_per_row];
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                let exact = g.to_bits() == w.to_bits();
                bit_exact += exact as usize;
                if !exact {
                    worst_rel =
                        worst_rel.max(((g - w).abs() / w.abs().max(f32::MIN_POSITIVE)) as f64);
                }
                assert!(
                    if must_be_bit_exact(ty) { exact } else { close(g, w) },
                    "{name} row {r} element {i} (block {}, index {} in block): got {g:e} ({:#010x}), gguf-py {w:e} ({:#010x})",
                    i / c.block_size,
                    i % c.block_size,
                    g.to_bits(),
                    w.to_bits()
                );
            }
        }
        report.push(format!(
            "{name}: {bit_exact}/{} bit-exact, worst relative error {worst_rel:e}",
            want.len()
        ));
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn dequantize_block_agrees_with_dequantize_row() {
    // The per-block decoder (used by the matmul and mirrored by the GPU kernels) and the row
    // decoder (which has whole-row fast paths for F32/F16) must agree bit for bit.
    let f = load();
    for (name, c) in &f.types {
        let ty = GgmlType::from_id(c.ggml_type).unwrap();
        let bytes = unhex(&c.bytes);
        let mut row = vec![0f32; c.rows * c.elements_per_row];
        // All rows at once: a row decoder handed several rows decodes them back to back.
        dequantize_row(ty, &bytes, &mut row);
        let mut block = vec![0f32; c.block_size];
        for (b, chunk) in bytes.chunks_exact(c.type_size).enumerate() {
            dequantize_block(ty, chunk, &mut block);
            let want = &row[b * c.block_size..(b + 1) * c.block_size];
            for (i, (g, w)) in block.iter().zip(want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{name}: block {b} element {i}: block {g:e} vs row {w:e}"
                );
            }
        }
    }
}
