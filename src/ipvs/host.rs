//! The edge to the rest of the node in IPVS mode, besides IPVS itself and iptables: the
//! `kube-ipvs0` dummy link and its addresses (`ip`), the ipsets (`ipset`), and sysctls
//! (`/proc/sys`), behind [`IpvsHost`] with a recording fake, [`FakeHost`].
//!
//! Everything acts on the network namespace of the calling process (a child process inherits
//! it; `/proc/sys/net` shows the reader's namespace), so a daemon started in a test's namespace
//! never reaches the host's.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::exec;

/// Failures of the host tools; the proxier reports them and retries with a full sync.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The tool could not be started (not installed, ...).
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The tool ran and failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    /// A netlink request failed (the node's addresses over rtnetlink).
    #[error("{what}: {source}")]
    Netlink {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A sysctl could not be read or written.
    #[error("sysctl {path}: {source}")]
    Sysctl {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The host operations IPVS mode needs besides IPVS and iptables.
pub trait IpvsHost {
    fn link_exists(&mut self, name: &str) -> Result<bool, HostError>;
    /// Creates the dummy link `name` unless it exists, leaving it down as upstream does (its
    /// addresses are still local: the kernel adds their local routes whatever the link state).
    /// True when it was created.
    fn ensure_dummy(&mut self, name: &str) -> Result<bool, HostError>;
    /// Deletes the link if it exists.
    fn delete_link(&mut self, name: &str) -> Result<(), HostError>;
    /// The addresses on the link, both families; empty when there is no such link.
    fn addresses(&mut self, name: &str) -> Result<Vec<IpAddr>, HostError>;
    /// Every address of the namespace on links other than `except`, both families, loopback
    /// included (one listing for all links, as upstream's GetAllLocalAddressesExcept: an
    /// address that is also on another link counts).
    fn other_addresses(&mut self, except: &str) -> Result<Vec<IpAddr>, HostError>;
    /// Adds and deletes host-sized addresses (/32, /128) on the link, in one run of the tool.
    fn change_addresses(&mut self, name: &str, add: &[IpAddr], del: &[IpAddr]) -> Result<(), HostError>;
    /// Every ipset (`ipset save`): name → entries as ipset prints them.
    fn ipsets(&mut self) -> Result<BTreeMap<String, BTreeSet<String>>, HostError>;
    /// `ipset restore -exist` with `input`.
    fn ipset_restore(&mut self, input: &str) -> Result<(), HostError>;
    /// `ipset destroy NAME`.
    fn ipset_destroy(&mut self, name: &str) -> Result<(), HostError>;
    /// `/proc/sys/PATH`, trimmed.
    fn read_sysctl(&mut self, path: &str) -> Result<String, HostError>;
    fn write_sysctl(&mut self, path: &str, value: &str) -> Result<(), HostError>;
}

/// The protocols of ipset entries (`ADDR,PROTO:PORT…`), by name as `ipset save` prints them
/// and by number.
const ENTRY_PROTOCOLS: [(&str, &str); 3] = [("tcp:", "6:"), ("udp:", "17:"), ("sctp:", "132:")];

/// An entry as `ipset restore` is given it: its protocol by number (`10.96.0.1,6:80`). ipset
/// looks a protocol name up in /etc/protocols for every line it reads (open, read, seek and
/// close of the file per entry: at 31,000 entries most of a cold sync in the test VM); a
/// number it takes as it is. It prints the name again, so entries compare as they are kept.
pub fn entry_for_restore(entry: &str) -> std::borrow::Cow<'_, str> {
    if let Some((addr, rest)) = entry.split_once(',') {
        for (name, number) in ENTRY_PROTOCOLS {
            if let Some(port) = rest.strip_prefix(name) {
                return format!("{addr},{number}{port}").into();
            }
        }
    }
    entry.into()
}

/// The entry as ipset prints it: the protocol by name (the inverse of [`entry_for_restore`]).
pub fn entry_as_saved(entry: &str) -> std::borrow::Cow<'_, str> {
    if let Some((addr, rest)) = entry.split_once(',') {
        for (name, number) in ENTRY_PROTOCOLS {
            if let Some(port) = rest.strip_prefix(number) {
                return format!("{addr},{name}{port}").into();
            }
        }
    }
    entry.into()
}

/// The index of the link `name`; `None` when there is no such link.
fn link_index(name: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(name).ok()
}

