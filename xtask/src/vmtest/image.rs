//! The guest's kernel: Debian's package, fetched once through a private apt
//! configuration and pruned to what a guest without hardware loads, and a
//! busybox initramfs that mounts the host's filesystem over 9p.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

use super::{Kernel, run_cmd};

/// The virtio bus and the 9p client, loaded by the initramfs to mount the
/// host's filesystem.
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];

/// Module directories kept from the kernel package (the rest is hardware).
const KEEP_MODULES: &[&str] = &[
    "kernel/net",
    "kernel/fs",
    "kernel/lib",
    "kernel/crypto",
    "kernel/arch",
    "kernel/drivers/virtio",
];
const KEEP_DRIVERS: &[&str] = &["veth.ko", "dummy.ko"];

/// `$XDG_CACHE_HOME/proxy-vmtest` (else `~/.cache/proxy-vmtest`): kernels
/// outlive `cargo clean` and are shared by worktrees.
pub(super) fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
    });
    base.join("proxy-vmtest")
}

/// A kernel unpacked from its package.
pub(super) struct Image {
    pub(super) vmlinuz: PathBuf,
    /// The unpacked package, a root for `modprobe -d`.
    pub(super) root: PathBuf,
    /// `lib/modules/<release>`, with `modules.dep`.
    modules: PathBuf,
    pub(super) release: String,
}

/// The kernel's image and modules, from the cache or downloaded through a
/// private apt configuration for its suite (the host's sources untouched).
pub(super) fn fetch(kernel: Kernel, cache: &Path) -> anyhow::Result<Image> {
    let dir = cache.join("kernels").join(kernel.name);
    let ready = dir.join("ready");
    if let Ok(release) = std::fs::read_to_string(&ready) {
        return Ok(image(&dir, release.trim()));
    }
    let apt = Apt::new(kernel.suite, &cache.join("apt"))?;
    apt.run("apt-get", &["update", "-q"])?;
    let names = apt.output("apt-cache", &["pkgnames", "linux-image-"])?;
    let Some(package) = newest_image(&names, kernel.name) else {
        bail!("no linux-image-{}.*-amd64-unsigned in {}", kernel.name, kernel.suite)
    };
    eprintln!("vmtest: downloading {package}");
    let debs = cache.join("debs");
    std::fs::create_dir_all(&debs)?;
    apt.run_in(&debs, "apt-get", &["download", "-q", &package])?;
    let deb = std::fs::read_dir(&debs)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{package}_")))
        })
        .context("the downloaded package")?;
    let _ = std::fs::remove_dir_all(&dir);
    let unpacked = dir.join("root");
    std::fs::create_dir_all(&unpacked)?;
    run_cmd(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    std::fs::remove_file(&deb)?;
    let release =
        package.trim_start_matches("linux-image-").trim_end_matches("-unsigned").to_string();
    prune_modules(&unpacked.join("lib/modules").join(&release))?;
    let _ = std::fs::remove_dir_all(unpacked.join("usr"));
    run_cmd(Command::new("depmod").arg("-b").arg(&unpacked).arg(&release))?;
    std::fs::write(&ready, &release)?;
    Ok(image(&dir, &release))
}

fn image(dir: &Path, release: &str) -> Image {
    let root = dir.join("root");
    Image {
        vmlinuz: root.join("boot").join(format!("vmlinuz-{release}")),
        modules: root.join("lib/modules").join(release),
        release: release.to_string(),
        root,
    }
}

/// The newest `linux-image-<version>.<abi>-amd64-unsigned` (the generic
/// flavour: the cloud one lacks 9p) among apt's package names.
fn newest_image(names: &str, version: &str) -> Option<String> {
    let prefix = format!("linux-image-{version}.");
    names
        .lines()
        .filter_map(|name| {
            let rest = name.strip_prefix(&prefix)?.strip_suffix("-amd64-unsigned")?;
            // `0-32`: patch level and ABI, digits only (not `-cloud`, `-rt`).
            let (patch, abi) = rest.split_once('-')?;
            let key = (patch.parse::<u32>().ok()?, abi.parse::<u32>().ok()?);
            Some((key, name.to_string()))
        })
        .max()
        .map(|(_, name)| name)
}

