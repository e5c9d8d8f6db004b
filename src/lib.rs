pub mod backend;
pub mod batch_size;
pub mod config;
pub mod consumer;
pub mod error;
pub mod flight;
pub mod server;
pub mod store;
