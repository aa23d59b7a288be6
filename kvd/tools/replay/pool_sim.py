"""The pool's replay simulator: a trace over the members of a pool, each with
its own L1 and policy, making the decisions ``kvd.cluster.router`` makes.

Request ``i`` goes through member ``i mod N`` (``kvd bench pool`` sends it
there), and each key is owned by its rendezvous owner
(``kvd.cluster.rendezvous``, over the members' addresses). Per request, on
top of ``kvd.tools.replay.sim``'s single-daemon semantics:

1. **Lookup.** The local prefix is the chain's leading keys held by the
   member (its own or guests). Its policy learns of the keys it owns
   (``on_lookup(chain, hits, mine)``), and so does every other owner of a
   key of the chain (the router's ``chain`` Exists, answered or told in the
   background), its hits being the chain's leading keys that are another
   member's or held by it, after the lookups of the member's that held none
   of its keys since the member last told it (``ChainShare.untold``: each
   an ``on_lookup`` of an empty chain). Past the local prefix a key is
   found where the member holds it or its owner does, up to the first key
   the member owns and lacks.
2. **Get** of each key found: held by the member, a hit there; else its
   owner's hit, and the member keeps a guest copy.
3. **Put** of the rest: a key the member does not own becomes a guest copy
   there and a put at its owner (the forward: at once here, in the
   background in the daemon).

Every ``PLAN_EVERY_LOOKUPS`` lookups a member learns of (``plan_due``), it adopts the
plan holder's plan (the first member in sorted order; kvd.cluster.plans),
at once here, a round trip later in the daemon. ``in_step=False`` leaves
both out (no untold lookups, each member its own plan), as the daemon was
before them: what they are worth.

Guests stay out of the policy and are evicted first, oldest first
(``kvd.store.entries``). The local prefix is pinned, as the lease pins it.
The simulator and a real pool differ in timing only (forwards and tells are
background work in the daemon), so their hit ratios agree closely but not
exactly (``kvd bench pool`` reports both). With one member it makes exactly
``simulate``'s decisions (tests/tools/test_pool_sim.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvd.cluster.plans import plan_due
from kvd.cluster.rendezvous import Placement
from kvd.store.eviction.policy import POLICIES, EvictionPolicy, make_policy
from kvd.tools.replay.run import block_key
from kvd.tools.replay.sim import SimError, SimResult, _token_hits
from kvd.tools.replay.trace import Trace


@dataclass
class _Member:
    """One member's L1: what it holds, its policy and its guests (oldest first)."""

    policy: EvictionPolicy[int]
    capacity: int
    held: set[int] = field(default_factory=set)
    guests: dict[int, None] = field(default_factory=dict)
    pinned: set[int] = field(default_factory=set)
    evictions: int = 0
    seen: int = 0  # lookups learned of (kvd.cluster.plans' count)

    def _evict_one(self) -> bool:
        for key in self.guests:
            if key not in self.pinned:
                del self.guests[key]
                self.held.discard(key)
                self.evictions += 1
                return True
        victim = self.policy.victim(self.pinned.__contains__)
        if victim is None:
            return False
        self.policy.remove(victim)
        self.held.discard(victim)
        self.evictions += 1
        return True

    def store(self, key: int, parent: int | None, guest: bool) -> bool:
        """A put (or a fetched copy) of ``key``; a held one is touched. False
        when it could not be stored: everything else is pinned."""
        if key in self.held:
            self.policy.touch(key)  # a guest is not the policy's: a no-op
            return True
        while len(self.held) >= self.capacity:
            if not self._evict_one():
                return False
        self.held.add(key)
        if guest:
            self.guests[key] = None
        else:
            self.policy.insert(key, parent)
        return True

    def learn(
        self,
        chain: list[int],
        hits: int,
        mine: list[bool],
        touched: Sequence[int],
        untold: int = 0,
        holder: _Member | None = None,
    ) -> None:
        """A lookup learned of, after ``untold`` ones it was not told of; when
        a plan is due (``plan_due``) it adopts ``holder``'s."""
        for _ in range(untold):
            self.policy.on_lookup([], 0, [])
        for key in touched:
            self.policy.touch(key)
        self.policy.on_lookup(chain, hits, mine)
        before = self.seen
        self.seen += 1 + untold
        if plan_due(before, self.seen) and holder is not None and holder is not self:
            plan = holder.policy.shared_plan()
            if plan is not None:
                self.policy.adopt_plan(plan)