/// Keeps the modules a guest without hardware can use (about a quarter).
fn prune_modules(modules: &Path) -> anyhow::Result<()> {
    let kernel = modules.join("kernel");
    let drivers_net = kernel.join("drivers/net");
    let keep: Vec<PathBuf> = KEEP_MODULES.iter().map(|k| modules.join(k)).collect();
    for kept in KEEP_DRIVERS {
        let from = drivers_net.join(kept);
        if from.exists() {
            std::fs::rename(&from, modules.join(kept))?;
        }
    }
    let staging = modules.join("kept");
    for dir in &keep {
        let to = staging.join(dir.strip_prefix(modules)?);
        if dir.exists() {
            std::fs::create_dir_all(to.parent().context("a module directory")?)?;
            std::fs::rename(dir, &to)?;
        }
    }
    std::fs::remove_dir_all(&kernel)?;
    std::fs::rename(staging.join("kernel"), &kernel)?;
    std::fs::remove_dir_all(&staging)?;
    std::fs::create_dir_all(&drivers_net)?;
    for kept in KEEP_DRIVERS {
        let from = modules.join(kept);
        if from.exists() {
            std::fs::rename(&from, drivers_net.join(kept))?;
        }
    }
    Ok(())
}

/// apt with its own sources, lists and cache for one suite.
struct Apt {
    options: Vec<String>,
}

