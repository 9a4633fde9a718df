//! Builds the BPF programs (proxy-ebpf) with nightly for bpfel-unknown-none
//! and leaves the object in OUT_DIR, where the agent embeds it.
fn main() -> anyhow::Result<()> {
    // aya-build watches the BPF crate; its shared map types live next door.
    println!("cargo:rerun-if-changed=../proxy-common/src");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../proxy-ebpf");
    // The BPF crate gets the agent's features that change the map layouts.
    let features: &[&str] =
        if std::env::var_os("CARGO_FEATURE_CT_LEAN").is_some() { &["ct-lean"] } else { &[] };
    aya_build::build_ebpf(
        [aya_build::Package { name: "proxy-ebpf", root_dir: root, features, ..Default::default() }],
        aya_build::Toolchain::default(),
    )
}
