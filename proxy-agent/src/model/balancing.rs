//! How a service's external frontends balance (eBPF mode): which backend a
//! new flow gets (`--bpf-lb-algorithm`) and how it reaches a backend on
//! another node (`--bpf-lb-mode`), per node from flags and per service from
//! annotations, the project's own and Cilium's (so a cluster moving from
//! Cilium keeps its choices).

use crate::objects::{self, FORWARDING_MODE_ANNOTATIONS, LB_ALGORITHM_ANNOTATIONS};

/// A setting a service may choose by annotation, and the words it takes.
pub trait Annotated: Copy + Sized + 'static {
    /// The annotations that set it, the project's own first: the first
    /// one present decides.
    const ANNOTATIONS: [&'static str; 2];
    const ALL: &'static [Self];
    fn as_str(self) -> &'static str;

    /// A flag's or an annotation's value, in any case.
    fn parse(text: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|a| a.as_str().eq_ignore_ascii_case(text.trim()))
    }

    /// The values it takes, for messages: `a or b`.
    fn choices() -> String {
        let words: Vec<&str> = Self::ALL.iter().map(|a| a.as_str()).collect();
        words.join(" or ")
    }
}

/// How an external frontend picks the backend of a new flow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LbAlgorithm {
    /// Uniformly at random on each node, as kube-proxy.
    #[default]
    Random,
    /// From the frontend's Maglev table by a hash of the flow: every node
    /// picks the same backend, and a backend change moves few flows.
    Maglev,
}

impl Annotated for LbAlgorithm {
    const ANNOTATIONS: [&'static str; 2] = LB_ALGORITHM_ANNOTATIONS;
    const ALL: &'static [Self] = &[LbAlgorithm::Random, LbAlgorithm::Maglev];

    fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

/// How a flow to an external frontend (policy Cluster) reaches a backend
/// on another node, as a service's annotation says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ForwardingMode {
    /// Masqueraded to the node's address, its replies back through this
    /// node: kube-proxy's way.
    #[default]
    Snat,
    /// Direct server return: the client's address kept, the replies sent
    /// from the backend's node straight to the client.
    Dsr,
}

impl Annotated for ForwardingMode {
    const ANNOTATIONS: [&'static str; 2] = FORWARDING_MODE_ANNOTATIONS;
    const ALL: &'static [Self] = &[ForwardingMode::Snat, ForwardingMode::Dsr];

    fn as_str(self) -> &'static str {
        match self {
            ForwardingMode::Snat => "snat",
            ForwardingMode::Dsr => "dsr",
        }
    }
}

/// `--bpf-lb-mode`: the node's forwarding mode where a service's
/// annotation does not say; `hybrid` is DSR for TCP and SNAT for UDP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LbMode {
    #[default]
    Snat,
    Dsr,
    Hybrid,
}

impl Annotated for LbMode {
    /// A node's setting only: no annotation names it.
    const ANNOTATIONS: [&'static str; 2] = ["", ""];
    const ALL: &'static [Self] = &[LbMode::Snat, LbMode::Dsr, LbMode::Hybrid];

    fn as_str(self) -> &'static str {
        match self {
            LbMode::Snat => "snat",
            LbMode::Dsr => "dsr",
            LbMode::Hybrid => "hybrid",
        }
    }
}

impl LbMode {
    /// The forwarding of a service port of `protocol` under this mode:
    /// hybrid sends TCP direct and everything else through SNAT. SCTP goes
    /// through SNAT in every mode: the DSR option takes room from every
    /// packet, which TCP's MSS clamp makes for it and nothing makes for
    /// SCTP's (its full-size packets would no longer fit the path).
    pub fn for_protocol(self, protocol: super::vocabulary::Protocol) -> ForwardingMode {
        use super::vocabulary::Protocol;
        match (self, protocol) {
            (LbMode::Snat, _) | (_, Protocol::Sctp) | (LbMode::Hybrid, Protocol::Udp) => {
                ForwardingMode::Snat
            }
            (LbMode::Dsr, _) | (LbMode::Hybrid, Protocol::Tcp) => ForwardingMode::Dsr,
        }
    }
}

/// What a service's annotations ([`Annotated::ANNOTATIONS`]) say of a
/// setting. One byte in every port: the value of an unknown annotation is
/// not kept (the store's problem names the annotations).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Choice<T> {
    /// No annotation: the node's flag.
    #[default]
    NodeDefault,
    Annotated(T),
    /// The first annotation present has a value that is none of `T`'s:
    /// the node's default is used, and the problem reported.
    Unknown,
}

impl<T: Annotated> Choice<T> {
    /// The first of `T`'s annotations present decides.
    pub fn of(annotations: &objects::Kept) -> Self {
        let value = T::ANNOTATIONS.iter().find_map(|key| annotations.get(key));
        match value.map(T::parse) {
            None => Choice::NodeDefault,
            Some(Some(value)) => Choice::Annotated(value),
            Some(None) => Choice::Unknown,
        }
    }
}

impl<T: Copy> Choice<T> {
    /// The setting, given the node's default.
    pub fn or(self, default: T) -> T {
        match self {
            Choice::Annotated(value) => value,
            Choice::NodeDefault | Choice::Unknown => default,
        }
    }

    pub fn is_unknown(self) -> bool {
        matches!(self, Choice::Unknown)
    }
}

/// The problem of a service whose annotations of `T` have an unknown value.
pub fn unknown_value<T: Annotated>(service: &impl std::fmt::Display, flag: &str) -> String {
    let [ours, cilium] = T::ANNOTATIONS;
    format!(
        "Service {service}: annotation {ours} or {cilium} is not {}; its external frontends use the node's {flag}",
        T::choices()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    #[test]
    fn hybrid_is_dsr_for_tcp_and_snat_for_udp() {
        assert_eq!(LbMode::Hybrid.for_protocol(Protocol::Tcp), ForwardingMode::Dsr);
        assert_eq!(LbMode::Hybrid.for_protocol(Protocol::Udp), ForwardingMode::Snat);
        assert_eq!(LbMode::Hybrid.for_protocol(Protocol::Sctp), ForwardingMode::Snat);
        assert_eq!(LbMode::Dsr.for_protocol(Protocol::Sctp), ForwardingMode::Snat);
        assert_eq!(LbMode::Dsr.for_protocol(Protocol::Udp), ForwardingMode::Dsr);
        assert_eq!(LbMode::Snat.for_protocol(Protocol::Tcp), ForwardingMode::Snat);
        assert_eq!(LbMode::parse("Hybrid"), Some(LbMode::Hybrid));
        assert_eq!(ForwardingMode::choices(), "snat or dsr");
    }
}
