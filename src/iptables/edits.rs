//! How a sync changes the two long fixed chains of nat, `KUBE-SERVICES` (one rule per Service
//! address, 10,000+ rules at 10,000 Services) and `KUBE-NODEPORTS`, without writing them whole:
//! iptables-nft rewrites a chain of n jump rules in time that grows with n² (1.3 s at 10,000
//! rules, 84–128 s at 44,000 on our 2-core machine), where one rule deleted costs about what a
//! chain rewrite of one Service does (0.1–0.15 s at 10,000 × 10: the tool reads the chain's
//! rules to find it), and one inserted at the top less (0.16 s with its chains, against
//! 0.25–0.33 s for an insert at a given position, which also makes the tool read the chain).
//!
//! So lines that go are deleted by their text (`-D CHAIN spec`), and lines that come are
//! inserted at the top (`-I CHAIN 1 spec`), in reverse so that they keep their rendered order
//! among themselves. The other rules of the chain do not move: between full syncs the kernel's
//! order of KUBE-SERVICES differs from the rendered one. No packet can tell: each of those
//! rules matches its own protocol, address and port, and the NodePort rule that must come last
//! stays last (it is never inserted; a change of it is a change of the rendering context, which
//! means a full sync). Where two Services claim the same address and port (only one can win,
//! the rendered first), or where more lines go than deleting them one by one is worth, the chain
//! is written whole instead ([`ChainWrite::Whole`]).
//!
//! On a full sync the lines to keep are found by comparing what `iptables-save` lists with what
//! we render ([`normalized`]: iptables-save reorders the matches, quotes comments and adds
//! host prefixes), so that a periodic full sync or a restart on an unchanged table leaves both
//! chains alone. A chain that holds no rule is appended to instead ([`ChainWrite::Append`]),
//! Service by Service, in rendered order.
//!
//! Pure: the proxier runs the tools.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

/// At most this many lines of one chain are deleted one by one; more, and it is written whole.
pub const MAX_DELETES: usize = 64;

/// How a sync writes one of the chains.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ChainWrite {
    /// Not at all.
    #[default]
    No,
    /// It holds no rule: every line is appended, with its Service's chains.
    Append,
    /// The lines that go are deleted, those that come inserted at the top.
    InPlace(Edits),
    /// Declared (flushed) and written whole, in one commit.
    Whole,
}

/// The lines of a chain that a sync deletes and inserts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    /// Lines to delete, as `-A CHAIN …` (rendered, or as `iptables-save` listed them).
    pub gone: Vec<String>,
    /// Lines to insert, as rendered (`-A CHAIN …`), in rendered order.
    pub new: Vec<String>,
}

impl Edits {
    pub fn is_empty(&self) -> bool {
        self.gone.is_empty() && self.new.is_empty()
    }

    /// `-D CHAIN spec` lines of the lines that go.
    pub fn deletes(&self) -> impl Iterator<Item = String> + '_ {
        self.gone.iter().filter_map(|l| as_command(l, "-D", ""))
    }

    /// `-I CHAIN 1 spec` lines of the lines that come, last first.
    pub fn inserts(&self) -> impl Iterator<Item = String> + '_ {
        self.new.iter().rev().filter_map(|l| as_command(l, "-I", " 1"))
    }

    /// The chain write these edits make: in place, or whole when there are too many deletes
    /// or an inserted line's address is also another Service's (`contested`).
    pub fn into_write(self, contested: &HashSet<MatchKey>) -> ChainWrite {
        if self.is_empty() {
            return ChainWrite::No;
        }
        let clash = self
            .new
            .iter()
            .filter_map(|l| match_key(l))
            .any(|k| contested.contains(&k));
        if clash || self.gone.len() > MAX_DELETES {
            ChainWrite::Whole
        } else {
            ChainWrite::InPlace(self)
        }
    }
}

/// `-A CHAIN spec` as `VERB CHAIN[suffix] spec`.
fn as_command(line: &str, verb: &str, suffix: &str) -> Option<String> {
    let rest = line.strip_prefix("-A ")?;
    let (chain, spec) = rest.split_once(' ')?;
    Some(format!("{verb} {chain}{suffix} {spec}"))
}