def _hand_off(nodes: list[_Member], owner: list[int], histories: bool) -> None:
    """After a change of members: each member's own values that another
    member owns now go to it, with their history in its policy
    (``EvictionPolicy.history``, ``expect``), and stay here as guests (in
    order of block id, the order of first appearance, as the values came;
    without a parent); a guest it owns now becomes its own. Without
    ``histories`` each arrives as an unannounced put (the daemon before
    PEER_HISTORY)."""
    for i, node in enumerate(nodes):
        for key in sorted(node.held):
            if key not in node.held:
                continue  # evicted by a value handed to this member meanwhile
            to = owner[key]
            if key in node.guests:
                if to == i:
                    del node.guests[key]
                    node.policy.insert(key, None)
            elif to != i:
                _give(node, nodes[to], key, histories)
                node.policy.remove(key)
                node.guests[key] = None


def _hand_over(leaving: _Member, nodes: list[_Member], owner: list[int], histories: bool) -> None:
    """A member leaving hands each value it owns to its owner among the
    others (``kvd.cluster.rebalance``'s ``leave``), with its history."""
    for key in sorted(leaving.held):
        if key not in leaving.guests:
            _give(leaving, nodes[owner[key]], key, histories)


def _give(giver: _Member, to: _Member, key: int, histories: bool) -> None:
    """``key`` put at ``to`` as its own (with its history at ``giver``)."""
    history = giver.policy.history(key) if histories else None
    if history is not None and key not in to.held:
        to.policy.expect(key, history)
    to.store(key, None, guest=False)


def owners_of(trace: Trace, members: Sequence[str], namespace: str) -> list[int]:
    """Each block's owner, an index into ``members``."""
    placement = Placement(members)
    index = {member: i for i, member in enumerate(members)}
    return [index[placement.owner(namespace, block_key(b))] for b in range(trace.n_unique)]


