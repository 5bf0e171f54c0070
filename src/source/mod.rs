//! Where Services, EndpointSlices, the Node and ServiceCIDRs come from: a directory of
//! manifests ([`manifests`]) or the Kubernetes API ([`api`]). Both convert objects to the
//! model's entries as they arrive and hand the daemon object-level [`Change`]s in
//! [`Update`]s, over a channel, from a task or thread of their own; the daemon applies them to
//! its state builder (the one place where a change is detected, see `model::store`).
//!
//! A source never withdraws objects because it cannot read them: a bad edit or an API server
//! that is away produces no update, so the rules stay as they are.

pub mod api;
pub mod decode;
pub mod manifests;
pub mod status;

use tokio::sync::mpsc;

pub use crate::model::store::Change;
pub use status::{SourceHealth, SourceStatus};

/// One batch of changes from a source.
#[derive(Debug, Default)]
pub struct Update {
    pub changes: Vec<Change>,
    /// Services and EndpointSlices have each been listed completely at least once (upstream's
    /// `isInitialized`): the daemon syncs nothing before that.
    pub synced: bool,
}

/// A source at work. Updates arrive on `updates` until the source stops for good (the
/// receiver then yields `None`); dropping this stops it.
pub struct Running {
    pub updates: mpsc::UnboundedReceiver<Update>,
    /// Whether it reaches its objects (the API source reports failing watches).
    pub status: SourceStatus,
    /// Whatever keeps the source alive (watcher, runtime, thread handle).
    _guard: Box<dyn Send>,
}

impl Running {
    /// A running source delivering on `updates`, kept alive by `guard`.
    pub fn new(updates: mpsc::UnboundedReceiver<Update>, status: SourceStatus, guard: impl Send + 'static) -> Running {
        Running {
            updates,
            status,
            _guard: Box::new(guard),
        }
    }
}

/// A source that can be started.
pub trait Source {
    /// Starts delivering updates for the node `node_name` (which decides endpoint locality).
    fn start(self: Box<Self>, node_name: &str) -> anyhow::Result<Running>;
}
