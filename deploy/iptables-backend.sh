#!/bin/sh
# Chooses the iptables backend (nft or legacy) that the host's other components use, as
# upstream's iptables-wrapper does: mixing backends on one node gives rules that do not see
# each other. The backend with more rules wins; nft when neither has any. Then runs "$@".
set -eu
legacy=$( (iptables-legacy-save || true; ip6tables-legacy-save || true) 2>/dev/null | grep -c '^-' || true)
nft=$( (iptables-nft-save || true; ip6tables-nft-save || true) 2>/dev/null | grep -c '^-' || true)
if [ "${legacy:-0}" -gt "${nft:-0}" ]; then mode=legacy; else mode=nft; fi
for tool in iptables ip6tables; do
  for suffix in "" -save -restore; do
    update-alternatives --set "$tool" "/usr/sbin/$tool-$mode" >/dev/null 2>&1 || true
    ln -sf "/usr/sbin/xtables-$mode-multi" "/usr/sbin/$tool$suffix" 2>/dev/null || true
  done
done
exec "$@"