/// What a rule of KUBE-SERVICES or KUBE-NODEPORTS matches: chain, protocol, destination and
/// destination port (none for a rule without a destination port, like the NodePort rule).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MatchKey {
    chain: String,
    protocol: String,
    destination: Option<String>,
    port: String,
}

/// The [`MatchKey`] of a rendered line.
pub fn match_key(line: &str) -> Option<MatchKey> {
    let words = words(line);
    let chain = words.get(1)?.clone();
    let value = |opt: &str| words.windows(2).find(|w| w[0] == opt).map(|w| w[1].clone());
    Some(MatchKey {
        chain,
        protocol: value("-p")?,
        destination: value("-d").map(|d| with_host_prefix(&d)),
        port: value("--dport")?,
    })
}

/// The match keys of lines that another of `groups` (each the lines of one Service) overlaps:
/// same chain, protocol and port, and the same destination or none on either side. A
/// Service's own lines may overlap (its NodePort rule and its localhost NodePort rule): they
/// are inserted together, in order.
///
/// Only the keys of lines that may overlap one of `near` (the lines a sync inserts) are
/// complete: a line that cannot (it lacks `near`'s port, or names another destination) is
/// not parsed, which keeps this to a scan of text at 10,000 Services.
pub fn contested<'a>(groups: impl Iterator<Item = &'a str>, near: &[String]) -> HashSet<MatchKey> {
    // Per inserted line, its port and destination as they appear in any spelling of a line.
    let needles: Vec<(String, Option<String>)> = near
        .iter()
        .filter_map(|l| match_key(l))
        .map(|k| {
            let dest = k.destination.map(|d| {
                let bare = d.strip_suffix("/32").or_else(|| d.strip_suffix("/128"));
                bare.map(str::to_string).unwrap_or(d)
            });
            (format!("--dport {}", k.port), dest)
        })
        .collect();
    // Beyond a few inserted lines, parsing every line is cheaper than matching each needle.
    let every = needles.len() > MAX_DELETES;
    let may_overlap = |line: &str| {
        every
            || needles.iter().any(|(port, dest)| {
                line.contains(port.as_str())
                    && dest
                        .as_deref()
                        .is_none_or(|d| line.contains(d) || !line.contains(" -d "))
            })
    };
    let mut by_port: HashMap<(String, String, String), Vec<(usize, MatchKey)>> = HashMap::new();
    for (i, group) in groups.enumerate() {
        for key in group.lines().filter(|l| may_overlap(l)).filter_map(match_key) {
            by_port
                .entry((key.chain.clone(), key.protocol.clone(), key.port.clone()))
                .or_default()
                .push((i, key));
        }
    }
    let mut contested = HashSet::new();
    for claims in by_port.values().filter(|c| c.len() > 1) {
        for (i, a) in claims {
            let overlaps =
                |b: &MatchKey| a.destination.is_none() || b.destination.is_none() || a.destination == b.destination;
            if claims.iter().any(|(j, b)| j != i && overlaps(b)) {
                contested.insert(a.clone());
            }
        }
    }
    contested
}

/// The edits that bring the kernel's lines of a chain (`saved`, as `iptables-save` lists them)
/// to the rendered ones (`wanted`, in rendered order): every line compares in
/// [`normalized`] form, once per occurrence.
pub fn diff_saved(saved: &[String], wanted: &[&str]) -> Edits {
    let mut have: HashMap<Vec<String>, usize> = HashMap::new();
    for line in saved {
        *have.entry(normalized(line)).or_default() += 1;
    }
    let mut new = Vec::new();
    for line in wanted {
        match have.get_mut(&normalized(line)) {
            Some(n) if *n > 0 => *n -= 1,
            _ => new.push(line.to_string()),
        }
    }
    let mut gone = Vec::new();
    for line in saved {
        if let Some(n) = have.get_mut(&normalized(line))
            && *n > 0
        {
            *n -= 1;
            gone.push(line.clone());
        }
    }
    Edits { gone, new }
}

