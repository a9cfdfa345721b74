"""The scheduler: which queued asks make the next round, as a pure function of the queue and the pool.

State-ready traversal (RadixFlow): in queue order, each ask looks up the furthest checkpoint matching its
trunk; an ask that would resume from a checkpoint another admitted ask writes in this very round waits for
the next round, while the scan goes on filling the round with independent work up to its token, request,
question and history-page limits. Asks with identical trunks share one request (its trunk computed once).
A round always admits its first ask, however large; cancelled asks are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flide_sdk.device.pool import Checkpoint
from flide_sdk.plan.layout import PAGE
from flide_sdk.serve.asks import Ask, TrunkKey
from flide_sdk.text.history import BLOCK, Trunk

DEFER_MIN_TOKENS = 64
"""An ask waits for a checkpoint written in the same round only if it saves this many more trunk tokens
(at least BLOCK: producers are found by the hash of their first block)."""


@dataclass(frozen=True)
class RoundLimits:
    """What one round holds at most: stream tokens, scratch state rows (`requests`: one per distinct trunk and
    one per text-scored question), branch pieces (a question's, and one per option of a text-scored one), and
    history pages its resumed requests read (None: no limit); where a round saves its checkpoints: at the
    stable boundary rounded down to a multiple of `save_align` (the batch-invariant mode: the GDN chunk); and
    whether short sibling pieces share GDN chunks (`plan.tree.pack_siblings`; not in the batch-invariant mode)."""

    tokens: int
    requests: int
    questions: int
    pages: int | None = None
    save_align: int = 1
    pack: bool = True

    def save_point(self, trunk: Trunk) -> int:
        return trunk.boundary // self.save_align * self.save_align


@dataclass(eq=False)
class Request:
    """Asks sharing one trunk, and the checkpoint they resume from (None: from the start)."""

    asks: list[Ask]
    resume: Checkpoint | None

    @property
    def lead(self) -> Ask:
        return self.asks[0]

    @property
    def resume_length(self) -> int:
        return 0 if self.resume is None else self.resume.length


@dataclass(eq=False)
class RoundBatch:
    """The next round's requests, and the asks left queued (in queue order) with how many of them wait for a
    checkpoint this round writes."""

    requests: list[Request] = field(default_factory=list)
    kept: list[Ask] = field(default_factory=list)
    deferred: int = 0

    @property
    def asks(self) -> list[Ask]:
        return [ask for request in self.requests for ask in request.asks]


def waits_for(ask: Ask, resume_length: int, producer: Request, at: int) -> bool:
    """Whether `ask` (resuming `resume_length` tokens) should rather resume from the checkpoint `producer`
    saves in this round at `at`: worth a round's wait only when it saves DEFER_MIN_TOKENS more."""
    trunk, theirs = ask.trunk, producer.lead.trunk
    if not resume_length + DEFER_MIN_TOKENS <= at < len(trunk) or at <= producer.resume_length:
        return False
    blocks = at // BLOCK  # when both hashes are stored, they give a quick no before comparing tokens
    ours = trunk.block_hash(blocks) if blocks <= trunk.boundary // BLOCK else None
    if ours is not None and ours != theirs.block_hash(blocks):
        return False
    return trunk.prefix_equals(theirs.buffer, at) and not ask.same_trunk(producer.lead)


def schedule(queue: Iterable[Ask], lookup: Callable[[Trunk], Checkpoint | None], limits: RoundLimits) -> RoundBatch:
    """The next round from the queued asks, in order. `lookup` finds an ask's furthest checkpoint."""
    batch = RoundBatch()
    by_trunk: dict[TrunkKey, list[Request]] = {}
    by_first_block: dict[int, list[Request]] = {}
    tokens = questions = pages = rows = 0
    for ask in queue:
        if ask.future.cancelled():
            continue
        resume = lookup(ask.trunk)
        resume_length = 0 if resume is None else resume.length
        first_block = ask.first_block
        if any(waits_for(ask, resume_length, producer, limits.save_point(producer.lead.trunk))
               for producer in by_first_block.get(first_block, ())):
            batch.kept.append(ask)
            batch.deferred += 1
            continue
        key = ask.trunk_key
        shared = next((r for r in by_trunk.get(key, ()) if r.lead.same_trunk(ask)), None)
        cost = ask.branch_tokens + (0 if shared else len(ask.trunk) - resume_length)
        history = 0 if shared else -(-resume_length // PAGE)
        full = (tokens + cost > limits.tokens or rows + (shared is None) + ask.branches.inner > limits.requests
                or questions + len(ask.branches.lengths) > limits.questions
                or limits.pages is not None and pages + history > limits.pages)
        if batch.requests and full:
            batch.kept.append(ask)
            continue
        if shared is not None:
            shared.asks.append(ask)
        else:
            request = Request([ask], resume)
            batch.requests.append(request)
            by_trunk.setdefault(key, []).append(request)
            if first_block is not None:
                by_first_block.setdefault(first_block, []).append(request)
        tokens += cost
        rows += (shared is None) + ask.branches.inner
        questions += len(ask.branches.lengths)
        pages += history
    return batch
