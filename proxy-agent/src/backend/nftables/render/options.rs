//! What the nftables ruleset depends on besides the services: the node's
//! facts both rule-based modes take (`RuleOptions`), and where NodePorts
//! are served.

use std::net::IpAddr;

pub use crate::backend::rule_modes::RuleOptions as Options;

/// The addresses NodePorts are served on (`nodeport-ips`), or `None` for
/// every local address but loopback (no `--nodeport-addresses` of this
/// family narrower than /0). Loopback addresses are left out, as
/// kube-proxy's nftables mode does: no localhost NodePorts.
pub fn nodeport_ips(opts: &Options) -> Option<Vec<IpAddr>> {
    if opts.nodeports_everywhere() {
        return None;
    }
    Some(
        opts.node_ips
            .iter()
            .copied()
            .filter(|ip| !ip.is_loopback())
            .filter(|ip| opts.nodeport_addresses.iter().any(|c| c.contains(*ip)))
            .collect(),
    )
}
