//! `cargo xtask vmtest`: the agent's probe and a smoke subset of the lab
//! tests on Debian's LTS kernels, each booted under qemu (DESIGN §8). The
//! guest runs the host's filesystem read-only over 9p, so the agent and the
//! test binaries run unchanged; its console carries `VMTEST-` lines back.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use crate::cargo;

/// A Debian kernel the matrix boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// What `--kernel` names it.
    pub name: &'static str,
    suite: &'static str,
    /// The mode `auto` picks there: a kernel that ran the eBPF mode and
    /// falls back (a program its verifier now refuses) fails the matrix.
    auto: &'static str,
}

pub const KERNELS: [Kernel; 2] = [
    Kernel { name: "5.10", suite: "bullseye", auto: "ebpf" },
    Kernel { name: "6.1", suite: "bookworm", auto: "ebpf" },
];

/// One behaviour of the smoke subset: a `both_modes!` test of a lab test
/// binary, run as `<function>::ebpf` and `<function>::iptables`.
struct Scenario {
    id: &'static str,
    binary: &'static str,
    function: &'static str,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        id: "clusterip-tcp",
        binary: "socket_lb",
        function: "tcp_connections_spread_uniformly_over_three_endpoints",
    },
    Scenario {
        id: "clusterip-udp",
        binary: "socket_lb",
        function: "udp_replies_and_tcp_peer_show_the_cluster_ip",
    },
    Scenario {
        id: "no-endpoints-socket",
        binary: "socket_lb",
        function: "a_service_without_endpoints_refuses_at_once",
    },
    Scenario {
        id: "nodeport-snat",
        binary: "packet_lb",
        function: "node_port_cluster_policy_reaches_every_endpoint_snated_to_the_node",
    },
    Scenario {
        id: "nodeport-local",
        binary: "packet_lb",
        function: "node_port_local_policy_keeps_the_client_ip_and_drops_without_local_endpoints",
    },
    Scenario {
        id: "hairpin",
        binary: "packet_lb",
        function: "hairpin_a_pod_reaches_itself_through_its_cluster_ip",
    },
    Scenario {
        id: "no-endpoints-packet",
        binary: "packet_lb",
        function: "no_endpoints_are_refused_not_timed_out",
    },
    Scenario {
        id: "restart",
        binary: "restarts",
        function: "flows_survive_an_agent_crash_and_restart",
    },
];

/// The kernels `--kernel` names (`all`: every one).
pub fn kernels(name: &str) -> Vec<Kernel> {
    KERNELS.iter().copied().filter(|k| name == "all" || k.name == name).collect()
}

const MODES: [&str; 2] = ["ebpf", "iptables"];

/// Modules the lab uses, loaded before the tests (the kernel would also
/// request most of them on first use).
const MODULES: &[&str] = &[
    "veth",
    "bridge",
    "sch_ingress",
    "cls_bpf",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "nft_reject_ipv4",
    "nf_conntrack",
    "nf_nat",
    "xt_conntrack",
    "xt_comment",
    "xt_mark",
    "xt_statistic",
    "xt_recent",
    "xt_addrtype",
    "xt_nat",
    "xt_MASQUERADE",
    "xt_set",
    "ipt_REJECT",
    "inet_diag",
    "tcp_diag",
    "udp_diag",
];

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

/// How long one kernel's run may take under TCG.
const RUN_TIMEOUT: Duration = Duration::from_secs(60 * 60);

pub fn run(kernels: &[Kernel]) -> anyhow::Result<()> {
    let root = std::env::current_dir()?;
    let work = root.join("target/vmtest");
    let binaries = build()?;
    let cache = cache_dir();
    let mut runs = Vec::new();
    for kernel in kernels {
        let image = fetch(*kernel, &cache)?;
        let dir = work.join(kernel.name);
        std::fs::create_dir_all(&dir)?;
        let initrd = initramfs(&image, &dir)?;
        prepare_guest(&dir, &root, &binaries)?;
        let accel = accelerator(&image, &initrd, &cache)?;
        eprintln!("vmtest: booting {} ({}) under {accel}", kernel.name, image.release);
        let started = Instant::now();
        let console = boot(&image, &initrd, &dir, accel)?;
        let mut run = parse(kernel.name, &console);
        run.expected_auto = kernel.auto.to_string();
        run.seconds = started.elapsed().as_secs();
        eprintln!("vmtest: {} done in {} s", kernel.name, run.seconds);
        runs.push(run);
    }
    let table = table(&runs);
    print!("{table}");
    std::fs::write(work.join("results.md"), &table)?;
    let failed: Vec<String> = runs.iter().flat_map(Run::failures).collect();
    if !failed.is_empty() {
        bail!("vmtest failed: {}", failed.join(", "));
    }
    Ok(())
}

