//! The programs by name, as proxy-ebpf's functions are called, and the
//! hooks the per-packet ones take: what loading, attaching, pinning and
//! test runs all name.

use aya::programs::TcAttachType;

/// The socket-LB programs, by their function names in proxy-ebpf: IPv4
/// sockets, and IPv6 ones reaching IPv4 services through v4-mapped
/// addresses.
pub const PROGRAMS: [&str; 8] = [
    "connect4",
    "sendmsg4",
    "recvmsg4",
    "getpeername4",
    "connect6",
    "sendmsg6",
    "recvmsg6",
    "getpeername6",
];
/// The per-packet program, attached to the ingress of node and pod interfaces.
pub const TC_INGRESS: &str = "tc_ingress";
/// Its egress companion (replies the stack sends for translated flows).
pub const TC_EGRESS: &str = "tc_egress";
/// The ingress program of pod interfaces whose pods the socket LB covers:
/// replies of per-packet flows only.
pub const TC_POD_REPLIES: &str = "tc_pod_replies";

/// A per-packet program: its name, hook, and the prefix of its pin under
/// `links/`. Both ingress programs pin as `tc-IFACE`, so a role change
/// replaces one with the other in place.
pub(super) type TcHook = (&'static str, TcAttachType, &'static str);
pub(super) const INGRESS: TcHook = (TC_INGRESS, TcAttachType::Ingress, "tc");
pub(super) const EGRESS: TcHook = (TC_EGRESS, TcAttachType::Egress, "tc-egress");
pub(super) const POD_REPLIES: TcHook = (TC_POD_REPLIES, TcAttachType::Ingress, "tc");
/// Every per-packet program (loading, cleanup).
pub(super) const TC_PROGRAMS: [TcHook; 3] = [INGRESS, EGRESS, POD_REPLIES];

/// What the per-packet programs do on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TcRole {
    /// Translate new flows to frontends and the flows they track, both
    /// directions: node interfaces, and pod interfaces whose pods' sockets
    /// the socket LB does not all cover.
    Full,
    /// Only replies of per-packet flows, at ingress: pod interfaces whose
    /// pods' connections the socket LB translates (it covers the root
    /// cgroup for every network namespace), so a pod never sends to a
    /// frontend, and no reply the stack sends a pod was per-packet
    /// translated.
    PodReplies,
}

impl TcRole {
    pub(super) fn hooks(self) -> &'static [TcHook] {
        match self {
            TcRole::Full => &[INGRESS, EGRESS],
            TcRole::PodReplies => &[POD_REPLIES],
        }
    }

    /// The hooks the role leaves empty.
    pub(super) fn unused(self) -> impl Iterator<Item = TcHook> {
        [INGRESS, EGRESS]
            .into_iter()
            .filter(move |(_, _, prefix)| self.hooks().iter().all(|h| h.2 != *prefix))
    }
}