/// A rule line in a form that does not depend on how it was spelled: `-A CHAIN` and each
/// option with its values (`-m tcp`, `--dport 80`, `! -s 10.0.0.0/8`, a comment unquoted), the
/// options sorted, addresses of `-s`/`-d` with their host prefix (`/32`, `/128`). Two rules
/// with the same form match the same packets the same way: `iptables-save` moves `-s`, `-d`
/// and `-p` to the front and keeps the order of everything else.
pub fn normalized(line: &str) -> Vec<String> {
    let words = words(line);
    let mut head: Vec<String> = words.iter().take(2).cloned().collect();
    let mut options: Vec<String> = Vec::new();
    let mut negate = false;
    for w in words.iter().skip(2) {
        let is_option = w.starts_with('-') && w.len() > 1 && !w[1..].starts_with(|c: char| c.is_ascii_digit());
        if w == "!" {
            negate = true;
        } else if is_option || options.is_empty() {
            options.push(format!("{}{w}", if negate { "! " } else { "" }));
            negate = false;
        } else if let Some(last) = options.last_mut() {
            let address = ["-s", "-d", "! -s", "! -d"].contains(&last.as_str());
            last.push(' ');
            last.push_str(&if address { with_host_prefix(w) } else { w.clone() });
        }
    }
    options.sort();
    head.extend(options);
    head
}

/// An address without a prefix length gets its host prefix.
fn with_host_prefix(value: &str) -> String {
    match value.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => format!("{value}/32"),
        Ok(IpAddr::V6(_)) => format!("{value}/128"),
        Err(_) => value.to_string(),
    }
}

