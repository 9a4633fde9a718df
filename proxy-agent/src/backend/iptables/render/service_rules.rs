//! The chains and rules of one service port, in kube-proxy's order.

use super::{options::Options, ruleset::Table};
use crate::{
    backend::{
        categorize::Categorized,
        iptables::chains::{ServiceChains, endpoint_chain},
    },
    model::{Endpoint, ServicePort},
};

/// A comment as kube-proxy writes it: quoted when it has spaces.
fn comment(text: &str) -> String {
    if text.contains(' ') { format!("\"{text}\"") } else { text.to_string() }
}

/// kube-proxy's statistic probability for the i-th of the last `left` rules.
pub(super) fn probability(left: usize) -> String {
    format!("{:.10}", 1.0 / left as f64)
}

/// The rules of one service port: which chains it needs, and their rules.
pub(super) struct ServiceRules<'a> {
    port: &'a ServicePort,
    opts: &'a Options,
    large: bool,
    name: String,
    proto: &'static str,
    chains: ServiceChains,
    endpoints: Categorized<'a>,
}

impl<'a> ServiceRules<'a> {
    pub(super) fn new(port: &'a ServicePort, opts: &'a Options, large: bool) -> Self {
        ServiceRules {
            port,
            opts,
            large,
            name: port.name.to_string(),
            proto: port.protocol.lower(),
            chains: ServiceChains::new(&port.name, port.protocol),
            endpoints: Categorized::new(port, &opts.node_name, opts.zone.as_deref()),
        }
    }

    fn has_endpoints(&self) -> bool {
        self.endpoints.has_endpoints()
    }

    fn has_internal(&self) -> bool {
        self.endpoints.has_internal()
    }

    fn has_external(&self) -> bool {
        self.endpoints.has_external()
    }

    fn uses_svc(&self) -> bool {
        self.endpoints.uses_cluster_chain()
    }

    fn uses_svl(&self) -> bool {
        self.endpoints.uses_local_chain()
    }

    fn uses_ext(&self) -> bool {
        self.endpoints.uses_external_chain()
    }

    fn uses_fw(&self) -> bool {
        self.has_endpoints()
            && !self.port.load_balancer_ips().is_empty()
            && !self.port.source_ranges().is_empty()
    }

    fn internal_chain(&self) -> &str {
        if self.port.internal_local { &self.chains.svl } else { &self.chains.svc }
    }

