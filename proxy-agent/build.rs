//! Builds the BPF programs (proxy-ebpf) with nightly for bpfel-unknown-none
//! and leaves the object in OUT_DIR, where the agent embeds it.
use std::path::{Path, PathBuf};

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    // aya-build watches the BPF crate; its shared map types live next door.
    println!("cargo:rerun-if-changed=../proxy-common/src");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy-ebpf");
    // The BPF crate gets the agent's features that change the map layouts.
    let features: &[&str] =
        if std::env::var_os("CARGO_FEATURE_CT_LEAN").is_some() { &["ct-lean"] } else { &[] };
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
    // aya-build builds in a cargo target under OUT_DIR, which differs for
    // clippy, build, test and each profile: each would compile `core` and
    // the programs again (about 45 s). One directory per feature set under
    // the workspace's target makes every later build a no-op.
    let shared = shared_dir(&out_dir, features);
    std::fs::create_dir_all(&shared).context("the shared BPF build directory")?;
    share_cargo_target(&shared)?;
    // SAFETY: a build script is single-threaded; aya-build reads OUT_DIR.
    unsafe { std::env::set_var("OUT_DIR", &shared) };
    aya_build::build_ebpf(
        [aya_build::Package { name: "proxy-ebpf", root_dir: root, features, ..Default::default() }],
        aya_build::Toolchain::default(),
    )?;
    std::fs::copy(shared.join("proxy-ebpf"), out_dir.join("proxy-ebpf"))
        .context("copying the BPF object into OUT_DIR")?;
    Ok(())
}

/// Points `shared`'s `aya-build` (the cargo target aya-build compiles in)
/// at one directory for every feature set, `<target>/bpf/aya-build`: the
/// other conntrack layout's build then compiles the programs alone, not
/// `core` again (about 25 s), and each set's object stays cached there
/// (cargo keeps a unit per feature set). Each set keeps its own copy of
/// the object in `shared`. A directory left by an older build is kept.
fn share_cargo_target(shared: &Path) -> anyhow::Result<()> {
    let link = shared.join("aya-build");
    if link.symlink_metadata().is_ok() {
        return Ok(());
    }
    let common = shared.parent().context("the BPF build directory's parent")?.join("aya-build");
    std::fs::create_dir_all(&common).context("the common BPF cargo target")?;
    std::os::unix::fs::symlink(&common, &link).context("linking the common BPF cargo target")
}

/// `<target>/bpf/<features>`: OUT_DIR is `<target>/<profile>/build/<unit>/out`.
fn shared_dir(out_dir: &Path, features: &[&str]) -> PathBuf {
    let target = out_dir.ancestors().nth(4).unwrap_or(out_dir);
    let name = if features.is_empty() { "default".to_string() } else { features.join("+") };
    target.join("bpf").join(name)
}
