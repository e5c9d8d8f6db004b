//! Arrow utilities every layer shares: what an array's buffers cost, questions about nested
//! types, and copies of arrays into buffers of their own (large ones over several cores).
//!
//! They sit below `backend`, `store` and `flight` alike, so the Flight decoder and the DoGet
//! encoder need not import the backend for a helper about Arrow arrays.

mod owned;
mod parallel;
mod size;
mod types;

pub(crate) use owned::{batch_owns_its_allocations, compact_views, owned, owns_its_buffers};
pub(crate) use parallel::{copied_array, copies_as_is, copy_all};
pub use size::{array_bytes, array_count, batch_bytes, schema_bytes, type_array_count};
pub use types::contains;