/// Builds the agent, the lab's binaries and its test binaries; the test
/// binaries' paths by name.
fn build() -> anyhow::Result<BTreeMap<String, PathBuf>> {
    cargo(&["build", "-p", "proxy-agent", "-p", "proxy-lab", "--bins"])?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["test", "-p", "proxy-lab", "--no-run", "--message-format=json-render-diagnostics"])
        .stderr(Stdio::inherit())
        .output()
        .context("building the lab tests")?;
    if !out.status.success() {
        bail!("building the lab tests failed ({})", out.status);
    }
    Ok(test_binaries(&String::from_utf8_lossy(&out.stdout)))
}

/// The test executables in cargo's JSON messages, by target name.
fn test_binaries(messages: &str) -> BTreeMap<String, PathBuf> {
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["kind"][0] == "test")
        .filter_map(|m| {
            let name = m["target"]["name"].as_str()?.to_string();
            Some((name, PathBuf::from(m["executable"].as_str()?)))
        })
        .collect()
}

/// `$XDG_CACHE_HOME/proxy-vmtest` (else `~/.cache/proxy-vmtest`): kernels
/// outlive `cargo clean` and are shared by worktrees.
fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
    });
    base.join("proxy-vmtest")
}

/// A kernel unpacked from its package.
struct Image {
    vmlinuz: PathBuf,
    /// The unpacked package, a root for `modprobe -d`.
    root: PathBuf,
    /// `lib/modules/<release>`, with `modules.dep`.
    modules: PathBuf,
    release: String,
}

/// The kernel's image and modules, from the cache or downloaded through a
/// private apt configuration for its suite (the host's sources untouched).
fn fetch(kernel: Kernel, cache: &Path) -> anyhow::Result<Image> {
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
fn initramfs(image: &Image, dir: &Path) -> anyhow::Result<PathBuf> {
    let staging = dir.join("initramfs");
    let _ = std::fs::remove_dir_all(&staging);
    for sub in ["bin", "modules", "proc", "sys", "dev", "host"] {
        std::fs::create_dir_all(staging.join(sub))?;
    }
    std::fs::copy("/bin/busybox", staging.join("bin/busybox")).context("busybox-static")?;
    std::os::unix::fs::symlink("busybox", staging.join("bin/sh"))?;
    let init = staging.join("init");
    std::fs::write(&init, include_str!("vmtest/init.sh"))?;
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

/// Writes what the guest reads from `dir`: its script, the plan, the
/// modules to load, and a link to the agent.
fn prepare_guest(
    dir: &Path,
    root: &Path,
    binaries: &BTreeMap<String, PathBuf>,
) -> anyhow::Result<()> {
    std::fs::write(dir.join("guest.sh"), include_str!("vmtest/guest.sh"))?;
    std::fs::write(dir.join("modules"), MODULES.join("\n") + "\n")?;
    let mut plan = String::new();
    for scenario in SCENARIOS {
        let binary = binaries
            .get(scenario.binary)
            .with_context(|| format!("no test binary {}", scenario.binary))?;
        for mode in MODES {
            let _ =
                writeln!(plan, "{} {mode} {} {}", scenario.id, binary.display(), scenario.function);
        }
    }
    std::fs::write(dir.join("plan"), plan)?;
    let agent = dir.join("proxy-agent");
    let _ = std::fs::remove_file(&agent);
    std::os::unix::fs::symlink(root.join("target/debug/proxy-agent"), agent)?;
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "KVM",
            Accel::Tcg => "TCG",
        })
    }
}

