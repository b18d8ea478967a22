"""PipeDream's weight stashing (PipeDream §3.3), mixed into simulator.engine.Engine, and the swap
of its stashed versions to host memory (MPress §II-D: GPU-CPU swap applies to all model data;
``offload.stash_swap_layers``).

Versions. PipeDream updates a stage's weights after every backward (§3.3, no gradient
accumulation), so every update starts a new version; a microbatch's forward uses the live one and
its backward needs that same version, which by then is stale. Per stage the walk keeps a version
counter (one step per backward), the version each in-flight microbatch's forward used and how many
in-flight microbatches use each version; the warm-up's forwards all run before the first update,
so they share one version.

Device bytes of the stash (memory category STASHED): the stage's weights that stay on the device
(``parameters_bytes - stash_swap_bytes``) once per DISTINCT stale version an in-flight microbatch
uses, as executor.pipedream holds them: an update whose live weights an in-flight microbatch holds
replaces them out of place (a new version from the update's start, :meth:`_stash_clone`); a stale
version goes at the end of the backward of its last in-flight microbatch. With few microbatches
(m < 2(p - i) - 2 on stage i) that is fewer than the steady state's p - i - 1
(simulator.stash_peak.stashed_version_counts, the closed form's count). The swapped part
``stash_swap_bytes`` (costs.static.stash_swap_bytes) per version:

* when it goes stale (the end of the update that replaces it) one device->host copy over the
  node's host link (the d2h copy engine activation swaps use, transfers._host_out); its device
  bytes go when the copy ends, its pinned host buffer is reserved at the copy's issue;
* before each backward that needs it, a host->device copy issued when the position's preceding
  pass starts (not before the version's d2h copy has ended), the backward waiting for it if late;
  its device bytes exist from the issue to that backward's end; the host buffer goes when the
  version's last microbatch's copy has ended.

A version whose backward is the very next pass when it goes stale (the cool-down of a position
with two microbatches in flight) is not copied out: its prefetch point has passed, so it stays on
the device until that backward ends, as a round trip could only stall it.

Peers instead of the host (``offload.stash_targets``, MPress §III-C; Table IV moves Bert's early
stages' data to later stages, whose fewer stashed versions leave memory spare): both copies are
D2D, one stripe per target (costs.static.stash_stripes, by weight) over the peer links activation
D2D swaps use (transfers._d2d_out / _d2d_in: the same link resources), at the same points. A
target holds its stripe (memory category SWAPPED, "held for peers", as an activation stripe) from
the copy out's arrival (executor.d2d allocates it when the message lands) to the end of the
version's last copy back; the host holds nothing. So p - i - 1 versions are on the peers at once
only between the newest's arrival and the oldest's return, both issued at the update's end: a
moment, which the closed form (simulator.analytic) counts in full.
"""
from __future__ import annotations

from costs.static import stash_stripes
from simulator.memory import BUFFERS, STASHED, SWAPPED
from simulator.stagecost import StageCost
from specs.schedule import plan_order


def _ws_weights(sc: StageCost) -> int:
    """Weight bytes of ``sc``'s weight-swapped layers (simulator/weightswap.py): a stale version of
    them stays in host memory (specs.plan_memory.OffloadPolicy.weight_swap_layers)."""
    return sum(lc.ws_weight_bytes for lc in sc.layers)


