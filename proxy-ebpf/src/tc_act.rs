//! What the tc programs return to the kernel (its `TC_ACT_*` codes), shared
//! by `tc_lb` and the `reject` replies it sends.

/// Not ours: the next program (TCX) or the stack takes the packet as it is.
pub const NEXT: i32 = -1;
/// Translated, but the stack delivers it (a local address, or no route).
pub const STACK: i32 = 0;
/// Dropped.
pub const SHOT: i32 = 2;
