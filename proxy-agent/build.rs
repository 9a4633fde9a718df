//! Builds the BPF programs (proxy-ebpf) with nightly for bpfel-unknown-none
//! (`proxy-ebpf-build`) and leaves the object in OUT_DIR, where the agent
//! embeds it.
use std::path::{Path, PathBuf};

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy-ebpf");
    println!("cargo:rerun-if-changed={}", root.display());
    // The BPF crate's shared map types live next door.
    println!("cargo:rerun-if-changed=../proxy-common/src");
    // The BPF crate gets the agent's features that change the map layouts.
    let features: &[&str] =
        if std::env::var_os("CARGO_FEATURE_CT_LEAN").is_some() { &["ct-lean"] } else { &[] };
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
    // OUT_DIR is `<target>/<profile>/build/<unit>/out`: the BPF build lives
    // in `<target>`, so clippy, build, test and every profile share it.
    let target = out_dir.ancestors().nth(4).context("the cargo target directory")?;
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").context("CARGO_CFG_TARGET_ARCH")?;
    let object = proxy_ebpf_build::build(&root, target, &arch, features)?;
    std::fs::copy(&object, out_dir.join("proxy-ebpf")).context("copying the BPF object")?;
    Ok(())
}
