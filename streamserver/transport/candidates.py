"""Which of an offer's ICE candidates the server may contact.

aiortc sends STUN checks to every remote candidate of an offer, so an offer is a list of
addresses the server will send packets to: a client could name fifty of them, or the server's
own loopback services, and use the server to reach them. An offer may therefore name at most
`max_candidates`, and only candidates on allowed addresses are kept: by default any routable
address (public or LAN) but not loopback, link-local, multicast, unspecified or reserved ones;
`--ice-allow CIDR` narrows it to the operator's own list (an on-prem box: its LAN). mDNS
(`*.local`) candidates are kept, as browsers hide LAN addresses behind them and only the local
network can answer for them; any other host name is dropped (the server would resolve it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TooManyCandidates(ValueError):
    pass


@dataclass(frozen=True)
class CandidatePolicy:
    max_candidates: int = 10
    allow: tuple[Network, ...] = ()  # empty: the default rule above
    allow_loopback: bool = False  # a server gathering on loopback itself (tests, one machine)

    @classmethod
    def of(cls, allow: list[str], host_addresses: list[str], max_candidates: int = 10) -> CandidatePolicy:
        """From `--ice-allow` CIDRs (ValueError for a bad one) and the server's own host addresses."""
        networks = tuple(ipaddress.ip_network(a, strict=False) for a in allow)
        loopback = any(_ip(a) is not None and _ip(a).is_loopback for a in host_addresses)  # type: ignore[union-attr]
        return cls(max_candidates, networks, loopback)

    def allows(self, address: str) -> bool:
        ip = _ip(address)
        if ip is None:
            return address.lower().endswith(".local")
        if self.allow:  # the operator's list, and nothing else
            return any(ip in n for n in self.allow)
        if ip.is_loopback:
            return self.allow_loopback
        return not (ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None


def filter_offer(sdp: str, policy: CandidatePolicy) -> str:
    """The offer with only allowed candidates; TooManyCandidates when it names too many."""
    lines = sdp.splitlines()
    # Counted by the address they name: a bundled offer (audio and the page's data channel)
    # repeats the same candidates in each of its media sections.
    candidates = {_endpoint(line) for line in lines if line.startswith("a=candidate:")}
    if len(candidates) > policy.max_candidates:
        raise TooManyCandidates(f"the offer has {len(candidates)} ICE candidates; at most {policy.max_candidates} are accepted")
    kept = [line for line in lines if not line.startswith("a=candidate:") or _allowed(line, policy)]
    return "\r\n".join(kept) + "\r\n"


def _endpoint(line: str) -> tuple[str, ...]:
    """What a candidate line names: transport, address, port."""
    fields = line.split()
    return (fields[2].lower(), fields[4], fields[5]) if len(fields) >= 6 else (line,)


def _allowed(line: str, policy: CandidatePolicy) -> bool:
    # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <type> ...
    fields = line.split()
    return len(fields) >= 8 and policy.allows(fields[4])
