//! `agentstack model kld`: how far a model's next-token distributions are from a base's.

use agentstack_quant::kld::{compare, load_model};
use anyhow::Context;

use crate::args::KldArgs;
use crate::{Exit, IntoUserError};

/// Runs the command.
pub async fn run(args: KldArgs) -> Result<(), Exit> {
    let base = super::resolve(&args.base).await?;
    let other = super::resolve(&args.other).await?;
    let text = std::fs::read_to_string(&args.text)
        .with_user_context(|| format!("could not read --text {}", args.text.display()))?;
    let ctx = args.ctx;
    let stats = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let b = load_model(&base).with_context(|| format!("could not load {}", base.display()))?;
        let o =
            load_model(&other).with_context(|| format!("could not load {}", other.display()))?;
        let tokens = b.tokenizer().encode(&text, false)?;
        let bar = super::steps_bar(tokens.len() / ctx.max(1), "scoring chunks");
        let s = compare(&b, &o, &tokens, ctx, &mut |done, _| {
            bar.set_position(done as u64)
        })?;
        bar.finish_and_clear();
        Ok(s)
    })
    .await
    .map_err(anyhow::Error::from)??;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&stats).map_err(anyhow::Error::from)?
        );
        return Ok(());
    }
    let s = &stats;
    println!("scored tokens     {}", s.tokens);
    println!("PPL(Q)            {:.6} ± {:.6}", s.ppl, s.ppl_unc);
    println!(
        "PPL(base)         {:.6} ± {:.6}",
        s.ppl_base, s.ppl_base_unc
    );
    println!(
        "ln(PPL(Q)/base)   {:.6} ± {:.6}",
        s.ln_ppl_ratio, s.ln_ppl_ratio_unc
    );
    println!("PPL(Q)/PPL(base)  {:.6}", s.ppl_ratio);
    println!("mean KLD          {:.6} ± {:.6}", s.kld_mean, s.kld_unc);
    println!("maximum KLD       {:.6}", s.kld_max);
    println!("99.9% KLD         {:.6}", s.kld_p999);
    println!("99.0% KLD         {:.6}", s.kld_p99);
    println!("95.0% KLD         {:.6}", s.kld_p95);
    println!("90.0% KLD         {:.6}", s.kld_p90);
    println!("median KLD        {:.6}", s.kld_median);
    println!(
        "RMS Δp            {:.3} ± {:.3} %",
        100.0 * s.delta_p_rms,
        100.0 * s.delta_p_rms_unc
    );
    println!(
        "same top p        {:.3} ± {:.3} %",
        100.0 * s.same_top,
        100.0 * s.same_top_unc
    );
    Ok(())
}
