//! Arrow utilities every layer shares: what an array's buffers cost, questions about nested
//! types, and copies of arrays into buffers of their own.
//!
//! They sit below `backend`, `store` and `flight` alike, so the Flight decoder and the DoGet
//! encoder need not import the backend for a helper about Arrow arrays.

mod owned;
mod size;
mod types;

pub(crate) use owned::{compact_views, owned, owns_its_buffers};
pub use size::{array_bytes, array_count, batch_bytes, schema_bytes, type_array_count};
pub use types::contains;