/// Every address of the namespace, over rtnetlink (what `ip -o addr show` lists, without a
/// process: IPVS mode reads them every sync, `kube-ipvs0`'s thousands of ClusterIPs included).
fn interface_addresses() -> Result<Vec<crate::rtnetlink::InterfaceAddress>, HostError> {
    crate::rtnetlink::addresses().map_err(|source| HostError::Netlink {
        what: "listing the addresses (RTM_GETADDR dump over rtnetlink)",
        source,
    })
}

/// The real tools, run directly (never through a shell).
#[derive(Clone, Debug, Default)]
pub struct HostExec;

fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, HostError> {
    exec::run(program, args, stdin).map_err(|e| match e {
        exec::Error::Spawn { program, source } => HostError::Spawn { program, source },
        exec::Error::Failed {
            program,
            args,
            status,
            stderr,
        } => HostError::Failed {
            command: format!("{program} {}", args.join(" ")),
            status: status.to_string(),
            stderr,
        },
    })
}

/// The addresses in `ip -o addr show` output, with the link each is on.
pub fn parse_ip_addr(output: &str) -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    for line in output.lines() {
        let mut words = line.split_whitespace();
        // `5: kube-ipvs0    inet 10.96.0.1/32 scope global kube-ipvs0\ ...`; a veth shows
        // as `eth0@if7`.
        let (Some(_), Some(link)) = (words.next(), words.next()) else {
            continue;
        };
        let link = link.split('@').next().unwrap_or(link).to_string();
        let mut words = words.skip_while(|w| *w != "inet" && *w != "inet6");
        if words.next().is_none() {
            continue;
        }
        let Some(addr) = words.next().and_then(|a| a.split('/').next()) else {
            continue;
        };
        if let Ok(ip) = addr.parse::<IpAddr>() {
            out.push((link, ip));
        }
    }
    out
}

/// The sets and entries in `ipset save` output.
pub fn parse_ipset_save(output: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut sets: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in output.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("create"), Some(name), _) => {
                sets.entry(name.to_string()).or_default();
            }
            (Some("add"), Some(name), Some(entry)) => {
                sets.entry(name.to_string()).or_default().insert(entry.to_string());
            }
            _ => {}
        }
    }
    sets
}

