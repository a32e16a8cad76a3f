//! `nexttoken bench`: load time, prefill and decode speed, bytes of weights read per token and the
//! bandwidth that implies, against a measured memory-copy bandwidth, and peak memory.
//!
//! Token ids are a fixed pseudo-random sequence (no tokenizer needed), so synthetic models from
//! `nexttoken synth` and real ones are measured the same way; `tools/bench_llamacpp.py` feeds
//! llama.cpp the same kind of sequence.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{json, Value};

use nexttoken::constraint::ConstraintSpec;
use nexttoken::cpu::{CpuModel, Precision};
use nexttoken::generate::speculative::DEFAULT_MAX_DRAFT;
use nexttoken::generate::{
    prompt_ids, DraftSource, GenerateOptions, Generation, GenerationSummary, SpeculativeOptions,
};
use nexttoken::gguf::Gguf;
use nexttoken::gpu::GpuModel;
use nexttoken::lm::{block_on, IdsOnly};
use nexttoken::model::Model;
use nexttoken::sampling::SamplerConfig;
use nexttoken::timing::bench_token;
use nexttoken::timing::{default_clock, memcpy_bandwidth, per_second};
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{Error, LanguageModel, Result, Vocab};

/// The `bench` command's options (its command-line arguments).
#[derive(clap::Args)]
pub struct BenchOptions {
    /// A GGUF file. Default: the embedded model (www/models/default.gguf).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "gpu", "both"])]
    pub backend: String,
    /// CPU threads (0 = every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Prompt lengths to time prefill on (comma-separated).
    #[arg(long, default_value = "16,128", value_delimiter = ',')]
    pub prefill: Vec<usize>,
    /// Context lengths to time decode at (the cache is filled to each first).
    #[arg(long, default_value = "16,1024", value_delimiter = ',')]
    pub contexts: Vec<usize>,
    /// Decode steps timed at each context.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Time the exact (reference) CPU path instead of the fast one.
    #[arg(long)]
    pub exact: bool,
    /// CPU backend, fast path: the kernels' instruction set (default: the best this machine has),
    /// to compare them on one host.
    #[arg(long)]
    pub isa: Option<String>,
    /// GPU: time every kernel of one decode step at each context, and of each prefill of more
    /// than 8 tokens (timestamp queries, where the adapter has them): dispatches, µs and GB/s
    /// per kernel family.
    #[arg(long)]
    pub profile: bool,
    #[arg(long)]
    pub json: bool,
    /// Structured output: also time constrained generations (--json-schema, --json-object,
    /// --regex or --grammar) and report the constraint's cost per decode step as a share of
    /// the step.
    #[command(flatten)]
    pub constraint: super::generate::ConstraintArgs,
    /// The tokenizer a constraint reads (default: the GGUF's own).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Speculative decoding: greedy generations of --spec-tokens tokens, plain and with
    /// drafters whose acceptance is known (a replay of the plain run's own tokens: all right,
    /// every other one wrong, all wrong) and prompt lookup, each against plain decoding in the
    /// same run: tokens/s, the speed-up, tokens per forward pass, the share of guesses kept, and
    /// whether the tokens are the plain run's.
    #[arg(long)]
    pub speculative: bool,
    /// Speculative decoding: the most guesses one pass verifies (k).
    #[arg(long, default_value_t = DEFAULT_MAX_DRAFT)]
    pub draft_max: usize,
    /// Speculative decoding: tokens each timed generation makes.
    #[arg(long, default_value_t = 128)]
    pub spec_tokens: usize,
    /// Speculative decoding's verification passes: time forward passes of these token counts
    /// (comma-separated) after a 16-token prompt, with a row of logits each, 20 times each; the
    /// fastest, also in one-token passes (what a pass costs against a plain step).
    #[arg(long, value_delimiter = ',')]
    pub passes: Vec<usize>,
}

