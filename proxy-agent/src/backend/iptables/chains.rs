//! kube-proxy's chain names: a prefix and the first 16 characters of
//! base32(sha256(servicePortName + protocol [+ endpoint])), so operators and
//! tools find the chains they know.

use sha2::{Digest, Sha256};

use crate::model::{Protocol, ServicePortName};

/// The first 16 characters of the RFC 4648 base32 encoding of `bytes`
/// (16 characters encode exactly the first 10 bytes).
fn base32_16(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut bits: u128 = 0;
    for byte in &bytes[..10] {
        bits = (bits << 8) | *byte as u128;
    }
    (0..16).map(|i| ALPHABET[((bits >> (75 - 5 * i)) & 0x1f) as usize] as char).collect()
}

/// The first 16 characters of base32(sha256(`text`)): kube-proxy's hash of
/// a chain's identity (its nftables mode takes the first 8).
pub(crate) fn hash(text: &str) -> String {
    base32_16(&Sha256::digest(text.as_bytes()))
}

/// The per-service-port chains, which share one hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChains {
    /// `KUBE-SVC-`: all endpoints.
    pub svc: String,
    /// `KUBE-SVL-`: this node's endpoints.
    pub svl: String,
    /// `KUBE-EXT-`: external traffic (NodePort, externalIP, LB IP).
    pub ext: String,
    /// `KUBE-FW-`: loadBalancerSourceRanges.
    pub fw: String,
}

impl ServiceChains {
    pub fn new(name: &ServicePortName, protocol: Protocol) -> Self {
        let h = hash(&format!("{name}{}", protocol.lower()));
        ServiceChains {
            svc: format!("KUBE-SVC-{h}"),
            svl: format!("KUBE-SVL-{h}"),
            ext: format!("KUBE-EXT-{h}"),
            fw: format!("KUBE-FW-{h}"),
        }
    }
}

/// `KUBE-SEP-`: one endpoint of a service port (`endpoint` is `ip:port`).
pub fn endpoint_chain(name: &ServicePortName, protocol: Protocol, endpoint: &str) -> String {
    format!("KUBE-SEP-{}", hash(&format!("{name}{}{endpoint}", protocol.lower())))
}

/// The prefixes of the chains kube-proxy writes per service port and
/// endpoint; other chains are top-level and rewritten on every sync.
const SERVICE_CHAIN_PREFIXES: [&str; 5] =
    ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-"];

/// Whether `chain` is a per-service-port or per-endpoint chain.
pub fn is_service_chain(chain: &str) -> bool {
    SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spn(ns: &str, name: &str, port: &str) -> ServicePortName {
        ServicePortName::of(ns, name, port)
    }

    #[test]
    fn names_match_kube_proxy() {
        // DESIGN §4's example, and values kube-proxy's own tests use.
        assert_eq!(
            ServiceChains::new(&spn("default", "kubernetes", "https"), Protocol::Tcp).svc,
            "KUBE-SVC-NPX46M4PTMTKRN6Y"
        );
        assert_eq!(
            ServiceChains::new(&spn("ns1", "svc1", "p80"), Protocol::Tcp).svc,
            "KUBE-SVC-XPGD46QRK7WJZT7O"
        );
        let web = spn("default", "web", "http");
        let chains = ServiceChains::new(&web, Protocol::Tcp);
        assert_eq!(chains.svl, "KUBE-SVL-CDGGSHYLG3RE2FKL");
        assert_eq!(chains.fw, "KUBE-FW-CDGGSHYLG3RE2FKL");
        assert_eq!(
            endpoint_chain(&web, Protocol::Tcp, "10.244.1.2:8080"),
            "KUBE-SEP-UIQK3OSOSTRHRPBX"
        );
        assert_eq!(
            ServiceChains::new(&spn("default", "np", ""), Protocol::Tcp).ext,
            "KUBE-EXT-LDATH6LIB7VCFHLW"
        );
    }
}