/// KVM where a guest actually boots with it (nested virtualization may
/// hang), else TCG. Decided once per host kernel and remembered.
fn accelerator(image: &Image, initrd: &Path, cache: &Path) -> anyhow::Result<Accel> {
    if !Path::new("/dev/kvm").exists() {
        return Ok(Accel::Tcg);
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let remembered = cache.join(format!("kvm-{}", host.trim()));
    if let Ok(answer) = std::fs::read_to_string(&remembered) {
        return Ok(if answer.trim() == "yes" { Accel::Kvm } else { Accel::Tcg });
    }
    eprintln!("vmtest: checking whether a guest boots with KVM");
    let mut qemu = qemu(image, initrd, Accel::Kvm, "");
    let booted = watch(&mut qemu, Duration::from_secs(30), &mut std::io::sink())?
        .iter()
        .any(|l| l.contains("VMTEST-BOOTED"));
    std::fs::write(&remembered, if booted { "yes" } else { "no" })?;
    Ok(if booted { Accel::Kvm } else { Accel::Tcg })
}

fn qemu(image: &Image, initrd: &Path, accel: Accel, cmdline: &str) -> Command {
    let mut cmd = Command::new("qemu-system-x86_64");
    match accel {
        Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => cmd.args(["-accel", "tcg,tb-size=256", "-cpu", "max"]),
    };
    // No network device: the lab makes its own namespaces inside.
    cmd.args(["-m", "2048", "-smp", "2", "-nic", "none", "-no-reboot"])
        .args(["-display", "none", "-serial", "stdio", "-monitor", "none"])
        .arg("-kernel")
        .arg(&image.vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(format!("console=ttyS0 panic=-1 quiet {cmdline}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// Boots the kernel into `guest.sh`; the console's lines (also in
/// `console.log`).
fn boot(image: &Image, initrd: &Path, dir: &Path, accel: Accel) -> anyhow::Result<Vec<String>> {
    // The workspace: the guest keeps it visible where a tmpfs covers its
    // host path (a checkout under /tmp).
    let workspace = std::env::current_dir()?.canonicalize()?;
    let cmdline = format!(
        "vmtest.run={} vmtest.dir={} vmtest.modules={} vmtest.ws={}",
        dir.join("guest.sh").display(),
        dir.display(),
        image.root.display(),
        workspace.display()
    );
    let mut qemu = qemu(image, initrd, accel, &cmdline);
    qemu.args([
        "-virtfs",
        "local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap",
    ]);
    let mut log = std::fs::File::create(dir.join("console.log"))?;
    watch(&mut qemu, RUN_TIMEOUT, &mut log)
}

/// Runs qemu until it exits (or `timeout`, then kills it); its console
/// lines, written to `log` as they come, progress lines also to stderr.
fn watch(
    qemu: &mut Command,
    timeout: Duration,
    log: &mut dyn std::io::Write,
) -> anyhow::Result<Vec<String>> {
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    let stdout = child.stdout.take().context("qemu's console")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut lines = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                let line = line.trim_end_matches('\r').to_string();
                writeln!(log, "{line}")?;
                if line.starts_with("VMTEST-RESULT")
                    || line.starts_with("VMTEST-AUTO")
                    || line.starts_with("VMTEST-ERROR")
                {
                    eprintln!("  {line}");
                }
                lines.push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                eprintln!(
                    "vmtest: the guest did not finish in {} s; stopping it",
                    timeout.as_secs()
                );
                let _ = child.kill();
                break;
            }
        }
    }
    let _ = child.wait();
    Ok(lines)
}

/// What one kernel's run reported.
#[derive(Debug, Default, PartialEq)]
struct Run {
    kernel: String,
    release: String,
    auto: String,
    /// What `auto` must pick on this kernel (empty: anything).
    expected_auto: String,
    /// The probe's missing features.
    missing: Vec<String>,
    /// (scenario, mode) → pass | retried (passed the second time) | fail |
    /// skipped, with seconds.
    results: BTreeMap<(String, String), (String, u64)>,
    done: bool,
    seconds: u64,
}

impl Run {
    /// What fails: a test, a scenario missing, or the run itself.
    fn failures(&self) -> Vec<String> {
        let mut failed = Vec::new();
        if !self.done {
            failed.push(format!("{}: the guest did not finish", self.kernel));
            if self.results.is_empty() {
                return failed;
            }
        }
        if !self.expected_auto.is_empty() && self.auto != self.expected_auto {
            failed.push(format!(
                "{}: auto picked {} where it picks {} (missing: {})",
                self.kernel,
                self.auto,
                self.expected_auto,
                self.missing.join("; ")
            ));
        }
        for scenario in SCENARIOS {
            for mode in MODES {
                match self.results.get(&(scenario.id.to_string(), mode.to_string())) {
                    Some((result, _)) if result == "fail" => {
                        failed.push(format!("{} {} {mode}", self.kernel, scenario.id))
                    }
                    // `auto`'s mode must have run.
                    Some((result, _)) if result == "skipped" && mode == self.auto => {
                        failed.push(format!("{} {} {mode} skipped", self.kernel, scenario.id))
                    }
                    Some(_) => {}
                    None => failed.push(format!("{} {} {mode} not run", self.kernel, scenario.id)),
                }
            }
        }
        failed
    }
}

/// Reads the guest's `VMTEST-` lines.
fn parse(kernel: &str, console: &[String]) -> Run {
    let mut run = Run { kernel: kernel.to_string(), ..Run::default() };
    for line in console {
        let Some(rest) = line.strip_prefix("VMTEST-") else { continue };
        let (tag, value) = rest.split_once(' ').unwrap_or((rest, ""));
        match tag {
            "KERNEL" => run.release = value.to_string(),
            "AUTO" => run.auto = value.to_string(),
            "PROBE" if value.contains(" NO ") => {
                run.missing.push(value.split("  ").next().unwrap_or(value).trim().to_string())
            }
            "RESULT" => {
                let fields: Vec<&str> = value.split_whitespace().collect();
                if let [scenario, mode, result, seconds] = fields[..] {
                    let seconds = seconds.parse().unwrap_or(0);
                    run.results.insert((scenario.into(), mode.into()), (result.into(), seconds));
                }
            }
            "DONE" => run.done = true,
            _ => {}
        }
    }
    run
}

/// The matrix as markdown: per kernel what `auto` picks and what the probe
/// found missing, then kernel × scenario × mode.
fn table(runs: &[Run]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| kernel | release | `auto` picks | probe: missing | run |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for run in runs {
        let missing =
            if run.missing.is_empty() { "nothing".to_string() } else { run.missing.join("; ") };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {missing} | {} s |",
            run.kernel, run.release, run.auto, run.seconds
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "| kernel | scenario | ebpf | iptables |");
    let _ = writeln!(out, "|---|---|---|---|");
    for run in runs {
        for scenario in SCENARIOS {
            let cell = |mode: &str| match run
                .results
                .get(&(scenario.id.to_string(), mode.to_string()))
            {
                Some((result, seconds)) if result != "skipped" => format!("{result} ({seconds} s)"),
                Some((result, _)) => result.clone(),
                None => "not run".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                run.kernel,
                scenario.id,
                cell("ebpf"),
                cell("iptables")
            );
        }
    }
    out
}

fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
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

    #[test]
    fn test_binaries_come_from_cargos_messages() {
        let messages = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"proxy_lab"},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"socket_lb"},"executable":"/w/target/debug/deps/socket_lb-1234"}
{"reason":"build-finished","success":true}"#;
        let binaries = test_binaries(messages);
        assert_eq!(binaries.len(), 1);
        assert_eq!(binaries["socket_lb"], PathBuf::from("/w/target/debug/deps/socket_lb-1234"));
    }

    fn console(results: &[(&str, &str, &str)]) -> Vec<String> {
        let mut lines = vec![
            "[    1.0] booting".to_string(),
            "VMTEST-KERNEL 5.10.0-32-amd64".to_string(),
            "VMTEST-PROBE TCX attachment (6.6+; else clsact filters)           optional  NO     kernel 5.10.223".to_string(),
            "VMTEST-PROBE BTF (kernel type information for BPF objects)       ebpf      yes    supported".to_string(),
            "VMTEST-AUTO ebpf".to_string(),
        ];
        for scenario in SCENARIOS {
            for mode in MODES {
                let result = results
                    .iter()
                    .find(|(s, m, _)| *s == scenario.id && *m == mode)
                    .map_or("pass", |(_, _, r)| *r);
                lines.push(format!("VMTEST-RESULT {} {mode} {result} 12", scenario.id));
            }
        }
        lines.push("VMTEST-DONE".to_string());
        lines
    }

    #[test]
    fn a_run_that_passes_everywhere() {
        let run = parse("5.10", &console(&[]));
        assert_eq!(run.release, "5.10.0-32-amd64");
        assert_eq!(run.auto, "ebpf");
        assert_eq!(run.missing, ["TCX attachment (6.6+; else clsact filters)"]);
        assert!(run.failures().is_empty(), "{:?}", run.failures());
        let table = table(&[run]);
        assert!(table.contains("| 5.10 | hairpin | pass (12 s) | pass (12 s) |"), "{table}");
    }

    #[test]
    fn failures_skips_of_autos_mode_and_unfinished_runs_fail() {
        let run = parse("6.1", &console(&[("hairpin", "iptables", "fail")]));
        assert_eq!(run.failures(), ["6.1 hairpin iptables"]);
        let run = parse("6.1", &console(&[("restart", "ebpf", "skipped")]));
        assert_eq!(run.failures(), ["6.1 restart ebpf skipped"]);
        let mut lines = console(&[]);
        lines.truncate(4);
        assert_eq!(parse("6.1", &lines).failures(), ["6.1: the guest did not finish"]);
        lines = console(&[("hairpin", "ebpf", "retried")]);
        lines.truncate(lines.len() - 2);
        let failures = parse("6.1", &lines).failures();
        assert_eq!(failures, ["6.1: the guest did not finish", "6.1 restart iptables not run"]);
        // A kernel that runs the eBPF mode falling back to iptables.
        let mut run = parse("6.1", &console(&[]));
        run.expected_auto = "ebpf".into();
        assert!(run.failures().is_empty());
        run.auto = "iptables".into();
        run.missing = vec!["programs load".into()];
        assert_eq!(
            run.failures(),
            ["6.1: auto picked iptables where it picks ebpf (missing: programs load)"]
        );
    }
}
