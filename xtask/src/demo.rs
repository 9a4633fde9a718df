//! The README's main command: the example manifest served in a lab.

use anyhow::Context;
use proxy_lab::{Attempt, Lab, Mode, sh, tally};

const MANIFEST: &str = "deploy/examples/demo.yaml";
/// Pods named and addressed as the example EndpointSlice lists them.
const PODS: [(&str, &str); 3] =
    [("web-0", "10.244.1.2"), ("web-1", "10.244.1.3"), ("web-2", "10.244.1.4")];

pub fn run(mode: Mode) -> anyhow::Result<()> {
    let manifest =
        std::fs::read_to_string(MANIFEST).with_context(|| format!("reading {MANIFEST}"))?;
    let mut lab = Lab::with_mode(mode)?;
    lab.dual_stack()?;
    println!("== lab: node namespace {}, test cgroup {}", lab.node, lab.cgroup.display());
    for (name, ip) in PODS {
        let pod = lab.add_pod(name, ip)?;
        lab.serve(&pod, &[8080], &[5353])?;
        let ip6 = proxy_lab::v6(ip);
        println!("   pod {name:6} {ip:12} {ip6:15} serves TCP 8080 and UDP 5353");
    }
    let client = lab.add_pod("client", "10.244.1.100")?;
    match mode {
        Mode::Ebpf => {
            println!("   pod client 10.244.1.100 (in the test cgroup: socket LB applies)")
        }
        Mode::Iptables | Mode::Nftables => {
            println!("   pod client 10.244.1.100 (its packets meet the node's rules)")
        }
    }
    let ext = lab.add_external("ext", "192.168.100.101")?;
    println!(
        "   external client 192.168.100.101 on the node's network (the node is 192.168.100.11 and fd00:100::11)"
    );

    lab.write_manifest(&manifest)?;
    lab.start_agent(&[])?;
    println!(
        "\n== proxy-agent run --proxy-mode {} --manifests {MANIFEST} --cgroup-path {} --bpffs-root {}",
        mode.as_arg(),
        lab.cgroup.display(),
        lab.pins.display()
    );
    println!("   (in the node namespace; its log: {}/agent-0.log)", lab.dir.display());

    println!("\n== 12 HTTP requests from the client to the ClusterIP 10.96.0.10:80");
    let attempts = lab.client(&client).tcp("10.96.0.10:80", 12)?;
    for (i, attempt) in attempts.iter().enumerate() {
        match attempt {
            Attempt::Ok { name, local, from, ms, .. } => println!(
                "   #{:<2} answered by {name} at {local}; the client's socket sees its peer as {from} ({ms:.2} ms)",
                i + 1
            ),
            Attempt::Err { kind, .. } => println!("   #{:<2} failed: {kind}", i + 1),
        }
    }
    println!("   per pod: {:?}", tally(&attempts));

    println!("\n== 6 HTTP requests from the external client to the NodePort 192.168.100.11:30080");
    for (i, attempt) in lab.client_outside(&ext).tcp("192.168.100.11:30080", 6)?.iter().enumerate()
    {
        match attempt {
            Attempt::Ok { name, local, peer, ms, .. } => println!(
                "   #{:<2} answered by {name} at {local}, which saw the client as {peer} (SNAT to the node; {ms:.2} ms)",
                i + 1
            ),
            Attempt::Err { kind, .. } => println!("   #{:<2} failed: {kind}", i + 1),
        }
    }

    println!("\n== 3 UDP datagrams from the client to 10.96.0.10:53");
    for attempt in lab.client(&client).udp("10.96.0.10:53", 3)? {
        if let Attempt::Ok { name, from, .. } = attempt {
            println!("   reply from {from} (as recvmsg reports it), sent by {name} from port 5353");
        }
    }

    println!(
        "\n== 3 HTTP requests from the client to the IPv6 ClusterIP [fd00:96::10]:80 (the service is dual-stack)"
    );
    for attempt in lab.client(&client).tcp("[fd00:96::10]:80", 3)? {
        match attempt {
            Attempt::Ok { name, local, from, .. } => {
                println!(
                    "   answered by {name} at {local}; the client's socket sees its peer as {from}"
                )
            }
            Attempt::Err { kind, .. } => println!("   failed: {kind}"),
        }
    }

    println!(
        "\n== 3 HTTP requests from an IPv6 socket of the client to [::ffff:10.96.0.10]:80 (the IPv4 ClusterIP, v4-mapped, as dual-stack programs reach IPv4)"
    );
    for attempt in lab.client(&client).tcp("[::ffff:10.96.0.10]:80", 3)? {
        match attempt {
            Attempt::Ok { name, from, .. } => {
                println!("   answered by {name}; the IPv6 socket sees its peer as {from}")
            }
            Attempt::Err { kind, .. } => println!("   failed: {kind}"),
        }
    }

    println!("\n== proxy-agent lb list (what the datapath holds, read back from the kernel)");
    for line in lab.inspect_on(0, &["lb", "list"])?.lines() {
        println!("   {line}");
    }
    let explain = [
        "explain",
        "--proto",
        "tcp",
        "--from",
        "192.168.100.101:40000",
        "--to",
        "192.168.100.11:30080",
    ];
    println!(
        "\n== proxy-agent {} (what the datapath would do with that packet)",
        explain.join(" ")
    );
    for line in lab.inspect_on(0, &explain)?.lines() {
        println!("   {line}");
    }
    match mode {
        Mode::Ebpf => show_maps(&lab)?,
        Mode::Iptables => show_rules(&lab)?,
        Mode::Nftables => show_table(&lab)?,
    }
    println!("\n== the agent's metrics (curl 127.0.0.1:10249/metrics in the node namespace)");
    for line in lab.metrics()?.lines().filter(|l| !l.starts_with('#')) {
        println!("   {line}");
    }
    println!("\n== tearing the lab down");
    drop(lab);
    println!("   done: namespaces (and their rules), cgroup, pins and processes removed");
    Ok(())
}

