//! Models split by llama.cpp's `gguf-split` (`NAME-00001-of-00003.gguf`, ...): the parts load as
//! the one model they were cut from, natively from the first part's path and as one buffer of
//! the parts laid end to end (what the browser downloads); broken or mismatched sets give errors
//! that name the problem. The parts are written by `gguf::split_gguf`, in gguf-split's layout.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use nexttoken::cpu::CpuModel;
use nexttoken::gguf::{split_file_name, split_gguf, split_gguf_by, Gguf, Value};
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::LanguageModel;

/// A fresh folder under the system's temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("nexttoken-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    /// Write `parts` as `m-0000k-of-0000N.gguf`; the path of the first.
    fn write_parts(&self, parts: &[Vec<u8>]) -> PathBuf {
        for (k, part) in parts.iter().enumerate() {
            std::fs::write(self.part(k + 1, parts.len()), part).unwrap();
        }
        self.part(1, parts.len())
    }
    fn part(&self, k: usize, n: usize) -> PathBuf {
        self.0.join(split_file_name("m", k, n))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Logits of the exact CPU path for a few tokens, one forward at a time.
fn logits(model: Model) -> Vec<Vec<f32>> {
    let m = CpuModel::new(model);
    let mut state = m.new_state();
    [1u32, 7, 3, 42, 9].iter().map(|&t| m.forward(&mut state, &[t], false).unwrap()).collect()
}

#[track_caller]
fn same_model(split: Model, whole: &[u8]) {
    let want = Model::from_bytes(whole.to_vec()).unwrap();
    assert_eq!(split.config, want.config);
    let shape = |m: &Model| -> Vec<_> {
        m.tensors.iter().map(|t| (t.name.clone(), t.ty, t.rows, t.cols)).collect()
    };
    assert_eq!(shape(&split), shape(&want));
    for (a, b) in split.tensors.iter().zip(&want.tensors) {
        assert_eq!(split.bytes(a), want.bytes(b), "{}", a.name);
    }
    // Bit for bit: the same bytes go through the same arithmetic.
    assert_eq!(logits(split), logits(want));
}

fn concat(parts: &[&Vec<u8>]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

#[track_caller]
fn parse_err(bytes: &[u8], needles: &[&str]) {
    match Gguf::parse(bytes) {
        Ok(g) => {
            panic!("expected an error containing {needles:?}, parsed {} tensors", g.tensors.len())
        }
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
            }
        }
    }
}

#[test]
fn the_parts_are_gguf_split_files() {
    let whole = synth_model("llama", GgmlType::Q8_0, 5);
    let g = Gguf::parse(&whole).unwrap();
    let parts = split_gguf(&whole, 3).unwrap();
    let mut names = Vec::new();
    for (k, part) in parts.iter().enumerate() {
        // Each part is a GGUF file of its own, with gguf-split's keys and types.
        let p = Gguf::parse_file(part).unwrap();
        assert_eq!(p.get("split.no"), Some(&Value::U16(k as u16)));
        assert_eq!(p.get("split.count"), Some(&Value::U16(3)));
        assert_eq!(p.get("split.tensors.count"), Some(&Value::I32(g.tensors.len() as i32)));
        // Only part 1 has the model's metadata.
        let others = p.metadata.keys().filter(|k| !k.starts_with("split.")).count();
        assert_eq!(others, if k == 0 { g.metadata.len() } else { 0 }, "part {}", k + 1);
        assert!(!p.tensors.is_empty());
        // Every tensor padded to 32 bytes, so each part ends on a multiple of 32.
        assert_eq!(part.len() % 32, 0);
        names.extend(p.tensors.iter().map(|t| t.name.clone()));
    }
    let want: Vec<_> = g.tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(names, want, "the tensors, in file order");
    let split = Gguf::parse(&concat(&parts.iter().collect::<Vec<_>>())).unwrap();
    assert_eq!(split.parts, 3);
    assert_eq!(split.metadata, {
        let mut m = g.metadata.clone();
        m.extend(Gguf::parse_file(&parts[0]).unwrap().metadata);
        m
    });
}

