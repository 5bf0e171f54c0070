//! The numbers that choose endpoints: each endpoint selection (the `service-`/`local-` chain of
//! a service port) owns a block of [`BLOCK`] consecutive numbers out of the 32-bit space, and
//! its chain's one rule draws `numgen random mod BLOCK offset START` and looks the number up in
//! the interval map `service-endpoints`, where each endpoint holds an equal share of the
//! block. Which endpoints there are, and how many, is then only data: a change of endpoints
//! adds and deletes map elements, which the kernel commits without validating the table
//! (a new rule or jump would make it walk every chain; see docs/nftables.md).
//!
//! A block is found by hashing the selection's name (so a restarted process mostly finds the
//! same blocks) and probing upwards from there. Pure.

use std::net::SocketAddr;

use sha2::{Digest, Sha256};

use crate::model::ServicePortName;

/// Numbers per selection: 55,440 = 2^4·3^2·5·7·11 is divisible by every count up to 12 (and
/// by 14, 15, 16, 18, 20, 21, 22, 24, 28, 30, …), so those split exactly evenly; any other
/// count N splits into shares that differ by at most one number, i.e. by at most N/55,440 of
/// an even share (0.09 % at 50 endpoints). Upstream's own `numgen random mod N` is uneven by
/// N/2^32 (the kernel scales a 32-bit random number).
pub const BLOCK: u32 = 55_440;

/// Blocks in the 32-bit space (the last number of the last block, plus one, still fits:
/// the map's interval ends are exclusive).
pub const BLOCKS: u32 = u32::MAX / BLOCK;

/// Which endpoints a selection chooses from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// `service-…`: every usable endpoint (Cluster traffic policy).
    Cluster,
    /// `local-…`: this node's endpoints (Local traffic policy).
    Local,
}

/// The blocks of one service port's selections (`None`: that selection does not exist).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortBlocks {
    pub cluster: Option<u32>,
    pub local: Option<u32>,
}

impl PortBlocks {
    pub fn get(&self, pool: Pool) -> Option<u32> {
        match pool {
            Pool::Cluster => self.cluster,
            Pool::Local => self.local,
        }
    }

    fn slot(&mut self, pool: Pool) -> &mut Option<u32> {
        match pool {
            Pool::Cluster => &mut self.cluster,
            Pool::Local => &mut self.local,
        }
    }
}

/// The first number of block `id`.
pub fn start(id: u32) -> u32 {
    id * BLOCK
}

/// The block a selection tries first.
pub fn preferred(name: &ServicePortName, pool: Pool) -> u32 {
    let pool = match pool {
        Pool::Cluster => "cluster",
        Pool::Local => "local",
    };
    let digest = Sha256::digest(format!(
        "{}/{}/{}/{}/{pool}",
        name.namespace,
        name.name,
        name.protocol.lower(),
        name.port
    ));
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u32::try_from(u64::from_be_bytes(first) % u64::from(BLOCKS)).unwrap_or(0)
}

/// Which blocks are taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks {
    used: Vec<u64>,
    count: u32,
}

impl Default for Blocks {
    fn default() -> Blocks {
        Blocks {
            used: vec![0; (BLOCKS as usize).div_ceil(64)],
            count: 0,
        }
    }
}

impl Blocks {
    fn is_used(&self, id: u32) -> bool {
        self.used[(id / 64) as usize] & (1 << (id % 64)) != 0
    }

    /// Takes the first free block from the selection's preferred one on; `None` when every
    /// block is taken.
    pub fn allocate(&mut self, name: &ServicePortName, pool: Pool) -> Option<u32> {
        if self.count >= BLOCKS {
            return None;
        }
        let mut id = preferred(name, pool);
        while self.is_used(id) {
            id = (id + 1) % BLOCKS;
        }
        self.used[(id / 64) as usize] |= 1 << (id % 64);
        self.count += 1;
        Some(id)
    }

    pub fn release(&mut self, id: u32) {
        if id < BLOCKS && self.is_used(id) {
            self.used[(id / 64) as usize] &= !(1 << (id % 64));
            self.count -= 1;
        }
    }