/// Time prefill and decode on any model.
fn measure<M: LanguageModel>(m: &M, o: &BenchOptions) -> Result<Value> {
    let vocab = m.vocab_size();
    let toks = |from: usize, n: usize| -> Vec<u32> {
        (from..from + n).map(|i| bench_token(i, vocab)).collect()
    };
    // Warm-up: page the weights in and let the threads start.
    let mut s = m.new_state();
    m.forward(&mut s, &toks(0, 4), false)?;
    m.forward(&mut s, &toks(4, 1), false)?;

    let mut prefill = serde_json::Map::new();
    for &n in &o.prefill {
        let mut s = m.new_state();
        let start = default_clock();
        m.forward(&mut s, &toks(0, n), false)?;
        prefill.insert(n.to_string(), json!(per_second(n, default_clock() - start)));
    }
    let mut decode = serde_json::Map::new();
    let mut fill = serde_json::Map::new();
    for &ctx in &o.contexts {
        let mut s = m.new_state();
        // Fill the cache to `ctx` tokens in prompt-sized chunks.
        let start = default_clock();
        let mut pos = 0;
        while pos < ctx {
            let n = (ctx - pos).min(256);
            m.forward(&mut s, &toks(pos, n), false)?;
            pos += n;
        }
        fill.insert(ctx.to_string(), json!(per_second(ctx, default_clock() - start)));
        let start = default_clock();
        for i in 0..o.steps {
            m.forward(&mut s, &toks(ctx + i, 1), false)?;
        }
        decode.insert(ctx.to_string(), json!(per_second(o.steps, default_clock() - start)));
    }
    let mut r = json!({"prefill_tok_s": prefill, "fill_tok_s": fill, "decode_tok_s": decode});
    if !o.passes.is_empty() {
        r["pass_ms"] = pass_times(m, o, &toks)?;
    }
    Ok(r)
}

/// The fastest of 20 forward passes of each of `--passes` token counts (and of 1, the
/// reference) after a 16-token prompt, with all logits (a verification pass), in ms.
fn pass_times<M: LanguageModel>(
    m: &M,
    o: &BenchOptions,
    toks: &dyn Fn(usize, usize) -> Vec<u32>,
) -> Result<Value> {
    const REPS: usize = 20;
    let mut times = serde_json::Map::new();
    for &n in std::iter::once(&1).chain(o.passes.iter().filter(|&&n| n != 1)) {
        let mut best = f64::INFINITY;
        for rep in 0..REPS {
            let mut s = m.new_state();
            m.forward(&mut s, &toks(0, 16), false)?;
            let start = default_clock();
            m.forward(&mut s, &toks(16 + rep, n), true)?;
            best = best.min(default_clock() - start);
        }
        times.insert(n.to_string(), json!(best));
    }
    Ok(Value::Object(times))
}

