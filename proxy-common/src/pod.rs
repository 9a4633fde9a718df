//! `aya::Pod` for the map types, for the agent (feature `user`).

use crate::*;
// SAFETY: all types are repr(C), Copy, and have no implicit padding.
unsafe impl aya::Pod for ServiceKey {}
unsafe impl aya::Pod for ServiceValue {}
unsafe impl aya::Pod for Backend {}
unsafe impl aya::Pod for RevNat {}
unsafe impl aya::Pod for SockRevNatKey {}
unsafe impl aya::Pod for SockRevNat {}
unsafe impl aya::Pod for SockEndKey {}
unsafe impl aya::Pod for FrontendInfo {}
unsafe impl aya::Pod for FrontendStats {}
unsafe impl aya::Pod for AffinityKey {}
unsafe impl aya::Pod for AffinityValue {}
unsafe impl aya::Pod for CtKey {}
unsafe impl aya::Pod for CtEntryV1 {}
unsafe impl aya::Pod for CtEntryV2 {}
unsafe impl aya::Pod for Layouts {}
unsafe impl aya::Pod for SourceRangeKey {}
unsafe impl aya::Pod for Config {}
unsafe impl aya::Pod for FragKey {}
unsafe impl aya::Pod for FragRewrite {}
unsafe impl aya::Pod for SockFlowKey {}
unsafe impl aya::Pod for SockFlow {}
unsafe impl aya::Pod for ServiceKey6 {}
unsafe impl aya::Pod for Backend6 {}
unsafe impl aya::Pod for RevNat6 {}
unsafe impl aya::Pod for SockRevNatKey6 {}
unsafe impl aya::Pod for SockRevNat6 {}
unsafe impl aya::Pod for CtKey6 {}
unsafe impl aya::Pod for CtEntry6V1 {}
unsafe impl aya::Pod for CtEntry6V2 {}
unsafe impl aya::Pod for AffinityKey6 {}
unsafe impl aya::Pod for SourceRangeKey6 {}
unsafe impl aya::Pod for maglev::MaglevKey {}
unsafe impl aya::Pod for maglev::MaglevChunk {}
