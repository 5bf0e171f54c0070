//! Where endpoints run: the (node, zone) pair of each endpoint, interned in one process-wide
//! table. A cluster has few such pairs (one per node) and 10^5 endpoints, so each endpoint
//! carries a 4-byte [`Place`] instead of two strings (`kube-proxy explain` and `/debug/services`
//! show them; no rule depends on them: locality is decided on arrival, as `is_local`).
//!
//! The table only grows. Nodes that come and go over months add a few dozen bytes each; past
//! `u32::MAX` pairs (never, in practice) new pairs are recorded as unknown.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// An endpoint's node and zone as an index into the process-wide table; `Place::default()` is
/// "neither known".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Place(u32);

/// A node name and a zone, either of which may be unknown.
type Pair = (Option<Arc<str>>, Option<Arc<str>>);

#[derive(Default)]
struct Table {
    pairs: Vec<Pair>,
    index: HashMap<Pair, u32>,
}

fn table() -> &'static Mutex<Table> {
    static TABLE: OnceLock<Mutex<Table>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Table::default();
        t.pairs.push((None, None));
        t.index.insert((None, None), 0);
        Mutex::new(t)
    })
}

impl Place {
    /// The place of an endpoint on `node` in `zone`.
    pub fn new(node: Option<&str>, zone: Option<&str>) -> Place {
        if node.is_none() && zone.is_none() {
            return Place(0);
        }
        let key: Pair = (node.map(Arc::from), zone.map(Arc::from));
        // A poisoned lock only means another thread panicked while interning; the table is
        // still consistent (entries are pushed and indexed together).
        let mut t = table().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&i) = t.index.get(&key) {
            return Place(i);
        }
        let Ok(i) = u32::try_from(t.pairs.len()) else {
            return Place(0);
        };
        t.pairs.push(key.clone());
        t.index.insert(key, i);
        Place(i)
    }

    fn pair(self) -> Pair {
        let t = table().lock().unwrap_or_else(|e| e.into_inner());
        t.pairs.get(self.0 as usize).cloned().unwrap_or((None, None))
    }

    /// The endpoint's `nodeName`, if its slice said.
    pub fn node(self) -> Option<Arc<str>> {
        self.pair().0
    }

    /// The endpoint's `zone`, if its slice said.
    pub fn zone(self) -> Option<Arc<str>> {
        self.pair().1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_pairs_share_one_place() {
        let a = Place::new(Some("node-a"), Some("zone-1"));
        let b = Place::new(Some("node-a"), Some("zone-1"));
        let c = Place::new(Some("node-a"), None);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.node().as_deref(), Some("node-a"));
        assert_eq!(a.zone().as_deref(), Some("zone-1"));
        assert_eq!(c.zone(), None);
        assert_eq!(Place::new(None, None), Place::default());
        assert_eq!(Place::default().node(), None);
    }
}
