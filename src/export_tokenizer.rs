//! `kvgate export-tokenizer`: a GGUF file's tokenizer written as tokenizer.json +
//! tokenizer_config.json, proved to encode like the file before it is announced.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct ExportTokenizerArgs {
    /// The GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Folder to write tokenizer.json and tokenizer_config.json into (created if needed).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run_export_tokenizer(a: ExportTokenizerArgs) -> Result<()> {
    let header = protocol::gguf::GgufHeader::open(&a.model)?;
    let (tokenizer, config) = protocol::gguf_tokenizer::tokenizer_files(&header)?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    for (name, doc) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
    ] {
        let path = a.out.join(name);
        std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    // Prove the folder loads and agrees with the file before saying so.
    let from_dir = protocol::tokenizer::TextTokenizer::from_dir(&a.out)?;
    let from_file = protocol::tokenizer::TextTokenizer::from_gguf(&a.model)?;
    let probe = "Hello, world! 12345 <|im_start|>user";
    if from_dir.encode(probe, true)? != from_file.encode(probe, true)? {
        bail!("the exported tokenizer does not encode like the GGUF file's");
    }
    println!(
        "wrote {} and {} ({} tokens)",
        a.out.join("tokenizer.json").display(),
        a.out.join("tokenizer_config.json").display(),
        from_dir.vocab_size()
    );
    Ok(())
}
