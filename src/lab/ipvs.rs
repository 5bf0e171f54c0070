//! What the lab reads of IPVS mode's state in the node's namespace, as an operator would:
//! `ipvsadm -Ln` (virtual and real servers), `ipvsadm -Lnc` (IPVS's own connection table),
//! the addresses on `kube-ipvs0` and the IPVS sysctls. Parsing is pure and tested here; the
//! report's wording lives in `run.rs`.

use std::net::SocketAddr;

use anyhow::Result;

use super::testbed::Testbed;
use crate::ipvs::names::DUMMY_DEVICE;

/// The sysctls IPVS mode sets in its namespace that change what a packet meets (as upstream's
/// proxier sets them; see README "IPVS mode").
pub const SYSCTLS: [&str; 3] = [
    "net.ipv4.vs.conntrack", "net.ipv4.vs.expire_nodest_conn", "net.ipv4.vs.expire_quiescent_template",
];

/// A real server as `ipvsadm -Ln` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealServer {
    pub addr: SocketAddr,
    /// `Masq`, `Route`, `Tunnel`...
    pub forward: String,
    pub weight: u32,
    pub active: u32,
    pub inactive: u32,
}

/// `ipvsadm ARGS` in the node's namespace.
pub fn ipvsadm(bed: &Testbed, args: &[&str]) -> Result<String> {
    bed.node.exec_ok("ipvsadm", args)
}

/// The listing of one TCP virtual server without ipvsadm's version line, blanks kept (its
/// columns line up with the header).
pub fn virtual_server(bed: &Testbed, vip: SocketAddr) -> Result<Vec<String>> {
    let out = ipvsadm(bed, &["-Ln", "-t", &vip.to_string()])?;
    Ok(out
        .lines()
        .filter(|l| !l.starts_with("IP Virtual Server"))
        .map(|l| l.trim_end().to_string())
        .collect())
}

/// The real servers of one TCP virtual server.
pub fn real_servers(bed: &Testbed, vip: SocketAddr) -> Result<Vec<RealServer>> {
    Ok(parse_real_servers(&ipvsadm(bed, &["-Ln", "-t", &vip.to_string()])?))
}

/// The `-> ADDR FORWARD WEIGHT ACTIVE INACTIVE` lines of an `ipvsadm -Ln` listing (the
/// column header, whose address is not an address, is skipped).
pub fn parse_real_servers(listing: &str) -> Vec<RealServer> {
    listing
        .lines()
        .filter_map(|l| l.trim().strip_prefix("-> "))
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            Some(RealServer {
                addr: w.first()?.parse().ok()?,
                forward: (*w.get(1)?).to_string(),
                weight: w.get(2)?.parse().ok()?,
                active: w.get(3)?.parse().ok()?,
                inactive: w.get(4)?.parse().ok()?,
            })
        })
        .collect()
}

/// The virtual-server lines of `ipvsadm -Ln` for TCP `port` (one per node address for a
/// NodePort), blanks squeezed.
pub fn virtual_servers_on_port(bed: &Testbed, port: u16) -> Result<Vec<String>> {
    let out = ipvsadm(bed, &["-Ln"])?;
    let suffix = format!(":{port}");
    Ok(out
        .lines()
        .filter(|l| l.starts_with("TCP"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| l.split(' ').nth(1).is_some_and(|a| a.ends_with(&suffix)))
        .collect())
}

/// The `inet` line of `kube-ipvs0` that holds `ip`, if any, as `kube-ipvs0 inet IP/32 scope
/// global` (`ip -o addr show dev kube-ipvs0`, without the index and lifetimes).
pub fn dummy_address(bed: &Testbed, ip: &str) -> Result<Option<String>> {
    Ok(parse_dummy_address(
        &bed.node.ip(["-o", "addr", "show", "dev", DUMMY_DEVICE])?,
        ip,
    ))
}

fn parse_dummy_address(listing: &str, ip: &str) -> Option<String> {
    let want = format!("inet {ip}/");
    let line = listing.lines().find(|l| l.contains(&want))?;
    // `ip -o` ends the line's first part with a backslash before the lifetimes.
    let main = line.split('\\').next().unwrap_or(line);
    Some(main.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
}

/// `KEY=VALUE` for each of [`SYSCTLS`] in the node's namespace.
pub fn sysctls(bed: &Testbed) -> Result<Vec<String>> {
    SYSCTLS
        .iter()
        .map(|k| Ok(format!("{k}={}", bed.node.read_sysctl(k)?)))
        .collect()
}

/// The first `n` entries of IPVS's connection table for `vip` (`ipvsadm -Lnc`), with the
/// table's header line first, blanks squeezed.
pub fn connections(bed: &Testbed, vip: SocketAddr, n: usize) -> Result<Vec<String>> {
    let out = ipvsadm(bed, &["-Lnc"])?;
    let vip = vip.to_string();
    let squeeze = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    let header = out.lines().find(|l| l.starts_with("pro ")).map(squeeze);
    Ok(header
        .into_iter()
        .chain(out.lines().filter(|l| l.contains(&vip)).take(n).map(squeeze))
        .collect())
}

/// Whether the answers came in strict turn: the first `k` names all differ, and every later
/// one repeats the name `k` places before it (rr over `k` real servers).
pub fn in_turn(names: &[&str], k: usize) -> bool {
    if k == 0 || names.len() < k {
        return false;
    }
    let first = &names[..k];
    let distinct = first.iter().enumerate().all(|(i, n)| !first[..i].contains(n));
    distinct && names.iter().enumerate().all(|(i, n)| n == &first[i % k])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ipvsadm_real_servers() {
        let listing = "IP Virtual Server version 1.2.1 (size=4096)\n\
            Prot LocalAddress:Port Scheduler Flags\n\
            \x20 -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n\
            TCP  10.96.165.10:80 rr\n\
            \x20 -> 10.244.1.2:8080              Masq    1      0          12        \n\
            \x20 -> 10.244.2.2:8080              Masq    0      1          3         \n";
        assert_eq!(
            parse_real_servers(listing),
            vec![
                RealServer {
                    addr: "10.244.1.2:8080".parse().unwrap(),
                    forward: "Masq".into(),
                    weight: 1,
                    active: 0,
                    inactive: 12
                },
                RealServer {
                    addr: "10.244.2.2:8080".parse().unwrap(),
                    forward: "Masq".into(),
                    weight: 0,
                    active: 1,
                    inactive: 3
                },
            ]
        );
    }

    #[test]
    fn parses_the_dummy_links_address() {
        let listing = "7: kube-ipvs0    inet 10.96.165.10/32 scope global kube-ipvs0\\       valid_lft forever preferred_lft forever\n";
        assert_eq!(
            parse_dummy_address(listing, "10.96.165.10").as_deref(),
            Some("kube-ipvs0 inet 10.96.165.10/32 scope global kube-ipvs0")
        );
        assert_eq!(parse_dummy_address(listing, "10.96.165.1"), None);
    }

    #[test]
    fn strict_turns() {
        assert!(in_turn(&["b", "c", "a", "b", "c", "a", "b"], 3));
        assert!(!in_turn(&["a", "b", "a", "c", "b", "c"], 3), "random-looking");
        assert!(!in_turn(&["a", "a", "a"], 3), "one endpoint thrice is no turn of three");
        assert!(!in_turn(&["a", "b"], 3), "too few to tell");
    }
}
