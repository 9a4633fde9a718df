//! `proxy-agent probe`: what the kernel can run, as a table; the whole
//! details (a verifier log) on request.

use anyhow::Context as _;

use crate::{backend::probe, cli::ProbeArgs};

pub fn run(args: &ProbeArgs) -> anyhow::Result<()> {
    let features = probe::run(probe::Reach::All);
    print!("{}", probe::report(&features));
    let details = probe::details(&features);
    if args.verbose && !details.is_empty() {
        print!("\n{details}");
    }
    if let Some(path) = &args.verifier_log {
        std::fs::write(path, &details).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