impl Apt {
    fn new(suite: &str, base: &Path) -> anyhow::Result<Self> {
        let dir = base.join(suite);
        for sub in ["lists/partial", "cache/archives/partial"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let sources = dir.join("sources.list");
        std::fs::write(&sources, format!("deb {} {suite} main\n", mirror()))?;
        let options = [
            format!("Dir::Etc::sourcelist={}", sources.display()),
            "Dir::Etc::sourceparts=-".to_string(),
            // Its files are root's: apt's sandbox user could not write them.
            "APT::Sandbox::User=root".to_string(),
            format!("Dir::State::Lists={}", dir.join("lists").display()),
            format!("Dir::Cache={}", dir.join("cache").display()),
        ];
        Ok(Apt { options: options.iter().flat_map(|o| ["-o".to_string(), o.clone()]).collect() })
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(program);
        cmd.args(&self.options).args(args);
        cmd
    }

    fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<()> {
        run_cmd(&mut self.command(program, args))
    }

    fn run_in(&self, dir: &Path, program: &str, args: &[&str]) -> anyhow::Result<()> {
        run_cmd(self.command(program, args).current_dir(dir))
    }

    fn output(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let out =
            self.command(program, args).output().with_context(|| format!("running {program}"))?;
        if !out.status.success() {
            bail!("{program} {args:?} failed ({})", out.status);
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// The Debian mirror the host uses (its deb822 sources), else deb.debian.org.
fn mirror() -> String {
    let sources =
        std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    sources
        .lines()
        .filter_map(|l| l.strip_prefix("URIs:"))
        .flat_map(str::split_whitespace)
        .find(|uri| !uri.contains("security"))
        .unwrap_or("http://deb.debian.org/debian")
        .to_string()
}

/// A busybox initramfs with the 9p modules (`init.sh` as /init).
pub(super) fn initramfs(image: &Image, dir: &Path) -> anyhow::Result<PathBuf> {
    let staging = dir.join("initramfs");
    let _ = std::fs::remove_dir_all(&staging);
    for sub in ["bin", "modules", "proc", "sys", "dev", "host"] {
        std::fs::create_dir_all(staging.join(sub))?;
    }
    std::fs::copy("/bin/busybox", staging.join("bin/busybox")).context("busybox-static")?;
    std::os::unix::fs::symlink("busybox", staging.join("bin/sh"))?;
    let init = staging.join("init");
    std::fs::write(&init, include_str!("init.sh"))?;
    std::fs::set_permissions(&init, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let deps = std::fs::read_to_string(image.modules.join("modules.dep")).context("modules.dep")?;
    let order = load_order(&deps, BOOT_MODULES)?;
    let mut names = String::new();
    for module in &order {
        let name = Path::new(module).file_name().context("a module name")?;
        std::fs::copy(image.modules.join(module), staging.join("modules").join(name))?;
        let _ = writeln!(names, "{}", name.to_string_lossy());
    }
    std::fs::write(staging.join("modules/order"), names)?;
    let initrd = dir.join("initrd.gz");
    run_cmd(
        Command::new("sh")
            .arg("-c")
            .arg("cd \"$1\" && find . | cpio --quiet -o -H newc | gzip -1 > \"$2\"")
            .arg("sh")
            .arg(&staging)
            .arg(&initrd),
    )?;
    std::fs::remove_dir_all(&staging)?;
    Ok(initrd)
}

/// The modules `wanted` and what they depend on, dependencies first, as
/// paths relative to the modules directory (from `modules.dep`).
fn load_order(modules_dep: &str, wanted: &[&str]) -> anyhow::Result<Vec<String>> {
    let deps: BTreeMap<&str, Vec<&str>> = modules_dep
        .lines()
        .filter_map(|line| {
            let (module, deps) = line.split_once(':')?;
            Some((module, deps.split_whitespace().collect()))
        })
        .collect();
    let by_name = |name: &str| {
        deps.keys()
            .find(|path| {
                Path::new(path)
                    .file_name()
                    .is_some_and(|f| f.to_string_lossy() == format!("{name}.ko"))
            })
            .copied()
    };
    fn visit<'a>(
        module: &'a str,
        deps: &BTreeMap<&'a str, Vec<&'a str>>,
        seen: &mut BTreeSet<&'a str>,
        order: &mut Vec<String>,
    ) {
        if !seen.insert(module) {
            return;
        }
        for dep in deps.get(module).into_iter().flatten() {
            visit(dep, deps, seen, order);
        }
        order.push(module.to_string());
    }
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for name in wanted {
        let module = by_name(name).with_context(|| format!("no module {name} in modules.dep"))?;
        visit(module, &deps, &mut seen, &mut order);
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_generic_image_of_the_version() {
        let names = "linux-image-5.10.0-30-amd64-unsigned\nlinux-image-5.10.0-32-cloud-amd64-unsigned\n\
            linux-image-5.10.0-32-amd64-unsigned\nlinux-image-5.10.0-9-amd64-unsigned\n\
            linux-image-5.10.0-32-rt-amd64-unsigned\nlinux-image-5.10.0-32-amd64\n\
            linux-image-6.1.0-50-amd64-unsigned\n";
        assert_eq!(
            newest_image(names, "5.10").as_deref(),
            Some("linux-image-5.10.0-32-amd64-unsigned")
        );
        assert_eq!(
            newest_image(names, "6.1").as_deref(),
            Some("linux-image-6.1.0-50-amd64-unsigned")
        );
        assert_eq!(newest_image(names, "6.12"), None);
    }

    #[test]
    fn modules_load_after_their_dependencies() {
        let dep = "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/netfs/netfs.ko\n\
            kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko\n\
            kernel/net/9p/9pnet.ko:\nkernel/fs/netfs/netfs.ko:\n";
        let order = load_order(dep, &["9pnet_virtio", "9p"]).unwrap();
        assert_eq!(
            order,
            [
                "kernel/net/9p/9pnet.ko",
                "kernel/net/9p/9pnet_virtio.ko",
                "kernel/fs/netfs/netfs.ko",
                "kernel/fs/9p/9p.ko"
            ]
        );
        assert!(load_order(dep, &["veth"]).is_err());
    }
}