/// `Model::open` on part 1 reads the others beside it; the parts laid end to end load too;
/// logits are bit-identical to the unsplit file's, for each architecture, and with the first
/// part holding no tensors (gguf-split's `--no-tensor-first-split`).
#[test]
fn split_models_load_as_the_whole() {
    let tmp = TempDir::new("split-load");
    let mut wholes: Vec<Vec<u8>> =
        [("llama", GgmlType::Q8_0), ("qwen2", GgmlType::F16), ("gpt2", GgmlType::F32)]
            .iter()
            .map(|&(arch, ty)| synth_model(arch, ty, 9))
            .collect();
    // A file of another alignment: part 1 keeps it, the other parts have the default 32.
    let mut aligned = synth_parts("llama", GgmlType::F32, 9);
    aligned.set_meta("general.alignment", Value::U32(64));
    wholes.push(aligned.to_bytes());
    for whole in wholes {
        let n = Gguf::parse(&whole).unwrap().tensors.len();
        for counts in [vec![n / 3, n / 3, n - 2 * (n / 3)], vec![0, 1, n - 1], vec![n - 1, 1]] {
            let parts = split_gguf_by(&whole, &counts).unwrap();
            let first = tmp.write_parts(&parts);
            same_model(Model::open(&first).unwrap(), &whole);
            same_model(
                Model::from_bytes(concat(&parts.iter().collect::<Vec<_>>())).unwrap(),
                &whole,
            );
            for k in 1..=parts.len() {
                std::fs::remove_file(tmp.part(k, parts.len())).unwrap();
            }
        }
    }
}

fn nexttoken(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nexttoken")).args(args).output().expect("run nexttoken")
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn generate(model: &Path) -> String {
    stdout(&nexttoken(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "a b c",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "--backend",
        "cpu",
        "--json",
    ]))
}

/// The CLI's greedy output from part 1 of a split model is the unsplit file's, token for token;
/// `info` says how many parts.
#[test]
fn cli_generates_from_the_first_part() {
    let tmp = TempDir::new("split-cli");
    let whole = synth_model("llama", GgmlType::Q8_0, 13);
    let single = tmp.0.join("whole.gguf");
    std::fs::write(&single, &whole).unwrap();
    let first = tmp.write_parts(&split_gguf(&whole, 3).unwrap());
    let tokens = |out: &str| -> Vec<u64> {
        let lines: Vec<serde_json::Value> =
            out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        lines.iter().filter_map(|l| l["id"].as_u64()).collect()
    };
    let (want, got) = (generate(&single), generate(&first));
    assert!(!tokens(&want).is_empty());
    assert_eq!(tokens(&got), tokens(&want));
    let summary = |out: &str| -> serde_json::Value {
        serde_json::from_str(out.lines().last().unwrap()).unwrap()
    };
    assert_eq!(summary(&got)["text"], summary(&want)["text"]);
    let info = stdout(&nexttoken(&["info", "--model", first.to_str().unwrap()]));
    assert!(info.contains("split in 3 parts"), "{info}");
}