/// The words of a rule line, a double-quoted word (`"… cluster IP"`) as one, without quotes.
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut started = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                quoted = !quoted;
                started = true;
            }
            '\\' if quoted => {
                if let Some(next) = chars.next() {
                    word.push(next);
                }
            }
            ' ' if !quoted => {
                if started {
                    out.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        out.push(word);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = "-A KUBE-SERVICES -m comment --comment \"ns0/svc0:http cluster IP\" -m tcp -p tcp -d 10.96.0.0 --dport 80 -j KUBE-SVC-K7ZVFMM3TUXRXRZR";
    const SAVED: &str = "-A KUBE-SERVICES -d 10.96.0.0/32 -p tcp -m comment --comment \"ns0/svc0:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-K7ZVFMM3TUXRXRZR";

    #[test]
    fn rules_compare_as_iptables_save_lists_them() {
        assert_eq!(normalized(OURS), normalized(SAVED));
        let np = "-A KUBE-NODEPORTS -m comment --comment ns0/svc0:http -m tcp -p tcp --dport 30000 -j KUBE-EXT-K7ZVFMM3TUXRXRZR";
        let np_saved = "-A KUBE-NODEPORTS -p tcp -m comment --comment \"ns0/svc0:http\" -m tcp --dport 30000 -j KUBE-EXT-K7ZVFMM3TUXRXRZR";
        assert_eq!(normalized(np), normalized(np_saved));
        let tail = "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS";
        let tail_saved = "-A KUBE-SERVICES ! -d 127.0.0.0/8 -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS";
        assert_eq!(normalized(tail), normalized(tail_saved));
        let v6 = "-A KUBE-SERVICES -m tcp -p tcp -d fd00::1 --dport 80 -j X";
        let v6_saved = "-A KUBE-SERVICES -d fd00::1/128 -p tcp -m tcp --dport 80 -j X";
        assert_eq!(normalized(v6), normalized(v6_saved));
    }

    #[test]
    fn different_rules_stay_different() {
        let other_port = SAVED.replace("--dport 80", "--dport 81");
        let other_target = SAVED.replace("KUBE-SVC-K7", "KUBE-SVL-K7");
        let other_comment = SAVED.replace("cluster IP", "external IP");
        for other in [other_port, other_target, other_comment] {
            assert_ne!(normalized(OURS), normalized(&other), "{other}");
        }
        // Which address is the source and which the destination matters, and so does a `!`.
        let a = normalized("-A C -s 10.0.0.1 -d 10.0.0.2 -j X");
        let b = normalized("-A C -s 10.0.0.2 -d 10.0.0.1 -j X");
        let c = normalized("-A C ! -s 10.0.0.1 -d 10.0.0.2 -j X");
        assert!(a != b && a != c && b != c);
        assert_ne!(normalized("-A C -j X"), normalized("-A D -j X"));
    }

    #[test]
    fn the_saved_diff_keeps_what_is_there_once_per_occurrence() {
        let saved = vec![SAVED.to_string(), "-A KUBE-SERVICES -d 10.96.0.9/32 -j OLD".to_string()];
        let new = OURS.replace("10.96.0.0", "10.96.0.1");
        let e = diff_saved(&saved, &[OURS, &new]);
        assert_eq!(e.gone, vec!["-A KUBE-SERVICES -d 10.96.0.9/32 -j OLD".to_string()]);
        assert_eq!(e.new, vec![new.clone()]);
        // A line the kernel has twice loses one copy; one wanted twice gets one more.
        let twice = vec![SAVED.to_string(), SAVED.to_string()];
        assert_eq!(diff_saved(&twice, &[OURS]).gone, vec![SAVED.to_string()]);
        assert_eq!(diff_saved(&saved[..1], &[OURS, OURS]).new, vec![OURS.to_string()]);
        assert!(diff_saved(&saved[..1], &[OURS]).is_empty());
    }

    #[test]
    fn edits_delete_by_text_and_insert_at_the_top_in_order() {
        let e = Edits {
            gone: vec!["-A KUBE-SERVICES -d 10.96.0.9/32 -j OLD".into()],
            new: vec![
                "-A KUBE-NODEPORTS -p tcp --dport 1 -j A".into(),
                "-A KUBE-NODEPORTS -p tcp --dport 2 -j B".into(),
            ],
        };
        assert_eq!(
            e.deletes().collect::<Vec<_>>(),
            ["-D KUBE-SERVICES -d 10.96.0.9/32 -j OLD"]
        );
        assert_eq!(
            e.inserts().collect::<Vec<_>>(),
            [
                "-I KUBE-NODEPORTS 1 -p tcp --dport 2 -j B",
                "-I KUBE-NODEPORTS 1 -p tcp --dport 1 -j A"
            ]
        );
    }

    #[test]
    fn a_contested_address_or_many_deletes_write_the_chain_whole() {
        let other = OURS
            .replace("ns0/svc0", "ns1/svc1")
            .replace("KUBE-SVC-K7", "KUBE-SVC-Q2");
        let groups = [OURS.to_string() + "\n", other.clone() + "\n"];
        let contested = contested(groups.iter().map(String::as_str), std::slice::from_ref(&other));
        assert_eq!(contested.len(), 1);
        let insert = |line: &str| Edits {
            gone: vec![],
            new: vec![line.to_string()],
        };
        assert_eq!(insert(&other).into_write(&contested), ChainWrite::Whole);
        let alone = OURS.replace("10.96.0.0", "10.96.0.7");
        assert!(matches!(insert(&alone).into_write(&contested), ChainWrite::InPlace(_)));
        // One Service's own lines may overlap (its NodePort rule and its localhost one);
        // another Service's NodePort rule on the same port overlaps both.
        let np = "-A KUBE-NODEPORTS -m comment --comment a -m tcp -p tcp --dport 30000 -j X\n";
        let lo = "-A KUBE-NODEPORTS -m comment --comment a -m tcp -p tcp -d 127.0.0.0/8 --dport 30000 -j X\n";
        let both = format!("{np}{lo}");
        let near = |g: &[&str]| -> Vec<String> { g.iter().flat_map(|s| s.lines()).map(str::to_string).collect() };
        assert!(super::contested([both.as_str()].into_iter(), &near(&[&both])).is_empty());
        let b = np.replace("comment a", "comment b").replace("-j X", "-j Y");
        assert_eq!(
            super::contested([both.as_str(), b.as_str()].into_iter(), &near(&[&both, &b])).len(),
            2,
            "the keys of all three"
        );
        let b_other_port = b.replace("30000", "30001");
        assert!(
            super::contested(
                [both.as_str(), b_other_port.as_str()].into_iter(),
                &near(&[&both, &b_other_port])
            )
            .is_empty()
        );
        // Lines that cannot overlap an inserted one are not looked at.
        assert!(super::contested([both.as_str(), b.as_str()].into_iter(), &near(&[&b_other_port])).is_empty());
        let many = Edits {
            gone: vec![SAVED.to_string(); MAX_DELETES + 1],
            new: vec![],
        };
        assert_eq!(many.into_write(&HashSet::new()), ChainWrite::Whole);
        assert_eq!(Edits::default().into_write(&HashSet::new()), ChainWrite::No);
    }
}