def simulate_pool(
    trace: Trace,
    policy_name: str,
    members: Sequence[str],
    capacity_blocks: int,
    *,
    namespace: str = "replay",
    wrap: Callable[[EvictionPolicy[int]], EvictionPolicy[int]] | None = None,
    in_step: bool = True,
    join: tuple[int, str] | None = None,
    leave: tuple[int, str] | None = None,
    hand_off: bool = True,
    leave_hand_off: bool = True,
    histories: bool = True,
    counted_from: int = 0,
) -> SimResult:
    """Replay ``trace`` over ``members`` of ``capacity_blocks`` each (module doc);
    the result's capacity is the pool's total at the end (after a join or
    a leave).

    ``join`` ``(request, member)``: that member (``capacity_blocks`` more)
    joins before that request; from then on request ``i`` goes through
    member ``i mod N`` of the new list. With ``hand_off`` the old members
    hand it the values it owns now, as ``kvd.cluster.rebalance`` does (in
    the order they came, a copy staying as a guest); without, they keep
    them where lookups do not look, as the daemon did before;
    ``histories``: with their history in the old owner's policy.

    ``leave`` ``(request, member)``: that member leaves before that request
    (after a join at the same request); with ``leave_hand_off`` it first
    hands the values it owns to their owners among the others
    (``pool_leave_handoff_ms``), and with ``hand_off`` the others keep the
    copies they hold of its values as their own. Hits count from request
    ``counted_from`` on."""
    if policy_name not in POLICIES:
        raise SimError(f"unknown policy {policy_name!r}; expected one of {POLICIES}")
    if not members or len(set(members)) != len(members):
        raise SimError(f"members must be distinct and at least one: {list(members)}")
    if capacity_blocks < 0:
        raise SimError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if join is not None and join[1] in members:
        raise SimError(f"the member joining is one already: {join[1]}")
    policies = [make_policy(policy_name) for _ in members]
    nodes = [_Member(wrap(p) if wrap else p, capacity_blocks) for p in policies]
    n_members = len(nodes)
    holder = nodes[members.index(min(members))] if in_step else None
    # untold[a][b]: member a's lookups since it last told b, none of b's keys.
    untold = [[0] * n_members for _ in nodes]
    owner = owners_of(trace, members, namespace)
    blocks: list[int] = trace.blocks.tolist()
    offsets: list[int] = trace.offsets.tolist()
    inputs: list[int] = trace.input_tokens.tolist()
    block_hits = token_hits = 0
    started = time.perf_counter()
    for request in range(len(offsets) - 1):
        if join is not None and request == join[0]:
            members = [*members, join[1]]
            nodes.append(_Member(make_policy(policy_name), capacity_blocks))
            n_members = len(nodes)
            holder = nodes[members.index(min(members))] if in_step else None
            untold = [[*row, 0] for row in untold] + [[0] * n_members]
            owner = owners_of(trace, members, namespace)
            if hand_off:
                _hand_off(nodes, owner, histories)
        if leave is not None and request == leave[0]:
            if leave[1] not in members or len(members) == 1:
                raise SimError(f"the member leaving is none of several: {leave[1]}")
            gone = members.index(leave[1])
            members = [m for m in members if m != leave[1]]
            leaving = nodes.pop(gone)
            n_members = len(nodes)
            holder = nodes[members.index(min(members))] if in_step else None
            untold = [[n for j, n in enumerate(row) if j != gone]
                      for i, row in enumerate(untold) if i != gone]  # fmt: skip
            owner = owners_of(trace, members, namespace)
            if leave_hand_off:
                _hand_over(leaving, nodes, owner, histories)
            if hand_off:
                _hand_off(nodes, owner, histories)
        chain = blocks[offsets[request] : offsets[request + 1]]
        n = len(chain)
        me = request % n_members
        here = nodes[me]
        owners = [owner[key] for key in chain]
        local = 0
        while local < n and chain[local] in here.held:
            local += 1
        others = set(owners) - {me}
        if n_members == 1:
            here.learn(chain, local, [True] * n, chain[:local])
        else:
            here.learn(chain, local, [o == me for o in owners], chain[:local], holder=holder)
            told = untold[me]
            for other in range(n_members):
                if in_step and other != me and other not in others:
                    told[other] += 1
            for other in sorted(others):
                node = nodes[other]
                hits = 0
                touched = []
                for key, o in zip(chain, owners, strict=True):
                    if o == other:
                        if key not in node.held:
                            break
                        touched.append(key)
                    hits += 1
                mine = [o == other for o in owners]
                node.learn(chain, hits, mine, touched, told[other], holder)
                told[other] = 0
        found = local
        while found < n:
            key = chain[found]
            if key in here.held or (owners[found] != me and key in nodes[owners[found]].held):
                found += 1
                continue
            break
        here.pinned = set(chain[:local])
        parent = None
        for key, o in zip(chain[:found], owners[:found], strict=True):
            if key in here.held:
                here.policy.touch(key)  # the get
            else:
                nodes[o].policy.touch(key)  # the owner's get, then a guest copy here
                here.store(key, parent, guest=True)
            parent = key
        for key, o in zip(chain[found:], owners[found:], strict=True):
            if o != me:
                nodes[o].store(key, parent, guest=False)
            if not here.store(key, parent, guest=o != me):
                break  # as simulate: the rest of the chain is not stored
            parent = key
        here.pinned = set()
        if request >= counted_from:
            block_hits += found
            token_hits += _token_hits(found, n, inputs[request], trace.block_tokens)
    return SimResult(
        policy=policy_name,
        capacity_blocks=capacity_blocks * n_members,
        requests=len(trace),
        block_refs=trace.n_refs,
        block_hits=block_hits,
        token_refs=int(trace.input_tokens.sum()),
        token_hits=token_hits,
        evictions=sum(node.evictions for node in nodes),
        policy_ops=0,
        elapsed_s=time.perf_counter() - started,
    )
