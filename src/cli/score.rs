//! `nexttoken score`: a text (or a continuation after `--after`) scored by the chain rule.

use clap::Args;
use serde_json::json;

use nexttoken::generate::{self, prompt_ids};
use nexttoken::{LanguageModel, Result, Vocab};

use super::load::ModelArgs;

#[derive(Args)]
pub(crate) struct ScoreArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[arg(long)]
    pub(crate) text: String,
}

pub(crate) fn score_with<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    args: &ScoreArgs,
) -> Result<()> {
    let ids = prompt_ids(model.bos_token(), vocab, &args.text)?;
    let score = generate::score(model, &ids)?;
    let tokens: Vec<_> = ids[1..]
        .iter()
        .zip(&score.token_logprobs)
        .map(|(&id, &lp)| (id, vocab.token_text(id), lp))
        .collect();
    if args.model.json {
        let list: Vec<_> = tokens
            .iter()
            .zip(generate::scored_pieces(vocab, &ids))
            .map(|((id, text, lp), piece)| json!({"id": id, "token": text, "piece": piece, "prob": lp.exp(), "logprob": lp}))
            .collect();
        // With `text` and `model`, a line <next-token view="score" replay> can show.
        println!(
            "{}",
            json!({"text": args.text, "model": args.model.describe(), "tokens": list, "logprob": score.total_logprob, "avg_nll": score.avg_nll, "perplexity": score.perplexity})
        );
    } else {
        for (id, text, lp) in &tokens {
            println!("{id:>7} {text:<20} p = {:.6}  log p = {lp:.4}", lp.exp());
        }
        println!("logprob {:.4}", score.total_logprob);
        println!("avg_nll {:.4}", score.avg_nll);
        println!("perplexity {:.4}", score.perplexity);
    }
    Ok(())
}
