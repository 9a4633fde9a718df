//! The ruleset kube-proxy's nftables mode writes, from our model. Pure
//! code.
//!
//! Same table (`ip kube-proxy`, `ip6 kube-proxy`), chains, sets, maps,
//! rules and element comments as kube-proxy's, so an operator can diff it
//! against a kube-proxy node. A service is found by one lookup in a
//! verdict map (`service-ips`, `service-nodeports`) whatever the number of
//! services, and its endpoint by `numgen random mod N` in a verdict map:
//! no rule is walked per service. One ruleset per IP family, as kube-proxy
//! runs one proxier per family.

mod names;
mod options;
mod ruleset;
mod service;

pub use self::{
    names::{is_affinity_set, is_service_chain},
    options::Options,
    ruleset::{Applied, ElementKey, Existing, Ruleset, TABLE, Transaction},
};
use crate::model::{Model, ServicePort};

/// The ruleset for `model`'s ports of `opts.family`. Of two ports claiming
/// one address and port, the first by name keeps it, as the plan decides.
pub fn render(model: &Model, opts: &Options) -> Ruleset {
    render_parts(model, opts).0
}

/// The ruleset, each port's part of it (by name) and whether two ports
/// claim one element (then a port's part alone does not say what it
/// holds).
pub fn render_parts<'m>(
    model: &'m Model,
    opts: &Options,
) -> (Ruleset, Vec<(&'m ServicePort, Ruleset)>, bool) {
    let mut ruleset = Ruleset::new(opts.family, options::nodeport_ips(opts));
    let mut parts = Vec::new();
    let mut conflicts = false;
    for port in model.ports_of(opts.family) {
        let part = render_port(port, opts);
        conflicts |= ruleset.absorb(&part);
        parts.push((port, part));
    }
    (ruleset, parts, conflicts)
}

/// One port's chains, affinity sets and elements, alone.
pub fn render_port(port: &ServicePort, opts: &Options) -> Ruleset {
    let mut part = Ruleset::new(opts.family, None);
    service::write(&mut part, port, opts);
    part
}

#[cfg(test)]
mod tests;