/// Constrained generations (sampling at temperature 1, a new seed each, `o.steps` tokens at
/// most) until at least `4 * o.steps` decode steps are timed: the constraint's time per step
/// (llguidance consuming the token and computing the next allowed set) against the whole
/// step's, and the whole step against the same generations' steps without the constraint (which
/// adds masking the logits and the removed tokens' report).
fn constrained<M: LanguageModel>(
    m: &M,
    vocab: &dyn Vocab,
    spec: &ConstraintSpec,
    o: &BenchOptions,
) -> Result<Value> {
    let prompt = prompt_ids(m.bos_token(), vocab, "Here is the answer as JSON:")?;
    let (mut steps, mut step_ms, mut constraint_ms, mut build_ms, mut runs) = (0, 0.0, 0.0, 0.0, 0);
    let mut complete = 0;
    let vocab_ms = {
        let start = default_clock();
        vocab.constraint_vocab(m.vocab_size())?;
        default_clock() - start
    };
    while steps < 4 * o.steps && runs < 64 {
        let opts = GenerateOptions {
            max_tokens: o.steps.max(2),
            sampler: SamplerConfig { seed: runs as u64, ..SamplerConfig::default() },
            constraint: Some(spec.clone()),
            ..GenerateOptions::default()
        };
        let mut g = Generation::new(m, vocab, &prompt, opts)?;
        let built = g.constraint_build_ms();
        // The first token's step is the prefill's: the decode steps are the ones after it.
        let mut after_first = 0.0;
        while g.step()?.is_some() {
            if g.generated_ids().len() == 1 {
                after_first = g.constraint_time().0;
            }
        }
        let s = g.summary().expect("stopped");
        if s.generated_tokens > 1 {
            steps += s.generated_tokens - 1;
            step_ms += s.decode_ms;
            constraint_ms += g.constraint_time().0 - after_first;
        }
        build_ms += built;
        complete += s.stop_reason.is_complete() as usize;
        runs += 1;
    }
    if steps == 0 {
        return Err(Error::Input("the constrained runs made no decode step to time".into()));
    }
    // The same runs' step time without the constraint (the same seeds and lengths).
    let (mut plain_steps, mut plain_ms) = (0, 0.0);
    for seed in 0..runs {
        let opts = GenerateOptions {
            max_tokens: o.steps.max(2),
            sampler: SamplerConfig { seed: seed as u64, ..SamplerConfig::default() },
            stop_at_eos: false,
            ..GenerateOptions::default()
        };
        let mut g = Generation::new(m, vocab, &prompt, opts)?;
        while g.step()?.is_some() {}
        let s = g.summary().expect("stopped");
        plain_steps += s.generated_tokens.saturating_sub(1);
        plain_ms += s.decode_ms;
    }
    let per_step = step_ms / steps as f64;
    let per_constraint = constraint_ms / steps as f64;
    let plain_step = plain_ms / plain_steps.max(1) as f64;
    Ok(json!({
        "kind": spec.kind(),
        "runs": runs,
        "complete_runs": complete,
        "decode_steps": steps,
        "step_ms": per_step,
        "constraint_ms_per_step": per_constraint,
        "constraint_share": per_constraint / per_step,
        "plain_step_ms": plain_step,
        "overhead_share": (per_step - plain_step) / plain_step,
        "compile_ms_per_run": build_ms / runs as f64,
        "vocab_index_ms": vocab_ms,
    }))
}

