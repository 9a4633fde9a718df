//! One-bit flags of the map values (`ServiceValue::flags`,
//! `Backend::flags`).

/// Declares a set of one-bit flags stored as a plain integer (a map value's
/// field, so its bits are part of the map's layout): a named predicate per
/// flag and a builder that sets or clears it, so no side writes a mask.
macro_rules! flags {
    ($(#[$doc:meta])* $name:ident($bits:ty) {
        $($(#[$fdoc:meta])* $bit:literal: $is:ident, $with:ident;)*
    }) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name {
            bits: $bits,
        }

        impl $name {
            /// No flag set.
            pub const EMPTY: Self = Self { bits: 0 };

            $(
                $(#[$fdoc])*
                #[doc = concat!("\n\nBit ", stringify!($bit), ".")]
                pub const fn $is(self) -> bool {
                    self.bits & (1 << $bit) != 0
                }

                #[doc = concat!("These flags with [`Self::", stringify!($is), "`] as `on` says.")]
                pub const fn $with(self, on: bool) -> Self {
                    let bit: $bits = 1 << $bit;
                    Self { bits: if on { self.bits | bit } else { self.bits & !bit } }
                }
            )*
        }
    };
}

flags!(
    /// `ServiceValue::flags`: how the programs treat a frontend.
    ServiceFlags(u16) {
        /// The service has `sessionAffinity: ClientIP`.
        0: is_affinity, with_affinity;
        /// A NodePort, externalIP or LoadBalancer frontend; with
        /// `externalTrafficPolicy: Cluster` its clients are SNATed to the node.
        1: is_external, with_external;
        /// The traffic policy of this frontend is Local: only local backends,
        /// and the client address is kept.
        2: is_local_only, with_local_only;
        /// With no backend, drop (policy Local with endpoints elsewhere)
        /// instead of rejecting (no endpoints at all), as kube-proxy does.
        3: drops_when_empty, with_drop_when_empty;
        /// Only sources in `SOURCE_RANGES` for this frontend may connect
        /// (loadBalancerSourceRanges).
        4: has_source_ranges, with_source_ranges;
        /// On a `SCOPE_EXTERNAL` frontend: an internal-scope frontend at the
        /// same address serves in-cluster clients (Cilium's "two scopes").
        5: has_two_scopes, with_two_scopes;
        /// No endpoint is ready: the backends are the serving, terminating
        /// ones (kube-proxy's fallback); only the decision records read it.
        6: serves_terminating, with_serves_terminating;
        /// New flows pick their backend from the frontend's Maglev table
        /// (`MAGLEV`), by a hash of their tuple, rather than at random: every
        /// node picks the same backend for a flow.
        7: uses_maglev, with_maglev;
        /// New flows to a backend on another node are sent there by direct
        /// server return (`dsr`): the client's address kept, the service
        /// carried in an IP option, the replies sent from the backend's
        /// node. Its replies come back through this node otherwise.
        8: is_dsr, with_dsr;
    }
);

flags!(
    /// `Backend::flags`: where the endpoint is.
    BackendFlags(u8) {
        /// The endpoint runs on this node (`--hostname-override`).
        0: is_local, with_local;
        /// The endpoint is one of this node's own addresses (a host-network
        /// pod): per packet it is reached through the stack, unSNATed.
        1: is_host, with_host;
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_keep_their_bits() {
        // The bits are part of the SERVICES and BACKENDS layouts.
        // SAFETY: both types are repr(transparent) over the integer.
        let svc = |f: ServiceFlags| unsafe { core::mem::transmute::<ServiceFlags, u16>(f) };
        let backend = |f: BackendFlags| unsafe { core::mem::transmute::<BackendFlags, u8>(f) };
        let e = ServiceFlags::EMPTY;
        let each = [
            e.with_affinity(true),
            e.with_external(true),
            e.with_local_only(true),
            e.with_drop_when_empty(true),
            e.with_source_ranges(true),
            e.with_two_scopes(true),
            e.with_serves_terminating(true),
            e.with_maglev(true),
            e.with_dsr(true),
        ];
        assert_eq!(each.map(svc), [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        let b = BackendFlags::EMPTY;
        assert_eq!([b.with_local(true), b.with_host(true)].map(backend), [1, 2]);

        let f = e.with_external(true).with_local_only(true).with_drop_when_empty(true);
        assert!(f.is_external() && f.is_local_only() && f.drops_when_empty());
        assert!(!f.is_affinity() && !f.has_source_ranges() && !f.has_two_scopes());
        assert_eq!(f.with_local_only(false), e.with_external(true).with_drop_when_empty(true));
        assert_eq!(ServiceFlags::default(), e);
    }
}
