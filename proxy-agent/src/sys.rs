//! The few facts the agent needs from the host: where cgroup2 and bpffs are.

use std::{
    ffi::CString,
    io,
    path::{Path, PathBuf},
};

const BPF_FS_MAGIC: libc::c_long = 0xcafe_4a11;
/// Where bpffs is mounted when it is missing.
pub const BPFFS_MOUNT: &str = "/sys/fs/bpf";

/// The mount point of the cgroup v2 hierarchy, from `/proc/self/mountinfo`.
pub fn cgroup2_root() -> io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    cgroup2_root_in(&mountinfo).ok_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "no cgroup2 mount in /proc/self/mountinfo")
    })
}

/// Parses mountinfo lines: `id parent dev root mountpoint opts [optional...] - fstype source opts`.
fn cgroup2_root_in(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        let mount_point = left.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_octal(mount_point)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_octal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 4).and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(byte as char);
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn is_bpffs(path: &Path) -> io::Result<bool> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and a zeroed out-parameter.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat.f_type as libc::c_long == BPF_FS_MAGIC)
}

/// Makes sure `root` is a directory on a bpffs, mounting bpffs at
/// `/sys/fs/bpf` first when `root` lies there and nothing is mounted.
pub fn ensure_bpffs_dir(root: &Path) -> io::Result<()> {
    let existing = root.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    if !is_bpffs(existing)? {
        if !root.starts_with(BPFFS_MOUNT) {
            return Err(io::Error::other(format!(
                "{} is not on a bpf filesystem; mount one there or choose a path under {BPFFS_MOUNT}",
                root.display()
            )));
        }
        mount_bpffs(Path::new(BPFFS_MOUNT))?;
    }
    private_dir(root)
}

/// Holds `root`'s lock (`flock`) for the rest of the agent's life (its
/// descriptor stays open until the process ends); whether it was free: no
/// other agent runs on these pins. Held by another, it is taken once that
/// one exits (a thread waits for it).
pub fn hold_lock(root: &Path) -> io::Result<bool> {
    let dir = std::fs::File::open(root)?;
    match dir.try_lock() {
        Ok(()) => {
            std::mem::forget(dir);
            Ok(true)
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let wait = move || {
                if dir.lock().is_ok() {
                    std::mem::forget(dir);
                }
            };
            std::thread::Builder::new().name("pins-lock".into()).spawn(wait)?;
            Ok(false)
        }
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// Creates `dir` (and its missing parents) for root's eyes only: 0700 what
/// the umask says (under `umask 000` a directory would be 0777 and anyone
/// could unlink the pins in it).
pub fn private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Makes a file (a pin) readable and writable by its owner only, whatever
/// the umask was when it was made.
pub fn private_file(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

fn mount_bpffs(at: &Path) -> io::Result<()> {
    std::fs::create_dir_all(at)?;
    let target = CString::new(at.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: static NUL-terminated strings and a valid target path.
    let rc = unsafe {
        libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null())
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    tracing::info!(path = %at.display(), "mounted bpffs");
    Ok(())
}

/// The index of the interface `name` in this network namespace.
pub fn ifindex(name: &str) -> io::Result<u32> {
    let name = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated string.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        index => Ok(index),
    }
}

/// The node's network interfaces and their IPv4 and IPv6 addresses, in the
/// agent's network namespace (netlink-backed `getifaddrs`, not /sys, which
/// may belong to another namespace).
pub fn interfaces() -> io::Result<std::collections::BTreeMap<String, Vec<std::net::IpAddr>>> {
    let mut ifaddrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifaddrs) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = std::collections::BTreeMap::new();
    let mut cursor = ifaddrs;
    while !cursor.is_null() {
        // SAFETY: a node of the list getifaddrs returned.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        // SAFETY: ifa_name is a NUL-terminated string.
        let name =
            unsafe { std::ffi::CStr::from_ptr(entry.ifa_name) }.to_string_lossy().into_owned();
        let addrs: &mut Vec<std::net::IpAddr> = out.entry(name).or_default();
        if entry.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr of the family it names.
        match unsafe { (*entry.ifa_addr).sa_family } as i32 {
            libc::AF_INET => {
                let sin = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in) };
                addrs.push(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into());
            }
            libc::AF_INET6 => {
                let sin6 = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in6) };
                addrs.push(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr).into());
            }
            _ => {}
        }
    }
    // SAFETY: the list came from getifaddrs.
    unsafe { libc::freeifaddrs(ifaddrs) };
    Ok(out)
}

/// The interface of the IPv4 default route in the agent's network namespace
/// (`/proc/net/route` follows the reader's namespace).
pub fn default_route_interface() -> Option<String> {
    default_route_in(&std::fs::read_to_string("/proc/net/route").ok()?)
}

/// `Iface Destination Gateway Flags ...`: the default route has destination
/// 00000000 and mask 00000000; the lowest metric wins.
fn default_route_in(table: &str) -> Option<String> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (iface, dest, metric, mask) =
                (fields.first()?, fields.get(1)?, fields.get(6)?, fields.get(7)?);
            (*dest == "00000000" && *mask == "00000000")
                .then(|| (metric.parse::<u32>().unwrap_or(u32::MAX), iface.to_string()))
        })
        .min()
        .map(|(_, iface)| iface)
}

