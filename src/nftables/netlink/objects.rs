//! Decoding the replies of chain and set dumps into what a full sync needs to know of a table
//! that is already there: chain names and hooks, set names and signatures. Pure.

use super::wire::*;
use crate::netlink::Attrs;
use crate::nftables::backend::{ListedChain, ListedSet, SetSignature};
use crate::nftables::names::TABLE;

const NFTA_CHAIN_HOOK_ATTR: u16 = NFTA_CHAIN_HOOK;
const NFTA_SET_TIMEOUT_ATTR: u16 = NFTA_SET_TIMEOUT;

/// A chain of our table, from the attributes of one `NEWCHAIN` dump message.
pub fn chain(attrs: &[u8]) -> Option<ListedChain> {
    let a = Attrs::parse(attrs).ok()?;
    if a.str(NFTA_CHAIN_TABLE, "table").ok()?? != TABLE {
        return None;
    }
    let name = a.str(NFTA_CHAIN_NAME, "name").ok()??.to_string();
    let base = match a.nested(NFTA_CHAIN_HOOK_ATTR).ok()? {
        None => None,
        Some(hook) => {
            let num = u32::from_be_bytes(hook.raw4(NFTA_HOOK_HOOKNUM, "hooknum").ok()??);
            let prio = i32::from_be_bytes(hook.raw4(NFTA_HOOK_PRIORITY, "priority").ok()??);
            let kind = a.str(NFTA_CHAIN_TYPE, "type").ok()?.unwrap_or("filter").to_string();
            Some((kind, hook_name(num).to_string(), prio))
        }
    };
    Some(ListedChain { name, base })
}

/// A named set of our table, from the attributes of one `NEWSET` dump message (`None` for an
/// anonymous set).
pub fn set(attrs: &[u8]) -> Option<ListedSet> {
    let a = Attrs::parse(attrs).ok()?;
    if a.str(NFTA_SET_TABLE, "table").ok()?? != TABLE {
        return None;
    }
    let be32 = |ty| a.raw4(ty, "u32").ok().flatten().map(u32::from_be_bytes);
    let flags = be32(NFTA_SET_FLAGS).unwrap_or(0);
    if flags & NFT_SET_ANONYMOUS != 0 {
        return None;
    }
    let name = a.str(NFTA_SET_NAME, "name").ok()??.to_string();
    let data = if flags & NFT_SET_MAP != 0 {
        Some((
            be32(NFTA_SET_DATA_TYPE).unwrap_or(0),
            be32(NFTA_SET_DATA_LEN).unwrap_or(0),
        ))
    } else {
        None
    };
    let timeout_ms = a
        .get(NFTA_SET_TIMEOUT_ATTR)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_be_bytes);
    Some(ListedSet {
        name,
        signature: Some(SetSignature {
            // The kernel reports flags it sets itself (e.g. for concatenations); compare only
            // those a declaration sends.
            flags: flags & (NFT_SET_INTERVAL | NFT_SET_MAP | NFT_SET_TIMEOUT | NFT_SET_EVAL),
            key_type: be32(NFTA_SET_KEY_TYPE).unwrap_or(0),
            key_len: be32(NFTA_SET_KEY_LEN).unwrap_or(0),
            data,
            timeout_ms,
        }),
    })
}

fn hook_name(num: u32) -> &'static str {
    match num {
        0 => "prerouting",
        1 => "input",
        2 => "forward",
        3 => "output",
        4 => "postrouting",
        _ => "?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::MsgBuf;

    fn attrs(build: impl FnOnce(&mut MsgBuf)) -> Vec<u8> {
        let mut b = MsgBuf::default();
        build(&mut b);
        b.buf
    }

    #[test]
    fn decodes_base_and_regular_chains_of_our_table_only() {
        let base = attrs(|b| {
            b.put_str(NFTA_CHAIN_TABLE, TABLE);
            b.put_str(NFTA_CHAIN_NAME, "nat-prerouting");
            let h = b.nest_start(NFTA_CHAIN_HOOK);
            b.put_be32(NFTA_HOOK_HOOKNUM, 0);
            b.put(NFTA_HOOK_PRIORITY, &(-100i32).to_be_bytes());
            b.nest_end(h);
            b.put_str(NFTA_CHAIN_TYPE, "nat");
        });
        assert_eq!(
            chain(&base),
            Some(ListedChain {
                name: "nat-prerouting".into(),
                base: Some(("nat".into(), "prerouting".into(), -100)),
            })
        );
        let regular = attrs(|b| {
            b.put_str(NFTA_CHAIN_TABLE, TABLE);
            b.put_str(NFTA_CHAIN_NAME, "services");
        });
        assert_eq!(chain(&regular).map(|c| c.base), Some(None));
        let other = attrs(|b| {
            b.put_str(NFTA_CHAIN_TABLE, "filter");
            b.put_str(NFTA_CHAIN_NAME, "INPUT");
        });
        assert_eq!(chain(&other), None);
    }

    #[test]
    fn decodes_set_signatures_and_skips_anonymous_sets() {
        let named = attrs(|b| {
            b.put_str(NFTA_SET_TABLE, TABLE);
            b.put_str(NFTA_SET_NAME, "service-ips");
            b.put_be32(NFTA_SET_FLAGS, NFT_SET_MAP);
            b.put_be32(NFTA_SET_KEY_TYPE, 0x1cd);
            b.put_be32(NFTA_SET_KEY_LEN, 12);
            b.put_be32(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
            b.put_be32(NFTA_SET_DATA_LEN, 0);
        });
        let s = set(&named).expect("a named set");
        assert_eq!(s.name, "service-ips");
        let sig = s.signature.expect("signature");
        assert_eq!(
            (sig.flags, sig.key_len, sig.data),
            (NFT_SET_MAP, 12, Some((NFT_DATA_VERDICT, 0)))
        );
        let anon = attrs(|b| {
            b.put_str(NFTA_SET_TABLE, TABLE);
            b.put_str(NFTA_SET_NAME, "__map7");
            b.put_be32(NFTA_SET_FLAGS, NFT_SET_ANONYMOUS | NFT_SET_CONSTANT | NFT_SET_MAP);
        });
        assert_eq!(set(&anon), None);
    }
}