    /// `-m tcp -p tcp -d IP --dport PORT`.
    fn dest<'b>(&'b self, ip: &'b str, port: &'b str) -> [&'b str; 8] {
        ["-m", self.proto, "-p", self.proto, "-d", ip, "--dport", port]
    }

    pub(super) fn write(&self, filter: &mut Table, nat: &mut Table) {
        self.write_filter(filter);
        if !self.has_endpoints() {
            return;
        }
        let seps = self.endpoints.reachable();
        if self.uses_ext() {
            nat.chain(&self.chains.ext);
        }
        if self.uses_fw() {
            nat.chain(&self.chains.fw);
        }
        if self.uses_svc() {
            nat.chain(&self.chains.svc);
        }
        if self.uses_svl() {
            nat.chain(&self.chains.svl);
        }
        for e in &seps {
            nat.chain(&endpoint_chain(&self.port.name, self.port.protocol, &e.addr.to_string()));
        }
        self.write_nat(nat, &seps);
    }

    fn write_filter(&self, filter: &mut Table) {
        let s = &self.name;
        let port = self.port.port.to_string();
        let (target, why) = if self.has_endpoints() {
            ("DROP", format!("\"{s} has no local endpoints\""))
        } else {
            ("REJECT", format!("\"{s} has no endpoints\""))
        };
        if !self.has_internal() {
            let cip = self.port.cluster_ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &why];
            words.extend(self.dest(&cip, &port));
            words.extend(["-j", target]);
            filter.rule("KUBE-SERVICES", &words);
        }
        let external = !self.has_external();
        for ip in self.port.external_ips() {
            if external {
                let ip = ip.to_string();
                let mut words = vec!["-m", "comment", "--comment", &why];
                words.extend(self.dest(&ip, &port));
                words.extend(["-j", target]);
                filter.rule("KUBE-EXTERNAL-SERVICES", &words);
            }
        }
        // All the firewall drops, then the no-endpoint rules, as kube-proxy.
        if self.uses_fw() {
            let not_accepted = format!("\"{s} traffic not accepted by {}\"", self.chains.fw);
            for ip in self.port.load_balancer_ips() {
                let ip = ip.to_string();
                let mut words = vec!["-m", "comment", "--comment", &not_accepted];
                words.extend(self.dest(&ip, &port));
                words.extend(["-j", "DROP"]);
                filter.rule("KUBE-PROXY-FIREWALL", &words);
            }
        }
        for ip in self.port.load_balancer_ips().iter().filter(|_| external) {
            let ip = ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &why];
            words.extend(self.dest(&ip, &port));
            words.extend(["-j", target]);
            filter.rule("KUBE-EXTERNAL-SERVICES", &words);
        }
        if let (Some(node_port), true) = (self.port.node_port, external) {
            let node_port = node_port.to_string();
            filter.rule(
                "KUBE-EXTERNAL-SERVICES",
                &[
                    "-m",
                    "comment",
                    "--comment",
                    &why,
                    "-m",
                    "addrtype",
                    "--dst-type",
                    "LOCAL",
                    "-m",
                    self.proto,
                    "-p",
                    self.proto,
                    "--dport",
                    &node_port,
                    "-j",
                    target,
                ],
            );
        }
        if let Some(hc) = self.port.health_check_node_port {
            let hc = hc.to_string();
            let what = format!("\"{s} health check node port\"");
            filter.rule(
                "KUBE-NODEPORTS",
                &[
                    "-m",
                    "comment",
                    "--comment",
                    &what,
                    "-m",
                    "tcp",
                    "-p",
                    "tcp",
                    "--dport",
                    &hc,
                    "-j",
                    "ACCEPT",
                ],
            );
        }
    }

    fn write_nat(&self, nat: &mut Table, seps: &[&Endpoint]) {
        let s = &self.name;
        let c = &self.chains;
        let port = self.port.port.to_string();
        let cip = self.port.cluster_ip.to_string();
        let cluster_ip = format!("\"{s} cluster IP\"");
        if self.has_internal() {
            let mut words = vec!["-m", "comment", "--comment", &cluster_ip];
            words.extend(self.dest(&cip, &port));
            words.extend(["-j", self.internal_chain()]);
            nat.rule("KUBE-SERVICES", &words);
        }
        let external_ip = format!("\"{s} external IP\"");
        for ip in self.port.external_ips() {
            let ip = ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &external_ip];
            words.extend(self.dest(&ip, &port));
            words.extend(["-j", &c.ext]);
            nat.rule("KUBE-SERVICES", &words);
        }
        let lb_ip = format!("\"{s} loadbalancer IP\"");
        let lb_target = if self.uses_fw() { &c.fw } else { &c.ext };
        for ip in self.port.load_balancer_ips() {
            let ip = ip.to_string();
            let mut words = vec!["-m", "comment", "--comment", &lb_ip];
            words.extend(self.dest(&ip, &port));
            words.extend(["-j", lb_target]);
            nat.rule("KUBE-SERVICES", &words);
        }
        if let Some(node_port) = self.port.node_port {
            let node_port = node_port.to_string();
            let bare = comment(s);
            if self.opts.localhost_nodeports() && self.opts.nfacct {
                nat.rule(
                    "KUBE-NODEPORTS",
                    &[
                        "-m",
                        "comment",
                        "--comment",
                        &bare,
                        "-m",
                        self.proto,
                        "-p",
                        self.proto,
                        "-d",
                        "127.0.0.0/8",
                        "--dport",
                        &node_port,
                        "-m",
                        "nfacct",
                        "--nfacct-name",
                        "localhost_nps_accepted_pkts",
                        "-j",
                        &c.ext,
                    ],
                );
            }
            nat.rule(
                "KUBE-NODEPORTS",
                &[
                    "-m",
                    "comment",
                    "--comment",
                    &bare,
                    "-m",
                    self.proto,
                    "-p",
                    self.proto,
                    "--dport",
                    &node_port,
                    "-j",
                    &c.ext,
                ],
            );
        }
        if self.has_internal() {
            let cidr = self.opts.cluster_cidr.map(|c| c.to_string());
            let mut words = vec!["-m", "comment", "--comment", &cluster_ip];
            words.extend(self.dest(&cip, &port));
            let masquerade = match (&cidr, self.opts.masquerade_all) {
                (_, true) => true,
                (Some(cidr), false) => {
                    words.extend(["!", "-s", cidr]);
                    true
                }
                (None, false) => false,
            };
            if masquerade {
                words.extend(["-j", "KUBE-MARK-MASQ"]);
                nat.rule(self.internal_chain(), &words);
            }
        }
        if self.uses_ext() {
            self.write_ext(nat);
        }
        if self.uses_fw() {
            for range in self.port.source_ranges() {
                let range = range.to_string();
                nat.rule(
                    &c.fw,
                    &["-m", "comment", "--comment", &lb_ip, "-s", &range, "-j", &c.ext],
                );
            }
            // kube-proxy checks its primary node IP only.
            let admits_node =
                self.opts.node_ips.first().is_some_and(|node| {
                    self.port.source_ranges().iter().any(|r| r.contains(*node))
                });
            if admits_node {
                for ip in self.port.load_balancer_ips() {
                    let ip = ip.to_string();
                    nat.rule(
                        &c.fw,
                        &["-m", "comment", "--comment", &lb_ip, "-s", &ip, "-j", &c.ext],
                    );
                }
            }
            let dropped =
                format!("\"other traffic to {s} will be dropped by KUBE-PROXY-FIREWALL\"");
            nat.rule(&c.fw, &["-m", "comment", "--comment", &dropped]);
        }
        if self.uses_svc() {
            self.write_balancer(nat, &c.svc, &self.endpoints.cluster);
        }
        if self.uses_svl() {
            self.write_balancer(nat, &c.svl, &self.endpoints.local);
        }
        for e in seps {
            self.write_endpoint(nat, e);
        }
    }

    fn write_ext(&self, nat: &mut Table) {
        let s = &self.name;
        let c = &self.chains;
        if !self.port.external_local {
            let why = format!("\"masquerade traffic for {s} external destinations\"");
            nat.rule(&c.ext, &["-m", "comment", "--comment", &why, "-j", "KUBE-MARK-MASQ"]);
            nat.rule(&c.ext, &["-j", &c.svc]);
            return;
        }
        if let Some(cidr) = self.opts.cluster_cidr {
            let cidr = cidr.to_string();
            let why = format!("\"pod traffic for {s} external destinations\"");
            nat.rule(&c.ext, &["-m", "comment", "--comment", &why, "-s", &cidr, "-j", &c.svc]);
        }
        // kube-proxy's pair for traffic from the node itself: masquerade,
        // then the cluster-wide chain.
        for (what, target) in [("masquerade", "KUBE-MARK-MASQ"), ("route", c.svc.as_str())] {
            let why = format!("\"{what} LOCAL traffic for {s} external destinations\"");
            let words = ["-m", "comment", "--comment", &why, "-m", "addrtype", "--src-type"];
            nat.rule(&c.ext, &[&words[..], &["LOCAL", "-j", target]].concat());
        }
        if self.has_external() {
            nat.rule(&c.ext, &["-j", &c.svl]);
        }
    }

    /// Affinity checks, then one statistic rule per endpoint (the last
    /// without a match), in `chain`.
    fn write_balancer(&self, nat: &mut Table, chain: &str, endpoints: &[&Endpoint]) {
        let seps: Vec<(String, String)> = endpoints
            .iter()
            .map(|e| {
                let ep = e.addr.to_string();
                (endpoint_chain(&self.port.name, self.port.protocol, &ep), ep)
            })
            .collect();
        let commented = |ep: &str| -> Vec<String> {
            if self.large {
                Vec::new()
            } else {
                ["-m", "comment", "--comment"]
                    .map(String::from)
                    .into_iter()
                    .chain([format!("\"{} -> {ep}\"", self.name)])
                    .collect()
            }
        };
        if let Some(timeout) = self.port.affinity_timeout_secs {
            for (sep, ep) in &seps {
                let mut words = commented(ep);
                words.extend(
                    ["-m", "recent", "--name", sep, "--rcheck", "--seconds"].map(String::from),
                );
                words.extend([timeout.to_string(), "--reap".into(), "-j".into(), sep.clone()]);
                nat.rule(chain, &words.iter().map(String::as_str).collect::<Vec<_>>());
            }
        }
        for (i, (sep, ep)) in seps.iter().enumerate() {
            let mut words = commented(ep);
            let left = seps.len() - i;
            if left > 1 {
                words.extend(
                    ["-m", "statistic", "--mode", "random", "--probability"].map(String::from),
                );
                words.push(probability(left));
            }
            words.extend(["-j".to_string(), sep.clone()]);
            nat.rule(chain, &words.iter().map(String::as_str).collect::<Vec<_>>());
        }
    }

    fn write_endpoint(&self, nat: &mut Table, e: &Endpoint) {
        let ep = e.addr.to_string();
        let ip = e.addr.ip().to_string();
        let sep = endpoint_chain(&self.port.name, self.port.protocol, &ep);
        let bare = comment(&self.name);
        let comment_words: Vec<&str> =
            if self.large { vec![] } else { vec!["-m", "comment", "--comment", &bare] };
        let mut hairpin = comment_words.clone();
        hairpin.extend(["-s", &ip, "-j", "KUBE-MARK-MASQ"]);
        nat.rule(&sep, &hairpin);
        let mut dnat = comment_words;
        if self.port.affinity_timeout_secs.is_some() {
            dnat.extend(["-m", "recent", "--name", &sep, "--set"]);
        }
        dnat.extend(["-m", self.proto, "-p", self.proto, "-j", "DNAT", "--to-destination", &ep]);
        nat.rule(&sep, &dnat);
    }
}
