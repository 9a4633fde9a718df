//! What the agent keeps of a frontend for operators (`FRONTEND_INFO`).

/// Bytes of a frontend's service port name, `namespace/name:port`: 63 + 1
/// + 63 + 1 + 15 at most, padded.
pub const FRONTEND_NAME_LEN: usize = 148;

/// `FrontendInfo::kind`, as Kubernetes names a service's addresses.
pub const KIND_CLUSTER_IP: u8 = 0;
pub const KIND_NODE_PORT: u8 = 1;
pub const KIND_EXTERNAL_IP: u8 = 2;
pub const KIND_LOAD_BALANCER: u8 = 3;

/// Value of the frontend-info map, keyed by reverse-NAT id: what the agent
/// knows of a frontend that the programs do not need, for operators
/// (`proxy-agent lb list`, `ct list`, `bpftool map dump`). Never read by
/// the programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrontendInfo {
    pub kind: u8,
    pub name_len: u8,
    /// The frontend's IP protocol and scope (`SCOPE_*`), as its service
    /// keys hold them: with the reverse-NAT entry's address and port, a
    /// restarting agent learns which frontend each id names from this map
    /// and the reverse-NAT maps (a tenth of the service keys). 0: an agent
    /// before these were kept. Read only where the pinned `Layouts::services`
    /// is this build's: a change of this layout changes that version.
    pub proto: u8,
    pub scope: u8,
    pub name: [u8; FRONTEND_NAME_LEN],
}

impl FrontendInfo {
    /// `name` cut to [`FRONTEND_NAME_LEN`] bytes (at a character boundary).
    pub fn new(kind: u8, name: &str) -> Self {
        let mut end = name.len().min(FRONTEND_NAME_LEN);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut info = FrontendInfo {
            kind,
            name_len: end as u8,
            proto: 0,
            scope: 0,
            name: [0; FRONTEND_NAME_LEN],
        };
        info.name[..end].copy_from_slice(&name.as_bytes()[..end]);
        info
    }

    /// With the frontend's protocol and scope.
    pub const fn with_key(self, proto: u8, scope: u8) -> Self {
        FrontendInfo { proto, scope, ..self }
    }

    pub fn name(&self) -> &str {
        let len = (self.name_len as usize).min(FRONTEND_NAME_LEN);
        core::str::from_utf8(&self.name[..len]).unwrap_or("?")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontend_names_are_kept_whole_or_cut_at_a_character() {
        let info = FrontendInfo::new(KIND_NODE_PORT, "default/web:http");
        assert_eq!((info.kind, info.name()), (KIND_NODE_PORT, "default/web:http"));
        // 147 bytes, then a 2-byte character across the limit.
        let mut long = [b'n'; FRONTEND_NAME_LEN + 1];
        long[FRONTEND_NAME_LEN - 1..].copy_from_slice("é".as_bytes());
        let long = core::str::from_utf8(&long).unwrap();
        assert_eq!(FrontendInfo::new(0, long).name(), &long[..FRONTEND_NAME_LEN - 1]);
    }
}