/// The cookie of this process's network namespace, as
/// `bpf_get_netns_cookie` gives it to the programs (`SO_NETNS_COOKIE`,
/// Linux 5.14+).
pub fn netns_cookie() -> io::Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    // SAFETY: a fresh socket, closed by the OwnedFd; a u64 out-parameter
    // of the size given.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut cookie = 0u64;
        let mut len = size_of::<u64>() as libc::socklen_t;
        let rc = libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cookie)
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Adds `min-max` to `net.ipv4.ip_local_reserved_ports` of the agent's
/// network namespace, so the node's own sockets never take a port the
/// datapath hands out for SNAT.
pub fn reserve_ports(min: u16, max: u16) -> io::Result<()> {
    const PATH: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";
    let current = std::fs::read_to_string(PATH)?;
    let range = format!("{min}-{max}");
    if current.split(',').any(|r| r.trim() == range) {
        return Ok(());
    }
    let value = match current.trim() {
        "" => range,
        existing => format!("{existing},{range}"),
    };
    std::fs::write(PATH, value)
}

/// `net.ipv4.ip_local_port_range`: where the node's own connections take
/// their source ports.
pub fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut ports = text.split_whitespace().map(|p| p.parse().ok());
    Some((ports.next()??, ports.next()??))
}

/// Sets a sysctl (`net/ipv4/...`, relative to /proc/sys) of the agent's
/// network namespace, if it is not set already.
pub fn set_sysctl(key: &str, value: &str) -> io::Result<()> {
    let path = Path::new("/proc/sys").join(key);
    if std::fs::read_to_string(&path)?.trim() == value {
        return Ok(());
    }
    std::fs::write(path, value)
}

/// The CPUs this process may run on (its affinity mask), as Go's
/// `runtime.NumCPU`, which kube-proxy multiplies `--conntrack-max-per-core`
/// by.
pub fn cpu_count() -> u32 {
    // SAFETY: a zeroed cpu_set_t is a valid out-parameter of its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid cpu_set_t of `size` bytes.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } == 0 {
        // SAFETY: `set` was filled by the kernel.
        (unsafe { libc::CPU_COUNT(&set) } as u32).max(1)
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
    }
}

/// Lowers the calling thread's priority by `by` nice steps (to 19 at
/// most), for work that should take only the CPU others leave; threads it
/// starts inherit it. Best effort: the work is the same either way.
pub fn lower_thread_priority(by: i32) {
    // SAFETY: no preconditions; PRIO_PROCESS with a thread id names that
    // thread on Linux.
    unsafe {
        let tid = libc::gettid() as libc::id_t;
        let nice = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (nice + by).min(19));
    }
}

/// The kernel's conntrack table: its maximum (`net.netfilter.nf_conntrack_max`
/// of the agent's network namespace) and its buckets (`nf_conntrack`'s
/// `hashsize` parameter, the node's).
pub const NF_CONNTRACK_MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
pub const NF_CONNTRACK_HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// A number a kernel file holds.
pub fn read_number(path: &str) -> io::Result<u32> {
    let text = std::fs::read_to_string(path)?;
    text.trim().parse().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Writes a number to a kernel file.
pub fn write_number(path: &str, value: u32) -> io::Result<()> {
    std::fs::write(path, value.to_string())
}

/// Hands the heap's free pages back to the kernel. Parsing the kernel's BTF
/// makes and frees hundreds of thousands of small allocations, which the
/// allocator would otherwise keep resident.
pub fn release_freed_memory() {
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Has glibc's allocator map each allocation of 128 KiB or more on its own
/// (given back whole when freed) and trim the heap's free top beyond
/// 128 KiB, for good. By default both thresholds rise after the first
/// large free, up to 32 and 64 MiB: a first sync's tables (tens of MiB)
/// were then carved from the heap and its holes stayed resident, 13 to
/// 16 MiB of the peak at 100,000 services (docs/benchmarks.md).
pub fn fix_allocator_thresholds() {
    const THRESHOLD: libc::c_int = 128 * 1024;
    for param in [libc::M_MMAP_THRESHOLD, libc::M_TRIM_THRESHOLD] {
        // SAFETY: mallopt only sets the allocator's parameters.
        unsafe {
            libc::mallopt(param, THRESHOLD);
        }
    }
}

/// Lets BPF maps be created on kernels that still charge them to
/// RLIMIT_MEMLOCK (before 5.11).
pub fn raise_memlock_rlimit() {
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: a valid rlimit struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "could not raise RLIMIT_MEMLOCK");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_agent_on_the_same_pins_finds_them_locked() {
        let root = std::env::temp_dir().join(format!("pins-lock-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        assert!(hold_lock(&root).unwrap(), "the first holds it");
        // Another open of the directory, as another process's would be.
        assert!(!hold_lock(&root).unwrap(), "the second waits for it");
        std::fs::remove_dir(&root).unwrap();
    }

    #[test]
    fn finds_the_cgroup2_mount_among_v1_mounts() {
        let mountinfo = "\
25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup ro shared:9 - tmpfs tmpfs ro,mode=755
34 33 0:29 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw,nsdelegate
35 33 0:30 / /sys/fs/cgroup/cpu rw shared:11 - cgroup cgroup rw,cpu
";
        assert_eq!(cgroup2_root_in(mountinfo), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(cgroup2_root_in("25 30 0:23 / /sys rw - sysfs sysfs rw\n"), None);
    }

    #[test]
    fn the_default_route_interface_is_found() {
        let table =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
wlan0\t00000000\t0101A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0
eth0\t00000000\t0101A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
";
        assert_eq!(default_route_in(table).as_deref(), Some("eth0"));
        assert_eq!(default_route_in("Iface\tDestination\n"), None);
    }

    #[test]
    fn mountinfo_octal_escapes_are_decoded() {
        assert_eq!(unescape_octal(r"/mnt/a\040b\134c"), r"/mnt/a b\c");
        assert_eq!(unescape_octal(r"/x\0"), r"/x\0");
    }
}
