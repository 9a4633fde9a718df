//! `cargo xtask newer-nft`: nft 1.1.3 for benchmarks, beside Debian 12's
//! 1.0.6 (which dumps every chain of the namespace before most
//! transactions; docs/nftables.md).
//!
//! Debian 12 has no newer package, and the package mirror serves no source
//! tarballs (`pool/…/*.orig.tar.xz` answers 404), so this takes Debian
//! trixie's binary packages, pinned by their sha256, and unpacks them into
//! `target/nft-1.1.3/` without installing anything. Trixie's libnftables
//! needs glibc 2.38 (Debian 12 has 2.36): `bin/nft` runs trixie's nft with
//! trixie's dynamic loader and libraries, the host's for the rest
//! (libedit, libmnl, libjansson, libxtables).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

use crate::setup::run_cmd;

pub const VERSION: &str = "1.1.3";

const MIRROR: &str = "http://deb.debian.org/debian/pool/main";

/// Trixie's packages (`apt-cache show` of each in trixie's index): nft,
/// its library and libnftnl, and the glibc and libgmp they need.
const DEBS: [(&str, &str); 5] = [
    (
        "n/nftables/nftables_1.1.3-1_amd64.deb",
        "2ddfa61baaf3a76e2c499db9e521ba6affb226f85af0b6fef739f346ac5f0c39",
    ),
    (
        "n/nftables/libnftables1_1.1.3-1_amd64.deb",
        "c7cbee3dce8452ae5c3c4269f6f52e96b896d36a46ea3c490e0e11e8ff359896",
    ),
    (
        "libn/libnftnl/libnftnl11_1.2.9-1_amd64.deb",
        "1b3eae46bfb9c6ab44e404797fb45278045f926d73974a84097ad47a3e27d983",
    ),
    (
        "g/glibc/libc6_2.41-12+deb13u5_amd64.deb",
        "b59b0625cd1a791375d40dab23a4d5d3d0641e3d0a773501becdc3725b7f99cf",
    ),
    (
        "g/gmp/libgmp10_6.3.0+dfsg-3_amd64.deb",
        "d0d0265eb01770f17afd0f7c8c0622f80479dcfbbe13653a0debeec61464e622",
    ),
];

/// The directory holding `nft` 1.1.3, fetched and unpacked when it is not
/// there yet (quick when it is).
pub fn run() -> anyhow::Result<PathBuf> {
    let dir = std::env::current_dir()?.join(format!("target/nft-{VERSION}"));
    let bin = dir.join("bin");
    if version(Some(&bin)).is_ok_and(|v| v == VERSION) {
        println!("{}", bin.display());
        return Ok(bin);
    }
    let (debs, root) = (dir.join("debs"), dir.join("root"));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&debs)?;
    std::fs::create_dir_all(&bin)?;
    for (path, sha256) in DEBS {
        let name = path.rsplit('/').next().context("a package's file name")?;
        let deb = debs.join(name);
        if !deb.exists() || sha256_of(&deb)? != sha256 {
            eprintln!("newer-nft: downloading {name}");
            run_cmd(Command::new("curl").args(["-fsSL", "-o"]).arg(&deb).arg(format!("{MIRROR}/{path}")))
                .with_context(|| format!("{name} is not on the mirror any more: pin trixie's current one (`apt-cache show` through a trixie sources list)"))?;
        }
        let got = sha256_of(&deb)?;
        if got != sha256 {
            bail!("{name}: sha256 {got}, expected {sha256}");
        }
        run_cmd(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    }
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let script = wrapper(&lib, &root.join("usr/sbin/nft"));
    let nft = bin.join("nft");
    std::fs::write(&nft, script)?;
    std::fs::set_permissions(&nft, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let got = version(Some(&bin))?;
    if got != VERSION {
        bail!("{} says version {got}, expected {VERSION}", nft.display());
    }
    println!("{}", bin.display());
    Ok(bin)
}

/// `bin/nft`: trixie's nft under trixie's loader, its libraries first.
fn wrapper(lib: &Path, nft: &Path) -> String {
    let (lib, nft) = (lib.display(), nft.display());
    format!(
        "#!/bin/sh\n# nft {VERSION} from Debian trixie (cargo xtask newer-nft): its glibc, not the host's.\nexec {lib}/ld-linux-x86-64.so.2 --library-path {lib} {nft} \"$@\"\n"
    )
}

fn sha256_of(file: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(file).output().context("running sha256sum")?;
    if !out.status.success() {
        bail!("sha256sum {} failed", file.display());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.split_whitespace().next().unwrap_or_default().to_string())
}

/// The version of the `nft` in `dir` (the one in `PATH` with `None`), as
/// `1.1.3`.
pub fn version(dir: Option<&Path>) -> anyhow::Result<String> {
    let nft = dir.map_or_else(|| PathBuf::from("nft"), |d| d.join("nft"));
    let out = Command::new(&nft)
        .arg("--version")
        .output()
        .with_context(|| format!("running {}", nft.display()))?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| format!("{} --version", nft.display()))
}

/// `nftables v1.1.3 (Commodore Bullmoose #4)` → `1.1.3`.
fn parse_version(text: &str) -> Option<String> {
    let word = text.split_whitespace().find(|w| w.starts_with('v'))?;
    Some(word.trim_start_matches('v').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_read_from_nfts_banner() {
        assert_eq!(parse_version("nftables v1.0.6 (Lester Gooch #5)\n").as_deref(), Some("1.0.6"));
        assert_eq!(
            parse_version("nftables v1.1.3 (Commodore Bullmoose #4)").as_deref(),
            Some("1.1.3")
        );
        assert_eq!(parse_version("command not found"), None);
    }
}