/// Speculative decoding against plain decoding in one run (see [`BenchOptions::speculative`]):
/// greedy from the same pseudo-random prompt, plain first and last (the faster of the two is
/// the reference, so a ratio is never flattered by a slow first run).
fn speculative<M: LanguageModel>(m: &M, o: &BenchOptions) -> Result<Value> {
    let prompt: Vec<u32> = (0..16).map(|i| bench_token(i, m.vocab_size())).collect();
    let plain = GenerateOptions {
        max_tokens: o.spec_tokens.min(m.context_length().saturating_sub(prompt.len())).max(2),
        sampler: SamplerConfig::greedy(),
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    let run = |opts: GenerateOptions| -> Result<(Vec<u32>, GenerationSummary)> {
        let mut g = Generation::new(m, &IdsOnly, &prompt, opts)?;
        while g.step()?.is_some() {}
        Ok((g.generated_ids().to_vec(), g.summary().expect("stopped")))
    };
    run(plain.clone())?; // warm-up
    let (want, first) = run(plain.clone())?;
    // The tokens a replay guesses: the plain run's, or where the verification passes round
    // differently from one-token steps (passes of more than 7 tokens go through prefill's
    // panels, which sum in their own order, and a random-weight network amplifies the last bit
    // into other near-ties; the GPU's tiles), the tokens the speculative run itself makes with
    // them, so that "all right" is all right.
    let mut guesses = want.clone();
    for _ in 0..4 {
        let source = DraftSource::Replay { tokens: guesses.clone(), wrong_every: 0 };
        let spec = SpeculativeOptions { source, max_draft: o.draft_max };
        let (ids, _) = run(GenerateOptions { speculative: Some(spec), ..plain.clone() })?;
        if ids == guesses {
            break;
        }
        guesses = ids;
    }
    let replay = |wrong_every| DraftSource::Replay { tokens: guesses.clone(), wrong_every };
    let drafters = [
        ("replay, all right", replay(0)),
        ("replay, every other wrong", replay(2)),
        ("replay, all wrong", replay(1)),
        ("prompt lookup", DraftSource::lookup()),
    ];
    let mut runs = Vec::new();
    for (name, source) in drafters {
        let spec = SpeculativeOptions { source, max_draft: o.draft_max };
        let (ids, s) = run(GenerateOptions { speculative: Some(spec), ..plain.clone() })?;
        let stats = s.speculation.clone().expect("speculation was on");
        runs.push(json!({
            "drafter": name,
            "decode_tok_s": s.decode_tokens_per_second(),
            "tokens_per_pass": stats.tokens_per_pass(s.generated_tokens),
            "acceptance": stats.acceptance_rate(),
            "passes": stats.passes,
            "same_tokens": ids == want,
        }));
    }
    let (_, last) = run(plain.clone())?;
    let reference = first.decode_tokens_per_second().max(last.decode_tokens_per_second());
    for r in &mut runs {
        r["speedup"] = json!(r["decode_tok_s"].as_f64().unwrap_or(0.0) / reference);
    }
    Ok(json!({
        "k": o.draft_max,
        "tokens": plain.max_tokens,
        "plain_decode_tok_s": [first.decode_tokens_per_second(), last.decode_tokens_per_second()],
        "guesses_are_plain_tokens": guesses == want,
        "runs": runs,
    }))
}

/// The model `--model` names, or the embedded one.
fn open_model(o: &BenchOptions) -> Result<Model> {
    match &o.model {
        Some(path) => Model::open(path),
        None => super::load::embedded_model(),
    }
}

/// What the report calls the model.
fn model_name(o: &BenchOptions) -> String {
    match &o.model {
        Some(path) => path.display().to_string(),
        None => "embedded default (www/models/default.gguf)".into(),
    }
}

/// The tokenizer for a constraint: `--tokenizer`, else the GGUF's own (the embedded model's
/// tokenizer.json for it).
fn bench_tokenizer(o: &BenchOptions, model: &Model) -> Result<HfTokenizer> {
    let tokenizer = match (&o.tokenizer, &o.model) {
        (Some(path), _) => HfTokenizer::from_file(path)?,
        (None, None) => super::load::embedded_tokenizer()?,
        (None, Some(_)) => HfTokenizer::from_gguf(&Gguf::parse(&model.storage)?)?,
    };
    tokenizer.check_fits(model.config.n_vocab)?;
    Ok(tokenizer)
}

/// Per-kernel times of one decode step after filling the cache to each context (keyed by the
/// context), and of each prefill of more than 8 tokens from an empty cache (keyed "prefill N"):
/// per label (kernel family, and for products what they fuse), dispatches, µs and weight bytes
/// read. `null` when the adapter has no timestamp queries.
fn profile(gm: &GpuModel, o: &BenchOptions) -> Result<Value> {
    let vocab = gm.vocab_size();
    let mut out = serde_json::Map::new();
    let ids = |from: usize, n: usize| -> Vec<u32> {
        (from..from + n).map(|i| bench_token(i, vocab)).collect()
    };
    let decodes = o.contexts.iter().map(|&ctx| (ctx.to_string(), ctx, 1));
    let prefills = o.prefill.iter().filter(|&&n| n > 8).map(|&n| (format!("prefill {n}"), 0, n));
    for (key, ctx, n) in decodes.chain(prefills) {
        let Some(rows) = block_on(gm.profile_after_async(&ids(0, ctx + n), ctx))? else {
            return Ok(Value::Null);
        };
        out.insert(key, json!(rows));
    }
    Ok(Value::Object(out))
}

/// The GPU's side of a decode step at each context: its time for a step from timestamps at the
/// ends of the step's pass (`gpu_step_us`; null without timestamp queries), and steps chained in
/// one submission (greedy, each pick fed back on the GPU, only the picks read back once:
/// `chained_decode_tok_s`). Against the ordinary step's wall time these show what recording,
/// submitting and reading back each step cost.
fn gpu_step(gm: &GpuModel, o: &BenchOptions) -> Result<Value> {
    let vocab = gm.vocab_size();
    let ids = |from: usize, n: usize| -> Vec<u32> {
        (from..from + n).map(|i| bench_token(i, vocab)).collect()
    };
    let fill = |ctx: usize| -> Result<nexttoken::gpu::GpuState> {
        let mut s = gm.new_state();
        for piece in ids(0, ctx).chunks(256) {
            gm.forward(&mut s, piece, false)?;
        }
        Ok(s)
    };
    let (mut micros, mut chained) = (serde_json::Map::new(), serde_json::Map::new());
    for &ctx in &o.contexts {
        let mut s = fill(ctx)?;
        let mut total = Some(0.0);
        for i in 0..o.steps {
            let t = block_on(gm.gpu_micros_async(&mut s, &ids(ctx + i, 1)))?;
            total = total.zip(t).map(|(a, b)| a + b);
        }
        micros.insert(ctx.to_string(), json!(total.map(|t| t / o.steps as f64)));
        let mut s = fill(ctx)?;
        let start = default_clock();
        block_on(gm.forward_greedy_chain_async(&mut s, &ids(ctx, 1), o.steps))?;
        chained.insert(ctx.to_string(), json!(per_second(o.steps, default_clock() - start)));
    }
    Ok(json!({"gpu_step_us": micros, "chained_decode_tok_s": chained}))
}

/// Peak resident memory of this process (VmHWM), in bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn run(o: &BenchOptions) -> Result<()> {
    // Contexts and prompts beyond the model's own context are clamped to fit it.
    let n_ctx = open_model(o)?.config.n_ctx;
    let fit = |n: usize| n.min(n_ctx.saturating_sub(o.steps + 1)).max(1);
    let o = &BenchOptions {
        model: o.model.clone(),
        backend: o.backend.clone(),
        threads: o.threads,
        prefill: o.prefill.iter().map(|&n| n.min(n_ctx)).collect(),
        contexts: o.contexts.iter().map(|&n| fit(n)).collect(),
        steps: o.steps,
        exact: o.exact,
        isa: o.isa.clone(),
        profile: o.profile,
        json: o.json,
        constraint: o.constraint.clone(),
        tokenizer: o.tokenizer.clone(),
        speculative: o.speculative,
        draft_max: o.draft_max,
        spec_tokens: o.spec_tokens,
        passes: o.passes.iter().map(|&n| fit(n)).collect(),
    };
    if o.speculative {
        SpeculativeOptions { source: DraftSource::lookup(), max_draft: o.draft_max }.validate()?;
    }
    let spec = o.constraint.spec()?;
    let spec_ctx = if o.speculative { 16 + o.spec_tokens + o.draft_max } else { 0 };
    // A timed pass comes after a 16-token prompt, at one of 20 offsets.
    let pass_ctx = o.passes.iter().map(|&n| 16 + 20 + n).max().unwrap_or(0);
    let max_ctx = (o.contexts.iter().chain(&o.prefill).copied().max().unwrap_or(16) + o.steps)
        .max(spec_ctx)
        .max(pass_ctx)
        + 8;
    let mut results = Vec::new();
    let backends: Vec<&str> = match o.backend.as_str() {
        "both" => vec!["cpu", "gpu"],
        b => vec![b],
    };
    let mut model_bytes = 0usize;
    let mut per_token = 0usize;
    let mut params = 0usize;
    for backend in backends {
        let t = Instant::now();
        let model = open_model(o)?;
        model_bytes = model.tensors.iter().map(|t| t.size_bytes).sum();
        params = model.parameter_count();
        // With --constraint: the spec and the tokenizer its allowed sets are made for.
        let constraint = match &spec {
            Some(spec) => Some((spec, bench_tokenizer(o, &model)?)),
            None => None,
        };
        let constraint = constraint.as_ref().map(|(spec, tokenizer)| (*spec, tokenizer));
        let mut r = if backend == "gpu" {
            let gm = GpuModel::new(model)?.with_max_seq(max_ctx);
            let load_s = t.elapsed().as_secs_f64();
            let desc = gm.context().describe();
            let mut r = measure(&gm, o)?;
            r["load_s"] = json!(load_s);
            r["device"] = json!(desc);
            if let Some((spec, tokenizer)) = constraint {
                r["constraint"] = constrained(&gm, tokenizer, spec, o)?;
            }
            if o.speculative {
                r["speculative"] = speculative(&gm, o)?;
            }
            // Counters of the last forward, which `measure` left at a one-token decode step.
            let st = gm.stats();
            r["dispatches_per_step"] = json!(st.dispatches_last);
            r["submissions_per_step"] = json!(st.submissions_last);
            r["readback_bytes_per_step"] = json!(st.readback_bytes_last);
            r["gpu_memory_bytes"] = json!(st.model_bytes + st.kv_bytes_per_state);
            r["f16_kv"] = json!(st.f16_kv);
            r["f16_prefill"] = json!(st.f16_prefill);
            r["dispatch_budget"] = json!(8 * gm.model.config.n_layer + 6);
            let step = gpu_step(&gm, o)?;
            r["gpu_step_us"] = step["gpu_step_us"].clone();
            r["chained_decode_tok_s"] = step["chained_decode_tok_s"].clone();
            if o.profile {
                r["profile"] = profile(&gm, o)?;
            }
            // The reference for the weights' read rate: a plain kernel reading a buffer.
            let kernels = nexttoken::gpu::kernels::Kernels::new(gm.context().clone());
            r["read_bytes_s"] =
                json!(nexttoken::gpu::dispatch::read_bandwidth(&kernels, 256 << 20, 8)?);
            r["note"] = json!("readback is the full logits row (the LanguageModel API); forward_greedy reads 4 bytes, forward_topk 8k+8");
            r
        } else {
            let threads = super::load::cpu_threads(o.threads)?;
            let precision = if o.exact { Precision::Exact } else { Precision::Fast };
            let mut cm = CpuModel::new(model)
                .with_precision(precision)
                .with_threads(threads)
                .with_max_seq(max_ctx);
            if let Some(name) = &o.isa {
                cm = cm.with_isa(nexttoken::cpu::kernels::Isa::by_name(name)?);
            }
            let load_s = t.elapsed().as_secs_f64();
            per_token = cm.weight_bytes_per_token();
            let mut r = measure(&cm, o)?;
            if let Some((spec, tokenizer)) = constraint {
                r["constraint"] = constrained(&cm, tokenizer, spec, o)?;
            }
            if o.speculative {
                r["speculative"] = speculative(&cm, o)?;
            }
            r["load_s"] = json!(load_s);
            r["threads"] = json!(cm.threads());
            r["isa"] = json!(if o.exact { "exact (scalar reference)" } else { cm.isa().name() });
            // The walk decode settled on (it may have timed both on its first steps).
            r["decode_streams"] = json!(!o.exact && cm.decode_in_streams() == Some(true));
            r["decode_walk_timed"] =
                json!(!o.exact && nexttoken::cpu::kernels::decode_in_streams(cm.isa()).is_none());
            r
        };
        if per_token == 0 {
            per_token = CpuModel::new(open_model(o)?).weight_bytes_per_token();
        }
        r["backend"] = json!(backend);
        let eff: serde_json::Map<String, Value> = r["decode_tok_s"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), json!(v.as_f64().unwrap_or(0.0) * per_token as f64)))
                    .collect()
            })
            .unwrap_or_default();
        r["weight_bandwidth_bytes_s"] = Value::Object(eff);
        results.push(r);
    }
    // Read the peak before the copy test's 512 MiB of buffers raise it.
    let rss = peak_rss();
    let memcpy = memcpy_bandwidth(256 << 20, default_clock);
    let host = nexttoken::cpu::kernels::HostCpu::detect();
    let out = json!({
        "cpu": {"vendor": host.vendor, "model": host.model, "features": host.features},
        "model": model_name(o),
        "parameters": params,
        "model_bytes": model_bytes,
        "weight_bytes_per_token": per_token,
        "memcpy_bytes_s": memcpy,
        "peak_rss_bytes": rss,
        "steps": o.steps,
        "results": results,
    });
    if o.json {
        println!("{out}");
        return Ok(());
    }
    let mib = |b: f64| b / (1 << 20) as f64;
    let gbs = |b: f64| b / 1e9;
    println!("cpu            {host}");
    println!("model          {}", model_name(o));
    println!("parameters     {params}, tensors {:.1} MiB", mib(model_bytes as f64));
    println!("weights/token  {:.1} MiB read per decode step", mib(per_token as f64));
    println!("memcpy         {:.1} GB/s (256 MiB copy, read + write)", gbs(memcpy));
    for r in &results {
        println!("-- backend {}", r["backend"].as_str().unwrap_or("?"));
        if let Some(d) = r["device"].as_str() {
            println!("device         {d}");
        }
        if let Some(t) = r["threads"].as_u64() {
            let streams = r["decode_streams"] == json!(true);
            let rows = match (r["decode_walk_timed"] == json!(true), streams) {
                (false, false) => "",
                (false, true) => {
                    "; decode in streams: Q8_0 and K-quants row by row, Q4_0/Q5_0/Q5_1 in spread tiles"
                }
                (true, false) => "; decode walk timed on the first steps: adjacent tiles",
                (true, true) => "; decode walk timed on the first steps: streams",
            };
            println!("threads        {t} ({}{rows})", r["isa"].as_str().unwrap_or(""));
        }
        println!("load           {:.3} s", r["load_s"].as_f64().unwrap_or(0.0));
        for (n, v) in r["prefill_tok_s"].as_object().into_iter().flatten() {
            println!("prefill {n:>5}  {:.1} tok/s", v.as_f64().unwrap_or(0.0));
        }
        let one = r["pass_ms"]["1"].as_f64().unwrap_or(f64::NAN);
        for (n, v) in r["pass_ms"].as_object().into_iter().flatten() {
            let ms = v.as_f64().unwrap_or(f64::NAN);
            println!(
                "pass    {n:>5}  {ms:.2} ms = {:.2} one-token passes (all logits, fastest of 20)",
                ms / one
            );
        }
        // The GPU's reference is its own measured read bandwidth, the CPU's the memcpy.
        let (reference, ref_name) = match r["read_bytes_s"].as_f64() {
            Some(b) => {
                println!("GPU read       {:.1} GB/s (plain read kernel, 256 MiB)", gbs(b));
                (b, "of the GPU read")
            }
            None => (memcpy, "of memcpy"),
        };
        for (n, v) in r["decode_tok_s"].as_object().into_iter().flatten() {
            let bw = r["weight_bandwidth_bytes_s"][n].as_f64().unwrap_or(0.0);
            let fill = r["fill_tok_s"][n].as_f64().unwrap_or(0.0);
            println!(
                "decode @{n:>5}  {:.1} tok/s  (weights {:.1} GB/s = {:.0}% {ref_name}; filling the cache ran at {:.1} tok/s)",
                v.as_f64().unwrap_or(0.0),
                gbs(bw),
                100.0 * bw / reference,
                fill
            );
        }
        for (n, v) in r["gpu_step_us"].as_object().into_iter().flatten() {
            let wall = 1e6 / r["decode_tok_s"][n].as_f64().unwrap_or(f64::NAN);
            let chained = r["chained_decode_tok_s"][n].as_f64().unwrap_or(0.0);
            match v.as_f64() {
                Some(us) => println!(
                    "GPU step @{n:>5} {us:.0} µs on the GPU of {wall:.0} µs wall (one pass, timestamps at its ends); chained greedy steps, one submission: {chained:.1} tok/s"
                ),
                None => println!(
                    "GPU step @{n:>5} no timestamp queries; chained greedy steps, one submission: {chained:.1} tok/s"
                ),
            }
        }
        if let Some(c) = r.get("constraint") {
            let f = |key: &str| c[key].as_f64().unwrap_or(0.0);
            println!(
                "constraint     {}: the mask {:.3} ms per decode step of {:.2} ms = {:.1}%; the \
                 step {:+.1}% against {:.2} ms unconstrained ({} steps in {} sampled runs, {} \
                 complete; compiling it {:.1} ms per run, indexing the vocabulary {:.0} ms once)",
                c["kind"].as_str().unwrap_or("?"),
                f("constraint_ms_per_step"),
                f("step_ms"),
                100.0 * f("constraint_share"),
                100.0 * f("overhead_share"),
                f("plain_step_ms"),
                c["decode_steps"],
                c["runs"],
                c["complete_runs"],
                f("compile_ms_per_run"),
                f("vocab_index_ms"),
            );
        }
        if let Some(sp) = r.get("speculative") {
            let plain = &sp["plain_decode_tok_s"];
            println!(
                "speculative    greedy, {} tokens, k = {}; plain decoding {:.1} and {:.1} tok/s (first and last run; the faster is the reference)",
                sp["tokens"],
                sp["k"],
                plain[0].as_f64().unwrap_or(0.0),
                plain[1].as_f64().unwrap_or(0.0)
            );
            if sp["guesses_are_plain_tokens"] == json!(false) {
                println!(
                    "  (the replays guess the speculative run's own tokens: on this model its passes \
                     round differently from one-token steps, and greedy flips at near-ties)"
                );
            }
            for run in sp["runs"].as_array().into_iter().flatten() {
                let f = |key: &str| run[key].as_f64().unwrap_or(0.0);
                println!(
                    "  {:<26} {:>7.1} tok/s  {:.2}x  {:.2} tokens per pass, {:.0}% of guesses kept, {} passes{}",
                    run["drafter"].as_str().unwrap_or("?"),
                    f("decode_tok_s"),
                    f("speedup"),
                    f("tokens_per_pass"),
                    100.0 * f("acceptance"),
                    run["passes"],
                    if run["same_tokens"] == json!(true) { "" } else { "  (TOKENS DIFFER from plain greedy)" }
                );
            }
        }
        if let Some(d) = r["dispatches_per_step"].as_u64() {
            println!(
                "per step       {d} dispatches (budget {}), {} submission, {} bytes read back; GPU memory {:.1} MiB (f16 KV: {}, f16 prefill products: {})",
                r["dispatch_budget"],
                r["submissions_per_step"],
                r["readback_bytes_per_step"],
                mib(r["gpu_memory_bytes"].as_f64().unwrap_or(0.0)),
                r["f16_kv"],
                r["f16_prefill"]
            );
        }
        for (ctx, rows) in r["profile"].as_object().into_iter().flatten() {
            let total: f64 = rows
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| r["micros"].as_f64().unwrap_or(0.0))
                .sum();
            match ctx.strip_prefix("prefill ") {
                Some(n) => println!(
                    "profile prefill {n:>5}  from an empty cache, each dispatch in its own pass: {total:.0} µs"
                ),
                None => println!(
                    "profile @{ctx:>5}  one decode step, each dispatch in its own pass: {total:.0} µs"
                ),
            }
            for row in rows.as_array().into_iter().flatten() {
                let us = row["micros"].as_f64().unwrap_or(0.0);
                let bytes = row["bytes"].as_f64().unwrap_or(0.0);
                let rate = if bytes > 0.0 && us > 0.0 {
                    format!(
                        "  {:.1} GB/s ({:.0}% of the GPU read)",
                        bytes / us / 1e3,
                        100.0 * bytes / (us * 1e-6) / reference
                    )
                } else {
                    String::new()
                };
                println!(
                    "  {:<24} {:>4} dispatches {:>9.1} µs {:>5.1}%{rate}",
                    row["kernel"].as_str().unwrap_or("?"),
                    row["dispatches"],
                    us,
                    100.0 * us / total.max(1e-9)
                );
            }
        }
        if r.get("profile").is_some_and(Value::is_null) {
            println!("profile        this adapter has no timestamp queries");
        }
        if let Some(note) = r["note"].as_str() {
            println!("note           {note}");
        }
    }
    if let Some(rss) = rss {
        println!("peak RSS       {:.1} MiB (VmHWM, before the memcpy test)", mib(rss as f64));
    }
    Ok(())
}
