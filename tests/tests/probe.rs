//! `proxy-agent probe` on the machine's real kernel, which has everything the
//! eBPF mode needs: one line per feature, whole details only on request.

use proxy_lab::{sh, target_bin};

fn probe(args: &[&str]) -> String {
    assert_eq!(unsafe { libc::geteuid() }, 0, "probing loads BPF programs: run as root");
    let mut full = vec!["probe"];
    full.extend(args);
    sh(&target_bin("proxy-agent").to_string_lossy(), &full).unwrap()
}

#[test]
fn this_kernel_runs_the_ebpf_mode() {
    let out = probe(&[]);
    let table: Vec<&str> = out.lines().collect();
    assert!(table.len() >= 6, "{out}");
    for line in table.iter().filter(|l| l.contains(" ebpf ")) {
        assert!(line.contains(" yes "), "a required feature is missing: {line}");
    }
    assert!(out.contains("programs load"), "{out}");
    assert!(table.contains(&"--proxy-mode auto would run: ebpf"), "{out}");
    // Then where the programs go, and why.
    assert!(out.contains("tc_pod_replies (ingress only)"), "{out}");
    // What Maglev, DSR and XDP need, as features of their own.
    let features =
        ["Maglev (--bpf-lb-algorithm maglev)", "DSR (--bpf-lb-mode dsr|hybrid)", "XDP program"];
    for feature in features {
        let line = table.iter().find(|l| l.starts_with(feature)).unwrap_or_else(|| panic!("{out}"));
        assert!(line.contains(" optional  yes "), "{line}");
    }
    // SCTP: sockets (the development kernel has none) and the sctp match
    // (built in here), each said, never required.
    let sctp_match = std::fs::read_to_string("/proc/net/ip_tables_matches")
        .is_ok_and(|m| m.lines().any(|l| l == "sctp"));
    for (feature, expected) in [("SCTP sockets", None), ("iptables sctp match", Some(sctp_match))] {
        let line = table.iter().find(|l| l.starts_with(feature)).unwrap_or_else(|| panic!("{out}"));
        match expected {
            Some(true) => assert!(line.contains(" optional  yes "), "{line}"),
            _ => assert!(line.contains(" optional "), "{line}"),
        }
    }
}

#[test]
fn the_table_has_one_line_per_feature_and_details_wait_for_verbose() {
    let out = probe(&[]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("feature "), "{out}");
    let decision = lines.iter().position(|l| l.starts_with("--proxy-mode auto would run"));
    let features = &lines[1..decision.unwrap_or_else(|| panic!("no decision: {out}"))];
    for line in features {
        let columns: Vec<&str> = line.split_whitespace().collect();
        let needed = columns.iter().position(|c| *c == "ebpf" || *c == "optional");
        let needed = needed.unwrap_or_else(|| panic!("not a feature line: {line}\n{out}"));
        assert!(matches!(columns.get(needed + 1), Some(&"yes" | &"NO")), "{line}");
    }
    // This kernel loads everything: nothing more to show, the same table.
    let log = std::env::temp_dir().join(format!("probe-verifier-{}.log", std::process::id()));
    let verbose = probe(&["--verbose", "--verifier-log", &log.to_string_lossy()]);
    assert_eq!(verbose, out);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "");
    std::fs::remove_file(&log).unwrap();
}