/// Broken sets of parts: errors that say what is wrong, never a panic.
#[test]
fn broken_split_models_give_clear_errors() {
    let whole = synth_model("llama", GgmlType::Q8_0, 21);
    let parts = split_gguf(&whole, 3).unwrap();
    let (p1, p2, p3) = (&parts[0], &parts[1], &parts[2]);

    // A part missing, from the end or the middle; parts out of order; part 2 first.
    parse_err(&concat(&[p1, p2]), &["part 3 of 3", "missing"]);
    parse_err(p1, &["part 2 of 3", "missing"]);
    parse_err(&concat(&[p1, p3]), &["part 2 of 3", "says it is part 3 of 3", "out of order"]);
    parse_err(&concat(&[p1, p3, p2]), &["out of order"]);
    parse_err(&concat(&[p2, p1, p3]), &["part 2 of 3", "load the first part"]);
    // A part too many, or part 1 twice.
    parse_err(&concat(&[p1, p2, p3, p3]), &["follow the last of the 3 parts"]);
    parse_err(&concat(&[p1, p1, p2, p3]), &["says it is part 1 of 3"]);

    // A part that says the model has another number of parts.
    let with = |part: &[u8], key: &str, v: Value| {
        let g = Gguf::parse_file(part).unwrap();
        assert!(g.get(key).is_some());
        let mut w = nexttoken::gguf::GgufWriter::new();
        let mut keys: Vec<_> = g.metadata.iter().collect();
        keys.sort_by(|a, b| a.0.cmp(b.0));
        for (k, old) in keys {
            w.metadata(k, if k == key { v.clone() } else { old.clone() });
        }
        for t in &g.tensors {
            w.tensor(&t.name, t.ty, &t.dims, part[t.offset..][..t.size_bytes].to_vec());
        }
        w.to_bytes()
    };
    let p2_of_4 = with(p2, "split.count", Value::U16(4));
    parse_err(&concat(&[p1, &p2_of_4, p3]), &["part 2 of 3", "says it is part 2 of 4"]);
    let p1_of_2 = with(p1, "split.count", Value::U16(2));
    parse_err(&concat(&[&p1_of_2, p2, p3]), &["part 2 of 2", "says it is part 2 of 3"]);
    // The same tensors twice (part 2 again, numbered 3).
    let p2_as_3 = with(p2, "split.no", Value::U16(2));
    parse_err(&concat(&[p1, p2, &p2_as_3]), &["duplicate tensor name", "part 3 of 3"]);
    // A wrong tensor count.
    let n = Gguf::parse(&whole).unwrap().tensors.len() as i32;
    let p1_more = with(p1, "split.tensors.count", Value::I32(n + 1));
    parse_err(
        &concat(&[&p1_more, p2, p3]),
        &["split.tensors.count is", &format!("hold {n} tensors")],
    );
    // Split keys of the wrong kind.
    let p1_odd = with(p1, "split.count", Value::String("3".into()));
    parse_err(&concat(&[&p1_odd, p2, p3]), &["split.count", "not a count"]);
    // A damaged later part names itself.
    let mut broken = concat(&[p1, p2, p3]);
    let at = p1.len() + 4;
    broken[at..at + 4].copy_from_slice(&9u32.to_le_bytes());
    parse_err(&broken, &["part 2 of 3", "version 9"]);

    // Cut anywhere before the last tensor's data ends: an error (after it, only padding is lost).
    let all = concat(&[p1, p2, p3]);
    let end = Gguf::parse(&all).unwrap().tensors.iter().map(|t| t.offset + t.size_bytes).max();
    for len in 0..all.len() {
        let r = Gguf::parse(&all[..len]);
        assert_eq!(r.is_ok(), len >= end.unwrap(), "cut at {len} of {}", all.len());
    }

    // Natively: a missing part file is named; file names that disagree with part 1.
    let tmp = TempDir::new("split-broken");
    let first = tmp.write_parts(&parts);
    std::fs::remove_file(tmp.part(2, 3)).unwrap();
    let err = Model::open(&first).err().expect("part 2 is missing").to_string();
    assert!(err.contains("m-00002-of-00003.gguf") && err.contains("part 2 of 3"), "{err}");
    let two = split_gguf(&whole, 2).unwrap();
    for (k, part) in two.iter().chain([p3]).enumerate() {
        std::fs::write(tmp.part(k + 1, 3), part).unwrap();
    }
    let err = Model::open(&first).err().expect("names say 3 parts, part 1 says 2").to_string();
    assert!(err.contains("follow the last of the 2 parts"), "{err}");
    std::fs::write(tmp.part(1, 3), &whole).unwrap();
    let err = Model::open(&first).err().expect("names say 3 parts, part 1 is whole").to_string();
    assert!(err.contains("names say 3 parts, but part 1 says the model has 1"), "{err}");
    // Opening a later part asks for the first.
    let err = Model::open(&tmp.part(2, 3)).err().expect("part 2 alone").to_string();
    assert!(err.contains("load the first part"), "{err}");
    // An empty part is named as empty (read on, the next part would be taken for it: an empty
    // first part said "load the first part", the file that was given).
    let parts_dir = TempDir::new("split-empty");
    let first = parts_dir.write_parts(&parts);
    std::fs::write(&first, b"").unwrap();
    let err = Model::open(&first).err().expect("part 1 is empty").to_string();
    assert!(
        err.contains("m-00001-of-00003.gguf (part 1 of 3") && err.contains("is empty"),
        "{err}"
    );
    std::fs::write(&first, p1).unwrap();
    std::fs::write(parts_dir.part(2, 3), b"").unwrap();
    let err = Model::open(&first).err().expect("part 2 is empty").to_string();
    assert!(err.contains("part 2 of 3") && err.contains("is empty"), "{err}");
}

#[test]
fn split_file_names_are_llama_cpps() {
    use nexttoken::gguf::first_split_part;
    assert_eq!(split_file_name("dir/model-q8_0", 2, 3), "dir/model-q8_0-00002-of-00003.gguf");
    assert_eq!(first_split_part("model-00001-of-00003.gguf"), Some(("model", 3)));
    assert_eq!(first_split_part("a-b-00001-of-00012.gguf"), Some(("a-b", 12)));
    for name in [
        "model-00002-of-00003.gguf",
        "model-00001-of-00001.gguf",
        "-00001-of-00003.gguf",
        "model-0001-of-00003.gguf",
        "model-00001-of-00003.bin",
        "model.gguf",
        "model-0000x-of-00003.gguf",
    ] {
        assert_eq!(first_split_part(name), None, "{name}");
    }
}