/// An address as `ip` takes a host-sized one.
fn host_prefix(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

impl IpvsHost for HostExec {
    fn link_exists(&mut self, name: &str) -> Result<bool, HostError> {
        // `ip link show` fails for a missing link; anything else (no `ip`) is an error.
        match run("ip", &["link", "show", "dev", name], None) {
            Ok(_) => Ok(true),
            Err(HostError::Failed { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn ensure_dummy(&mut self, name: &str) -> Result<bool, HostError> {
        if self.link_exists(name)? {
            return Ok(false);
        }
        run("ip", &["link", "add", name, "type", "dummy"], None)?;
        Ok(true)
    }

    fn delete_link(&mut self, name: &str) -> Result<(), HostError> {
        if self.link_exists(name)? {
            run("ip", &["link", "del", name], None)?;
        }
        Ok(())
    }

    fn addresses(&mut self, name: &str) -> Result<Vec<IpAddr>, HostError> {
        let Some(index) = link_index(name) else {
            return Ok(Vec::new());
        };
        Ok(interface_addresses()?
            .into_iter()
            .filter(|a| a.index == index)
            .map(|a| a.address)
            .collect())
    }

    fn other_addresses(&mut self, except: &str) -> Result<Vec<IpAddr>, HostError> {
        let except = link_index(except);
        Ok(interface_addresses()?
            .into_iter()
            .filter(|a| Some(a.index) != except)
            .map(|a| a.address)
            .collect())
    }

    fn change_addresses(&mut self, name: &str, add: &[IpAddr], del: &[IpAddr]) -> Result<(), HostError> {
        if add.is_empty() && del.is_empty() {
            return Ok(());
        }
        // One `ip -batch` for all of them: thousands of Services would otherwise cost
        // thousands of processes.
        let mut batch = String::new();
        for ip in add {
            // No duplicate address detection: the link is down and the address is ours.
            let nodad = if ip.is_ipv6() { " nodad" } else { "" };
            batch.push_str(&format!("addr add {} dev {name}{nodad}\n", host_prefix(ip)));
        }
        for ip in del {
            batch.push_str(&format!("addr del {} dev {name}\n", host_prefix(ip)));
        }
        run("ip", &["-batch", "-"], Some(&batch)).map(drop)
    }

    fn ipsets(&mut self) -> Result<BTreeMap<String, BTreeSet<String>>, HostError> {
        Ok(parse_ipset_save(&run("ipset", &["save"], None)?))
    }

    fn ipset_restore(&mut self, input: &str) -> Result<(), HostError> {
        run("ipset", &["restore", "-exist"], Some(input)).map(drop)
    }

    fn ipset_destroy(&mut self, name: &str) -> Result<(), HostError> {
        run("ipset", &["destroy", name], None).map(drop)
    }

    fn read_sysctl(&mut self, path: &str) -> Result<String, HostError> {
        let full = format!("/proc/sys/{path}");
        std::fs::read_to_string(&full)
            .map(|s| s.trim().to_string())
            .map_err(|source| HostError::Sysctl { path: full, source })
    }

    fn write_sysctl(&mut self, path: &str, value: &str) -> Result<(), HostError> {
        let full = format!("/proc/sys/{path}");
        std::fs::write(&full, value).map_err(|source| HostError::Sysctl { path: full, source })
    }
}

/// An in-memory host for tests: links with addresses, ipsets, sysctls, and a log of every
/// change made (`calls`).
#[derive(Clone, Debug, Default)]
pub struct FakeHost {
    pub links: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Addresses of the namespace's links that are not in `links` (eth0, lo, ...): tests
    /// add and remove node addresses here.
    pub other: Vec<IpAddr>,
    pub sets: BTreeMap<String, BTreeSet<String>>,
    pub sysctls: BTreeMap<String, String>,
    /// Every change, in order: `link add NAME`, `addr add IP`, `ipset restore` inputs, ...
    pub calls: Vec<String>,
    /// The inputs of every `ipset restore`.
    pub restores: Vec<String>,
    /// Makes the next `ipset restore` fail.
    pub fail_next_restore: bool,
    /// Makes the next listing of other links' addresses fail.
    pub fail_next_list: bool,
}

impl IpvsHost for FakeHost {
    fn link_exists(&mut self, name: &str) -> Result<bool, HostError> {
        Ok(self.links.contains_key(name))
    }

    fn ensure_dummy(&mut self, name: &str) -> Result<bool, HostError> {
        if self.links.contains_key(name) {
            return Ok(false);
        }
        self.links.insert(name.to_string(), BTreeSet::new());
        self.calls.push(format!("link add {name}"));
        Ok(true)
    }

    fn delete_link(&mut self, name: &str) -> Result<(), HostError> {
        if self.links.remove(name).is_some() {
            self.calls.push(format!("link del {name}"));
        }
        Ok(())
    }

    fn addresses(&mut self, name: &str) -> Result<Vec<IpAddr>, HostError> {
        Ok(self
            .links
            .get(name)
            .map(|a| a.iter().copied().collect())
            .unwrap_or_default())
    }

    fn other_addresses(&mut self, except: &str) -> Result<Vec<IpAddr>, HostError> {
        if std::mem::take(&mut self.fail_next_list) {
            return Err(HostError::Failed {
                command: "ip -o addr show".into(),
                status: "exit status: 1".into(),
                stderr: "injected failure".into(),
            });
        }
        let mut all = self.other.clone();
        for (_, addrs) in self.links.iter().filter(|(name, _)| name.as_str() != except) {
            all.extend(addrs.iter().copied());
        }
        Ok(all)
    }

    fn change_addresses(&mut self, name: &str, add: &[IpAddr], del: &[IpAddr]) -> Result<(), HostError> {
        let Some(addrs) = self.links.get_mut(name) else {
            return Err(HostError::Failed {
                command: format!("ip addr ... dev {name}"),
                status: "exit status: 1".into(),
                stderr: format!("Cannot find device \"{name}\""),
            });
        };
        for ip in add {
            // The kernel refuses a duplicate address.
            if !addrs.insert(*ip) {
                return Err(HostError::Failed {
                    command: format!("ip addr add {ip} dev {name}"),
                    status: "exit status: 2".into(),
                    stderr: "RTNETLINK answers: File exists".into(),
                });
            }
            self.calls.push(format!("addr add {ip}"));
        }
        for ip in del {
            addrs.remove(ip);
            self.calls.push(format!("addr del {ip}"));
        }
        Ok(())
    }

    fn ipsets(&mut self) -> Result<BTreeMap<String, BTreeSet<String>>, HostError> {
        Ok(self.sets.clone())
    }

    fn ipset_restore(&mut self, input: &str) -> Result<(), HostError> {
        if std::mem::take(&mut self.fail_next_restore) {
            return Err(HostError::Failed {
                command: "ipset restore -exist".into(),
                status: "exit status: 1".into(),
                stderr: "injected failure".into(),
            });
        }
        // `-exist`: creating an existing set, adding a present entry and deleting an absent
        // one are no errors.
        for line in input.lines() {
            let mut w = line.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("create"), Some(name), _) => {
                    self.sets.entry(name.to_string()).or_default();
                }
                // Kept as ipset keeps them: the protocol by name.
                (Some("add"), Some(name), Some(e)) => {
                    self.sets
                        .entry(name.to_string())
                        .or_default()
                        .insert(entry_as_saved(e).into_owned());
                }
                (Some("del"), Some(name), Some(e)) => {
                    if let Some(s) = self.sets.get_mut(name) {
                        s.remove(entry_as_saved(e).as_ref());
                    }
                }
                _ => {}
            }
        }
        self.restores.push(input.to_string());
        self.calls.push("ipset restore".into());
        Ok(())
    }

    fn ipset_destroy(&mut self, name: &str) -> Result<(), HostError> {
        self.sets.remove(name);
        self.calls.push(format!("ipset destroy {name}"));
        Ok(())
    }

    fn read_sysctl(&mut self, path: &str) -> Result<String, HostError> {
        Ok(self.sysctls.get(path).cloned().unwrap_or_else(|| "0".into()))
    }

    fn write_sysctl(&mut self, path: &str, value: &str) -> Result<(), HostError> {
        self.sysctls.insert(path.to_string(), value.to_string());
        self.calls.push(format!("sysctl {path}={value}"));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_go_to_ipset_with_protocol_numbers_and_read_back_with_names() {
        for (saved, given) in [
            ("10.96.0.1,tcp:80", "10.96.0.1,6:80"),
            ("10.96.0.1,udp:53", "10.96.0.1,17:53"),
            ("10.96.0.1,sctp:9", "10.96.0.1,132:9"),
            ("10.244.0.5,tcp:8080,10.244.0.5", "10.244.0.5,6:8080,10.244.0.5"),
            ("2001:db8::1,tcp:80,2001:db8:2::/64", "2001:db8::1,6:80,2001:db8:2::/64"),
            // No protocol: a bitmap:port entry, a net.
            ("30080", "30080"),
            ("10.0.0.0/8", "10.0.0.0/8"),
        ] {
            assert_eq!(entry_for_restore(saved), given);
            assert_eq!(entry_as_saved(given), saved);
            assert_eq!(entry_as_saved(saved), saved, "a name stays a name");
        }
    }

    #[test]
    fn ip_addr_output_is_parsed_per_link() {
        let out = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n\
                   2: eth0@if7    inet 192.168.49.2/24 brd 192.168.49.255 scope global eth0\\       valid_lft forever\n\
                   5: kube-ipvs0    inet 10.96.0.1/32 scope global kube-ipvs0\\       valid_lft forever\n\
                   5: kube-ipvs0    inet6 fd00::1/128 scope global \\       valid_lft forever\n";
        let parsed = parse_ip_addr(out);
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        assert_eq!(
            parsed,
            vec![
                ("lo".to_string(), ip("127.0.0.1")),
                ("eth0".to_string(), ip("192.168.49.2")),
                ("kube-ipvs0".to_string(), ip("10.96.0.1")),
                ("kube-ipvs0".to_string(), ip("fd00::1")),
            ]
        );
    }

    #[test]
    fn ipset_save_output_is_parsed() {
        let out = "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1\n\
                   add KUBE-CLUSTER-IP 10.96.0.1,tcp:443\n\
                   create KUBE-NODE-PORT-TCP bitmap:port range 0-65535\n\
                   add KUBE-NODE-PORT-TCP 30080\n\
                   create EMPTY hash:ip family inet\n";
        let sets = parse_ipset_save(out);
        assert_eq!(
            sets["KUBE-CLUSTER-IP"],
            BTreeSet::from(["10.96.0.1,tcp:443".to_string()])
        );
        assert_eq!(sets["KUBE-NODE-PORT-TCP"], BTreeSet::from(["30080".to_string()]));
        assert!(sets["EMPTY"].is_empty());
    }
}