/// One BPF map as bpftool shows it, and where the programs are attached.
fn show_maps(lab: &Lab) -> anyhow::Result<()> {
    println!("\n== bpftool map dump pinned {}/maps/BACKENDS", lab.pins.display());
    print!("{}", lab.dump_map("BACKENDS")?);
    let cgroup = lab.cgroup.to_string_lossy().into_owned();
    println!("\n== bpftool cgroup show {cgroup}");
    print!("{}", sh("bpftool", &["cgroup", "show", &cgroup])?);
    println!(
        "\n== ls {}/links (cgroup links, and the per-packet program's by interface)",
        lab.pins.display()
    );
    let links = std::fs::read_dir(lab.pins.join("links"))?;
    let mut names: Vec<String> =
        links.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    println!("   {}", names.join("  "));
    Ok(())
}

/// The service rules in the nat table, and the kernel's conntrack entries.
/// The nftables mode's IPv4 table, as `nft` lists it.
fn show_table(lab: &Lab) -> anyhow::Result<()> {
    println!("\n== nft list table ip kube-proxy (in the node namespace)");
    for line in lab.exec_on(0, "nft", &["list", "table", "ip", "kube-proxy"])?.lines() {
        println!("   {line}");
    }
    Ok(())
}

fn show_rules(lab: &Lab) -> anyhow::Result<()> {
    println!("\n== iptables-save -t nat (the KUBE- rules; in the node namespace)");
    for line in lab.exec_on(0, "iptables-save", &["-t", "nat"])?.lines() {
        if line.contains("KUBE-") {
            println!("   {line}");
        }
    }
    println!("\n== conntrack -L (in the node namespace)");
    for line in lab.exec_on(0, "conntrack", &["-L"])?.lines() {
        println!("   {line}");
    }
    Ok(())
}
