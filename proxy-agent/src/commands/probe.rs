//! `proxy-agent probe`: what the kernel can run, as a table.

use crate::probe;

pub fn run() -> anyhow::Result<()> {
    print!("{}", probe::report(&probe::run()));
    Ok(())
}
