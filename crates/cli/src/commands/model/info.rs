//! `agentstack model info`: what a model file holds.

use agentstack_model::{GgufFile, ModelInfo};
use anyhow::Context;

use crate::Exit;
use crate::args::InfoArgs;

/// Runs the command.
pub async fn run(args: InfoArgs) -> Result<(), Exit> {
    let path = super::resolve(&args.model).await?;
    let file = GgufFile::open(&path).context("could not open the model")?;
    let info = ModelInfo::from_gguf(&file).context("could not read the model's metadata")?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&info).map_err(anyhow::Error::from)?
        );
        return Ok(());
    }
    let c = &info.config;
    println!("name          {}", info.name);
    println!(
        "file          {} ({:.1} MiB)",
        info.path.display(),
        info.file_bytes as f64 / 1048576.0
    );
    println!("architecture  {}", c.architecture.as_str());
    println!("parameters    {:.1} M", info.parameters as f64 / 1e6);
    println!("layers        {}", c.layers);
    println!("hidden        {}", c.hidden_size);
    println!(
        "heads         {} (kv {}, head width {})",
        c.heads, c.kv_heads, c.head_dim
    );
    println!("ffn           {}", c.ffn_size);
    println!("vocabulary    {}", info.vocab_size);
    println!("context       {}", c.context_length);
    println!("rope theta    {}", c.rope_theta);
    println!(
        "tied output   {}",
        if info.tied_embeddings { "yes" } else { "no" }
    );
    println!(
        "chat template {}",
        if info.has_chat_template {
            "from the file"
        } else {
            "none (ChatML fallback)"
        }
    );
    println!("tensor types");
    for (dtype, count) in &info.tensor_types {
        let params = info.parameters_by_type.get(dtype).copied().unwrap_or(0);
        println!(
            "  {dtype:<6} {count:>4} tensors  {:>6.1}% of parameters",
            100.0 * params as f64 / info.parameters.max(1) as f64
        );
    }
    Ok(())
}
