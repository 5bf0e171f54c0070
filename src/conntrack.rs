//! Placeholder: stale UDP conntrack cleanup (being written).
