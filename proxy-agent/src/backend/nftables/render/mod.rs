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
    ruleset::{Applied, ElementKey, Existing, Ruleset, SyncWriter, TABLE, Transaction},
};
use crate::model::{Model, ServicePort};

/// The ruleset for `model`'s ports of `opts.family`. Of two ports claiming
/// one address and port, the first by name keeps it, as the plan decides.
pub fn render(model: &Model, opts: &Options) -> Ruleset {
    let mut ruleset = fixed(opts);
    for port in model.ports_of(opts.family) {
        ruleset.absorb(&render_port(port, opts));
    }
    ruleset
}

/// The ruleset of no service: the table's fixed part.
pub fn fixed(opts: &Options) -> Ruleset {
    Ruleset::new(opts.family, options::nodeport_ips(opts))
}

/// One port's chains, affinity sets and elements, alone.
pub fn render_port(port: &ServicePort, opts: &Options) -> Ruleset {
    let mut part = Ruleset::new(opts.family, None);
    service::write(&mut part, port, opts);
    part
}

#[cfg(test)]
mod tests;