    /// Gives `blocks` exactly the selections in `wanted` (allocating the missing ones,
    /// releasing the others); a selection that finds no free block stays `None`.
    pub fn update(&mut self, name: &ServicePortName, blocks: &mut PortBlocks, wanted: &[Pool]) {
        for pool in [Pool::Cluster, Pool::Local] {
            let slot = blocks.slot(pool);
            match (wanted.contains(&pool), *slot) {
                (true, None) => *slot = self.allocate(name, pool),
                (false, Some(id)) => {
                    self.release(id);
                    *slot = None;
                }
                _ => {}
            }
        }
    }
}

/// The intervals of block `id` for `endpoints` (in order): endpoint `i` of `n` takes the
/// numbers `start + ⌊i·BLOCK/n⌋ ..= start + ⌊(i+1)·BLOCK/n⌋ - 1`. At most `BLOCK` endpoints
/// get a share (more would leave some with none).
pub fn shares(id: u32, endpoints: &[SocketAddr]) -> Vec<(u32, u32, SocketAddr)> {
    let n = endpoints.len().min(BLOCK as usize) as u64;
    let base = u64::from(start(id));
    let bound = |i: u64| base + i * u64::from(BLOCK) / n;
    endpoints
        .iter()
        .take(n as usize)
        .enumerate()
        .map(|(i, ep)| {
            let i = i as u64;
            let lo = u32::try_from(bound(i)).unwrap_or(u32::MAX);
            let hi = u32::try_from(bound(i + 1) - 1).unwrap_or(u32::MAX);
            (lo, hi, *ep)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn name(n: &str) -> ServicePortName {
        ServicePortName {
            namespace: "ns".into(),
            name: n.into(),
            port: "p".into(),
            protocol: Protocol::Tcp,
        }
    }

    fn eps(n: usize) -> Vec<SocketAddr> {
        (0..n)
            .map(|i| SocketAddr::from(([10, 0, (i / 250) as u8, (i % 250) as u8], 80)))
            .collect()
    }

    #[test]
    fn blocks_fit_the_32_bit_space() {
        let last = start(BLOCKS - 1) as u64 + BLOCK as u64;
        // The end element of the last interval is at `last`.
        assert!(last < u64::from(u32::MAX), "{last}");
    }

    #[test]
    fn shares_cover_the_block_exactly_and_evenly() {
        for n in [1usize, 2, 3, 7, 10, 12, 13, 50, 999] {
            let s = shares(5, &eps(n));
            assert_eq!(s.len(), n);
            assert_eq!(s[0].0, start(5));
            assert_eq!(s[n - 1].1, start(5) + BLOCK - 1);
            for w in s.windows(2) {
                assert_eq!(w[0].1 + 1, w[1].0, "n = {n}: contiguous");
            }
            let sizes: Vec<u32> = s.iter().map(|(lo, hi, _)| hi - lo + 1).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "n = {n}: {min}..{max}");
            if (BLOCK as usize).is_multiple_of(n) {
                assert_eq!(min, max, "n = {n} divides the block: exactly even");
            }
        }
        assert!(shares(0, &[]).is_empty());
    }

    #[test]
    fn allocation_prefers_the_hash_and_probes_on() {
        let mut b = Blocks::default();
        let a = b.allocate(&name("a"), Pool::Cluster).unwrap();
        assert_eq!(a, preferred(&name("a"), Pool::Cluster));
        // The same name and pool again: the next free block.
        let again = b.allocate(&name("a"), Pool::Cluster).unwrap();
        assert_eq!(again, (a + 1) % BLOCKS);
        b.release(a);
        assert_eq!(b.allocate(&name("a"), Pool::Cluster), Some(a));
        let mut pb = PortBlocks::default();
        b.update(&name("x"), &mut pb, &[Pool::Cluster, Pool::Local]);
        assert!(pb.cluster.is_some() && pb.local.is_some() && pb.cluster != pb.local);
        let local = pb.local.unwrap();
        b.update(&name("x"), &mut pb, &[Pool::Cluster]);
        assert_eq!(pb.local, None);
        assert!(!b.is_used(local));
    }

    #[test]
    fn a_full_space_gives_no_block() {
        let mut b = Blocks::default();
        for i in 0..BLOCKS {
            b.used[(i / 64) as usize] |= 1 << (i % 64);
        }
        b.count = BLOCKS;
        assert_eq!(b.allocate(&name("a"), Pool::Cluster), None);
        b.release(7);
        assert_eq!(b.allocate(&name("a"), Pool::Cluster), Some(7));
    }
}