class StashEvents:
    """Weight stashing and its host swap (the Engine's state: env, mem, links, costs, trace, ...)."""

    def _stash_setup(self) -> None:
        plan = self.plan
        self._stash_swap = self._stash and any(sc.stash_swap_bytes for sc in self.costs)
        self._live_version: dict[int, int] = {}     # stage -> updates so far (the live version's id)
        self._live_users: dict[int, int] = {}       # stage -> in-flight microbatches on the live version
        self._mb_version: dict[tuple[int, int], int] = {}   # (stage, mb) -> version its forward used
        self._version_held: dict[tuple[int, int], int] = {}  # (stage, version) -> in-flight microbatches on it
        self._version_users: dict[tuple[int, int], int] = {}  # (stage, version) -> fetches still to come
        self._version_out_ns: dict[tuple[int, int], int] = {}  # (stage, version) -> its d2h copy's end
        self._stash_fetch: dict[tuple[int, int], int] = {}  # (stage, mb) -> when its copy is on the device
        self._stash_awaiting: set[tuple[int, int]] = set()  # backward next, version still live
        self._upcoming: list = []
        # stage -> (target device, stripe bytes) of a stashed version held by peers (MPress §III-C)
        self._stash_stripes = {s: stash_stripes(self.model, plan, st)
                               for s, st in enumerate(plan.stages) if st.offload.stash_targets}
        # a tied embedding/head over stage 0 and the last stage (executor.pipedream): the last
        # stage holds its gradient message of update k until its forward k + p, stage 0 the sum
        # it sends back until its update k + p (executor.pipedream._reap: by then the schedule
        # has delivered them); those not due by then are held to the iteration's end
        self._tied_msg_bytes = 0
        self._updates: dict[int, int] = {}  # stage -> updates so far this iteration
        if self._stash and len(plan.stages) > 1:
            import costs.buffers

            # each message is the rank's vocabulary shard: executor.pipedream pairs tp rank t of
            # stage 0 (row-parallel embedding) with tp rank t of the last (column-parallel head)
            self._tied_msg_bytes = -(-costs.buffers.tied_sync_buffer_bytes(self.model, plan, plan.stages[0])
                                     // plan.stages[0].tp)
        if self._stash_swap:  # the pass after the current one, per position (a prefetch point)
            for pos in range(plan.pipeline_depth):
                order = plan_order(plan, pos)
                next(order, None)  # the first pass is the current one when the walk starts
                self._upcoming.append(order)

    # ---- forward and backward ------------------------------------------------------------------
    def _stash_weights(self, w, sc: StageCost, s: int, k: int, t0: int) -> None:
        """At forward ``k``'s start: it uses the live version (PipeDream §3.3), which stays on the
        device as a stashed version if an update comes before its backward (:meth:`_stash_clone`)."""
        w.in_flight[s] = w.in_flight.get(s, 0) + 1
        v = self._live_version.get(s, 0)
        self._mb_version[(s, k)] = v
        self._version_held[(s, v)] = self._version_held.get((s, v), 0) + 1
        self._live_users[s] = self._live_users.get(s, 0) + 1

    def _unstash_weights(self, w, sc: StageCost, s: int, k: int) -> None:
        """At backward ``k``'s end: its version (or fetched copy) is no longer needed by it; a
        stale version no other in-flight microbatch uses goes."""
        w.in_flight[s] -= 1
        v = self._mb_version.pop((s, k))
        left = self._version_held.pop((s, v)) - 1
        if left:
            self._version_held[(s, v)] = left
        live = v == self._live_version.get(s, 0)
        if live:
            self._live_users[s] -= 1  # ran on the live weights: nothing was stashed
        elif not left:
            w.mem.add(self.env.now, STASHED, -(sc.static.parameters_bytes - sc.stash_swap_bytes))
            if sc.weight_swap:  # the stale host copy of its weight-swapped layers goes too
                self._host(w.pos, -_ws_weights(sc))
        if not sc.stash_swap_bytes:
            return
        self._stash_awaiting.discard((s, k))
        if self._stash_fetch.pop((s, k), None) is not None:
            w.mem.add(self.env.now, STASHED, -sc.stash_swap_bytes)

    def _stash_clone(self, w, sc: StageCost, s: int) -> None:
        """At the start of stage ``s``'s update: live weights an in-flight microbatch holds are
        replaced out of place (executor.pipedream._update), the old ones a stashed version."""
        if self._live_users.get(s, 0):
            w.mem.add(self.env.now, STASHED, sc.static.parameters_bytes - sc.stash_swap_bytes)
            if sc.weight_swap:  # weight-swapped layers' live weights are on the host: the CPU step
                self._host(w.pos, _ws_weights(sc))  # keeps the version they replace there

    def _stash_pass(self, pos: int) -> None:
        """At the start of each pass of position ``pos``: if the next pass is a backward whose
        version waits in host memory, prefetch it now."""
        nxt = next(self._upcoming[pos], None)
        if nxt is None or nxt[0] != "B" or not self.costs[nxt[1]].stash_swap_bytes:
            return
        _, s, k = nxt
        version = self._mb_version[(s, k)]
        if version == self._live_version.get(s, 0):
            self._stash_awaiting.add((s, k))  # not stale (yet): see _stash_stale
            return
        self._stash_in(pos, self.costs[s], s, k, version)

    def _stash_wait(self, w, s: int, k: int):
        """Before backward ``k``: wait for its version's host->device copy (the compute stream is
        held, so PipeDream's steady state counts it)."""
        ready = self._stash_fetch.get((s, k))
        env = self.env
        if ready is not None and ready > env.now:
            t0 = env.now
            yield env.timeout(ready - t0)
            self.events += 1
            w.busy += env.now - t0
            self.trace.slice(w.rep, "compute", f"wait stash s{s} mb{k}", t0, env.now - t0, "stall")

    # ---- copies --------------------------------------------------------------------------------
    def _stash_stale(self, w, sc: StageCost, s: int) -> None:
        """At the end of stage ``s``'s update: the version it replaced goes stale; if microbatches
        in flight still need it, it is copied to the host (its device bytes go when the copy ends),
        except for one whose backward is next (kept on the device until then)."""
        old = self._live_version.get(s, 0)
        self._live_version[s] = old + 1
        users = self._live_users.pop(s, 0)
        if not sc.stash_swap_bytes or not users:
            return
        env, mem, nbytes = self.env, w.mem, sc.stash_swap_bytes
        now = env.now
        for key in sorted(self._stash_awaiting):
            if key[0] == s and self._mb_version[key] == old:  # prefetch point passed: stays here
                self._stash_awaiting.discard(key)
                mem.add(now, STASHED, nbytes)
                self._stash_fetch[key] = now
                users -= 1
        if not users:
            return
        mem.add(now, STASHED, nbytes)
        if s in self._stash_stripes:
            end = self._stash_d2d_out(sc, s, old, now)
        else:
            start, end = self.links.reserve((("d2h", self._switch(sc.rep)),), sc.stash_copy_ns, now)
            self.trace.slice(sc.rep, "d2h", f"stash out s{s} v{old}", start, sc.stash_copy_ns, "swap")
            self._host(w.pos, nbytes)  # pinned host buffer reserved at enqueue
        self._later(end - now, lambda _e: mem.add(env.now, STASHED, -nbytes))
        self._version_users[(s, old)] = users
        self._version_out_ns[(s, old)] = end

    def _stash_in(self, pos: int, sc: StageCost, s: int, k: int, version: int) -> None:
        """Copy microbatch ``k``'s stashed version back, not before it has reached the host; the
        pinned host buffer goes after the version's last such copy."""
        env, nbytes = self.env, sc.stash_swap_bytes
        now = env.now
        earliest = max(now, self._version_out_ns[(s, version)])
        self.mem[pos].add(now, STASHED, nbytes)  # destination allocated when the copy is enqueued
        d2d = self._stash_stripes.get(s)
        if d2d is not None:
            ends = self._stash_d2d_in(sc, s, k, earliest)
            end = max(ends)
        else:
            start, end = self.links.reserve((("h2d", self._switch(sc.rep)),), sc.stash_copy_ns, earliest)
            self.trace.slice(sc.rep, "h2d", f"stash in s{s} mb{k}", start, sc.stash_copy_ns, "swap")
        self._stash_fetch[(s, k)] = end
        left = self._version_users[(s, version)] - 1
        if left:
            self._version_users[(s, version)] = left
            return
        del self._version_users[(s, version)]
        del self._version_out_ns[(s, version)]
        if d2d is None:
            self._later(end - now, lambda _e: self._host(pos, -nbytes))
            return
        for (dev, part), e in zip(d2d, ends):  # each peer lets its stripe go once it is back
            tl = self._extra(dev)
            self._later(e - now, lambda _e, tl=tl, part=part: tl.add(env.now, SWAPPED, -part))

    def _stash_d2d_out(self, sc: StageCost, s: int, version: int, now: int) -> int:
        """A stale version's stripes to its peers (MPress §III-C), from ``now``; each peer's buffer
        is allocated when its stripe lands. Returns when the last stripe has landed."""
        end = now
        for dev, part in self._stash_stripes[s]:
            dur, res = self._transfer_ns(part, sc.rep, dev)
            start, e = self.links.reserve(res, dur, now)
            tl = self._extra(dev)  # the peer's buffer: allocated once the stripe has arrived
            self._later(e - now, lambda _e, tl=tl, part=part: tl.add(self.env.now, SWAPPED, part))
            self.trace.slice(sc.rep, f"peer->{dev}", f"stash out s{s} v{version}", start, dur, "swap")
            end = max(end, e)
        return end

    def _stash_d2d_in(self, sc: StageCost, s: int, k: int, earliest: int) -> list[int]:
        """Microbatch ``k``'s version back from the peers, not before ``earliest``: each stripe's
        end, in target order."""
        ends = []
        for dev, part in self._stash_stripes[s]:
            dur, res = self._transfer_ns(part, dev, sc.rep)
            start, e = self.links.reserve(res, dur, earliest)
            self.trace.slice(sc.rep, f"peer->{dev}", f"stash in s{s} mb{k}", start, dur, "swap")
            ends.append(e)
        return ends

    # ---- tied embedding messages (module doc of executor.pipedream) ---------------------------
    def _tied_update(self, s: int) -> None:
        """Update number k of stage ``s`` ran: book the tied-gradient messages it sends or takes."""
        k = self._updates.get(s, 0)
        self._updates[s] = k + 1
        tb, last = self._tied_msg_bytes, len(self.plan.stages) - 1
        if not tb or s not in (0, last):
            return
        now = self.env.now
        if s == last:
            self.mem[last].add(now, BUFFERS, tb)
        else:
            if k >= self.plan.pipeline_depth:
                self.mem[0].add(now, BUFFERS, -tb)
            self.mem[0].add(now, BUFFERS, tb)

    def _tied_forward(self, s: int, k: int) -> None:
        """The last stage's forward ``k`` lets go of its message of update k - p."""
        if self._tied_msg_bytes and s == len(self.plan.stages) - 1 and k >= self.plan.pipeline_depth:
            self.mem[s].add(self.env.now, BUFFERS, -self._tied_msg_bytes)
