//! `proxy-agent probe` on the machine's real kernel, which has everything the
//! eBPF mode needs.

use proxy_lab::{sh, target_bin};

#[test]
fn this_kernel_runs_the_ebpf_mode() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "probing loads BPF programs: run as root");
    let out = sh(&target_bin("proxy-agent").to_string_lossy(), &["probe"]).unwrap();
    let table: Vec<&str> = out.lines().collect();
    assert!(table.len() >= 6, "{out}");
    for line in table.iter().filter(|l| l.contains(" ebpf ")) {
        assert!(line.contains(" yes "), "a required feature is missing: {line}");
    }
    assert!(out.contains("programs load"), "{out}");
    assert_eq!(table.last(), Some(&"--proxy-mode auto would run: ebpf"), "{out}");
}
