//! `probattn variants`: the registry of attention variants (`probattn::normalize::registry`), as
//! a table or as JSON. `python/probattn_tools/reference/variants.json` is its `--json` output, which the Python scripts
//! read (a test keeps the two equal).

use anyhow::Result;
use clap::Args;
use probattn::normalize::registry::VARIANTS;

/// Flags of `probattn variants`.
#[derive(Args, Debug)]
pub struct VariantsArgs {
    /// Print the registry as JSON (one object per variant, every field) instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The registry as pretty JSON, newline-terminated: what `--json` prints.
pub fn registry_json() -> Result<String> {
    Ok(serde_json::to_string_pretty(VARIANTS)? + "\n")
}

/// A clap value parser of variant names: the registry's, with its error message.
pub fn parse_variant(s: &str) -> std::result::Result<probattn::Variant, String> {
    s.parse().map_err(|e: probattn::Error| e.to_string())
}

pub fn run(args: &VariantsArgs) -> Result<()> {
    if args.json {
        print!("{}", registry_json()?);
        return Ok(());
    }
    let yes = |b: bool| if b { "yes" } else { "no" };
    let mut rows: Vec<Vec<String>> = vec![];
    for s in VARIANTS {
        let p = s.properties()?;
        let family = p.family.and_then(|f| serde_json::to_value(f).ok()).and_then(|v| v.as_str().map(String::from));
        rows.push(vec![
            s.name.to_string(),
            family.unwrap_or_else(|| "other".into()),
            s.summary.to_string(),
            yes(p.causal_safe).into(),
            yes(p.stochastic).into(),
            yes(p.kl).into(),
            yes(p.memory_efficient.is_some()).into(),
            s.settings.iter().map(|x| format!("{} = {}", x.name, x.default)).collect::<Vec<_>>().join(", "),
        ]);
    }
    let header = ["variant", "family", "what it does", "causal", "samples", "KL", "memory-efficient", "settings (defaults)"];
    println!("{}", crate::report::markdown_table(&header, &rows));
    Ok(())
}
